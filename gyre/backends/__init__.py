"""Backends (docs/design.md §1, §3): what the runtime plugs in, chosen in one place (`factory.py`).

At the top, what every sub-package shares:

    protocols.py   RolloutEngine / Actor / WeightTransport: what the runtime types against
    factory.py     the one place that turns the config into a rank's engine, actor and transport
    config.py      tyro dataclasses for all of the above (`--backend.*`, `--engine.*`, ...)
    devices.py     the built-in engine's device (--backend.device) and a collective's (CUDA on NCCL groups)

The sub-packages:

    engines/       rollout engines (CPU, SGLang, deterministic) and how one is served to the proxy
                   (host thread, HTTP + websocket wire)
    actors/        training actors (CPU, Megatron), the HF ⇄ megatron-core mapping, memory hand-over
    transfer/      moving tensors between ranks: weight snapshots and transports, KV-cache migration
    models/        the model code both sides share: architecture registry (arch/), HF models and
                   presets, the built-in tokenizer and a run's vocabulary

Each one's `__init__.py` lists its modules. Nothing is imported here: GPU libraries load lazily
inside the adapters.
"""
