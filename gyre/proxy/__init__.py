"""Black-box proxy (docs/design.md §4; docs/proxy_harnesses.md): the OpenAI (chat, completions,
responses) and Anthropic APIs, TITO recording with exact splicing, per-execution keys, role
classification, and drain / reroute routing.

    from gyre.proxy import Proxy, ProxyConfig, serve_proxy
    proxy = Proxy(ProxyConfig(), sink=...)        # records go to sink.on_record(CallRecord)
    proxy.router.add_engine(engine, kind="cell", index=1)
    key = proxy.issue_key("exec-0")
    handle = serve_proxy(proxy)                    # handle.url + "/v1", handle.stop()

Out of process: `python -m gyre.proxy --store-dir DIR` + `gyre.proxy.admin.AdminClient`.
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
