"""Backends: protocols, the built-in CPU engine and actor, SGLang / Megatron adapters, transfer.

    protocols.py       RolloutEngine / Actor / WeightTransport contracts (shared)
    models.py          Qwen2 decoders from size presets ('tiny', 'small'), packed forward, HF checkpoints
    decoder.py         functional Qwen2 forward over per-request KV caches (the CPU engine's kernel)
    sampling.py        temperature / top-p sampling with explicit generators, reported log-probs
    cpu_engine.py      CpuEngine: asyncio front, continuous batching, weight updates between steps
    cpu_actor.py       CpuActor: GSPO forward/backward on packed micro-steps, core-only AdamW
    transfer.py        flat snapshot layout + CRC, broadcast / Mooncake primitives, retention, byte counts
    weights.py         WeightTransports keeping bytes out of the store: torch (gloo p2p server), mooncake
    factory.py         the one place that turns the config into a rank's engine, actor and transport
    sglang_engine.py   SglangEngine (GPU): embedded sglang.Engine
    megatron_actor.py  MegatronActor (GPU): megatron-core GPTModel, HF ⇄ megatron weight mapping
    tokenizer.py       the repo's byte-level BPE with a chat template
    config.py          tyro dataclasses for all of the above

Nothing is imported here: GPU libraries load lazily inside the adapters.
"""
