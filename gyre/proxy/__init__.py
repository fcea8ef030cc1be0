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

from gyre.proxy.config import ProxyConfig, RoleRulesConfig
from gyre.proxy.core import ApiError, Proxy
from gyre.proxy.router import Router
from gyre.proxy.server import serve_proxy, start_proxy
from gyre.proxy.sink import MemorySink, RecordSink, StoreSink

__all__ = ["ApiError", "MemorySink", "Proxy", "ProxyConfig", "RecordSink", "RoleRulesConfig", "Router", "StoreSink", "serve_proxy", "start_proxy"]
