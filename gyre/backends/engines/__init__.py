"""Rollout engines (docs/design.md §1), and how an engine is served to the proxy.

  engines
    cpu_engine.py        CpuEngine: asyncio front, continuous batching, weight updates between steps
    decoder.py           functional decoder forward over per-request KV caches (the CPU engine's kernel)
    sampling.py          temperature / top-p sampling with explicit generators, reported log-probs
    sglang_engine.py     SglangEngine (GPU): embedded sglang.Engine
    sglang_checkpoint.py the directory SGLang starts on (the checkpoint itself, or written with
                         architectures, dtype), and the SglangEngine built from a run's config
    det_engine.py        a deterministic engine (tokens from a hash) for tests and benchmarks
  serving (an engine in one process, the proxy in another)
    engine_host.py       a rank's engine served over HTTP from its own thread, driven by its worker
    engine_http.py       serve_engine / HttpEngine: the engine protocol over HTTP + websocket
    engine_mux.py        the multiplexed websocket framing of generate / abort traffic

Nothing is imported here.
"""
