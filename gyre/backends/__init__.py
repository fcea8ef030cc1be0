"""Backends (docs/design.md §1, §3): what the runtime plugs in, chosen in one place (`factory.py`).

    protocols.py       RolloutEngine / Actor / WeightTransport: what the runtime types against
    factory.py         the one place that turns the config into a rank's engine, actor and transport
    config.py          tyro dataclasses for all of the above (`--backend.*`, `--engine.*`, ...)
  engines
    cpu_engine.py      CpuEngine: asyncio front, continuous batching, weight updates between steps
    decoder.py         functional decoder forward over per-request KV caches (the CPU engine's kernel)
    sampling.py        temperature / top-p sampling with explicit generators, reported log-probs
    sglang_engine.py   SglangEngine (GPU): embedded sglang.Engine
    sglang_checkpoint.py the directory SGLang starts on (the checkpoint itself, or written with architectures, dtype)
    det_engine.py      a deterministic engine (tokens from a hash) for tests and benchmarks
  engine servers (an engine in one process, the proxy in another)
    engine_host.py     a rank's engine served over HTTP from its own thread, driven by its worker
    engine_http.py     serve_engine / HttpEngine: the engine protocol over HTTP + websocket
    engine_mux.py      the multiplexed websocket framing of generate / abort traffic
  actors
    cpu_actor.py       CpuActor: GSPO forward/backward on packed micro-steps, core-only AdamW
    megatron_actor.py  MegatronActor (GPU): megatron-core GPTModel from a config or a checkpoint read lazily
    mcore_mapping.py   HF ⇄ megatron-core names and shards per family (local / TE layouts, TP / EP), layout checks
    memory.py          ActorMemory: an actor's state to (pinned) host memory entering rollout, back entering training
    models.py          HF models of the arch families; Qwen2 size presets ('tiny', 'small'), packed forward, checkpoints
  architectures
    arch/              the registry: one module per family (qwen2, qwen3, qwen3_moe, llama), SUPPORTED, family_of
    tokenizer.py       the repo's byte-level BPE with a chat template (the built-in presets)
    vocab.py           the run's tokenizer (a checkpoint's own): every id's bytes, stop ids, size checks
  weight transports
    transfer.py        flat snapshot layout + CRC, broadcast / Mooncake primitives, retention, byte counts
    weights.py         the WeightTransports: SnapshotBoard (store), TorchWeights (gloo p2p), MooncakeWeights
  devices
    devices.py         the built-in engine's device (--backend.device) and a collective's (CUDA on NCCL groups)

Nothing is imported here: GPU libraries load lazily inside the adapters.
"""
