"""Activation checkpointing of the decoder layers (`--actor.activation-checkpointing`).

Each decoder layer of a supported family (`model.model.layers`, the same in qwen2, qwen3,
qwen3_moe and llama) is wrapped so that, when gradients are being recorded, it runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward keeps only the layer's
inputs, and the backward recomputes the layer to get what it needs. A micro-step of T tokens then
holds layers × T × hidden floats of inputs plus one layer's activations at a time, instead of
every layer's (gyre.backends.actors.accounting). Without gradients (a forward-only pre-pass, the
engine) the layer runs as is.

Our own wrapper rather than transformers' `gradient_checkpointing_enable`: that one is deprecated
in transformers 5 (renamed `activation_checkpointing_enable`), and it also forces the input
embeddings to require grad. Dropout is 0 in every supported family, so the recompute is exact.

    n = checkpoint_decoder_layers(model)   # layers wrapped (idempotent)
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_decoder_layers", "decoder_layers"]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM of a supported family (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers; activation "
                         f"checkpointing covers the families of gyre.backends.models.arch")
    return layers


def checkpoint_decoder_layers(model) -> int:
    """Wrap every decoder layer's forward in a non-reentrant checkpoint (while grad is enabled);
    returns the number of layers wrapped. Calling it again changes nothing."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_gyre_checkpointed", False):
            continue
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward
        layer._gyre_checkpointed = True
    return len(layers)
