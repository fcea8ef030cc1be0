"""Black-box proxy (docs/design.md §4): OpenAI / Anthropic APIs, TITO recording with exact splicing,
per-execution keys and roles, routing with drain/reroute, engines over HTTP.

    from gyre.proxy import Proxy, ProxyConfig, serve_proxy
    proxy = Proxy(ProxyConfig(), sink=...)        # records go to sink.on_record(CallRecord)
    proxy.router.add_engine(engine, kind="cell", index=1)
    key = proxy.issue_key("exec-0")
    handle = serve_proxy(proxy)                    # handle.url + "/v1", handle.stop()
    handle.call(proxy.router.drain("cell1"))       # from another thread: reroute its calls

Out of process: `python -m gyre.proxy --store-dir DIR` + `gyre.proxy.admin.AdminClient`.
Engines in other processes: `gyre.proxy.engine_http.serve_engine(engine)` / `HttpEngine(url)`.
"""

from gyre.proxy.config import ProxyConfig, RoleRulesConfig
from gyre.proxy.core import ApiError, Proxy
from gyre.proxy.router import Router
from gyre.proxy.server import serve_proxy, start_proxy
from gyre.proxy.sink import MemorySink, RecordSink, StoreSink

__all__ = ["ApiError", "MemorySink", "Proxy", "ProxyConfig", "RecordSink", "RoleRulesConfig", "Router", "StoreSink", "serve_proxy", "start_proxy"]
