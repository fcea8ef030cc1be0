"""Black-box proxy (docs/design.md §4): OpenAI (chat, completions, responses) and Anthropic APIs, TITO
recording with exact splicing, per-execution keys, role classification, drain/reroute routing.

    server.py          aiohttp app: routes, auth, JSON errors
    openai_api.py      POST /v1/chat/completions, /v1/completions, GET /v1/models
    responses_api.py   POST /v1/responses (+ GET /v1/responses/{id}): input items, tools, events
    anthropic_api.py   POST /v1/messages
    core.py            one call: render, generate through the router, record (TITO)
    render.py          chat template with re-sent assistant turns spliced to their sampled tokens
    formats/           chat formats as declared data, one module each; format_for picks the checkpoint's
    textstream.py      streamed text → content and tool calls
    keys.py            per-execution API keys
    roles.py           role classification (main / summary / sub-agent) of a call
    router.py          least-loaded routing with affinity; drain and reroute without aborting a call
    sink.py            where records go (memory, TITO store)
    admin.py           the out-of-process control API and its client
    validate.py        request field checks that name the field
    config.py          ProxyConfig, RoleRulesConfig

    from gyre.proxy import Proxy, ProxyConfig, serve_proxy
    proxy = Proxy(ProxyConfig(), sink=...)        # records go to sink.on_record(CallRecord)
    proxy.router.add_engine(engine, kind="cell", index=1)
    key = proxy.issue_key("exec-0")
    handle = serve_proxy(proxy)                    # handle.url + "/v1", handle.stop()
    handle.call(proxy.router.drain("cell1"))       # from another thread: reroute its calls

Out of process: `python -m gyre.proxy --store-dir DIR` + `gyre.proxy.admin.AdminClient`.
Engines in other processes: `gyre.backends.engines.engine_http.serve_engine(engine)` / `HttpEngine(url)`.
"""

import importlib

# name -> module: imported on first use, so `gyre.proxy.config` (the `--proxy.*` section, read by
# gyre.config and the launcher's preflight) does not pull aiohttp and torch in.
_LAZY = {"ProxyConfig": "config", "RoleRulesConfig": "config", "ApiError": "core", "Proxy": "core", "Router": "router",
         "serve_proxy": "server", "start_proxy": "server", "MemorySink": "sink", "RecordSink": "sink", "StoreSink": "sink"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gyre.proxy' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gyre.proxy.{_LAZY[name]}"), name)
