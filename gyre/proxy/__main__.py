"""Run the proxy as its own process: `python -m gyre.proxy --store-dir DIR [--proxy.port 0 ...]`.

Records go to the on-disk TITO store under `--store-dir`. The admin API is enabled with the token
from `--proxy.admin-token` or the GYRE_PROXY_ADMIN_TOKEN environment variable (preferred: not
visible in `ps`). Engines are added with `--engines name=url@kind:index ...` or later through
the admin API; their servers' secret (`gyre.backends.engines.engine_http`) comes from the
GYRE_ENGINE_SECRET environment variable. When serving, one JSON line {"url", "port"} is printed
to stdout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field

from gyre.proxy.config import ProxyConfig

_ENGINE = re.compile(r"^(?P<name>[^=]+)=(?P<url>https?://[^@]+)@(?P<kind>pool|cell):(?P<index>\d+)$")


@dataclass(kw_only=True)
class ProxyProcessConfig:
    """The proxy as a standalone process."""

    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    store_dir: str
    """Directory of the TITO store (one file per execution)."""
    engines: tuple[str, ...] = ()
    """Engines served over HTTP, as name=url@kind:index (kind: pool | cell)."""


def main(argv: list[str] | None = None) -> None:
    import tyro

    cfg = tyro.cli(ProxyProcessConfig, args=argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.proxy.admin_token is None and os.environ.get("GYRE_PROXY_ADMIN_TOKEN"):
        cfg.proxy = dataclasses.replace(cfg.proxy, admin_token=os.environ["GYRE_PROXY_ADMIN_TOKEN"])

    from gyre.proxy.core import Proxy
    from gyre.backends.engines.engine_http import HttpEngine
    from gyre.proxy.server import serve_proxy
    from gyre.proxy.sink import StoreSink
    from gyre.trajectory.store import TitoStore

    proxy = Proxy(cfg.proxy, sink=StoreSink(TitoStore(cfg.store_dir)))
    engine_secret = os.environ.get("GYRE_ENGINE_SECRET")
    for spec in cfg.engines:
        m = _ENGINE.match(spec)
        if m is None:
            raise SystemExit(f"--engines: {spec!r} is not name=url@kind:index")
        proxy.router.add_engine(HttpEngine(m["url"], name=m["name"], secret=engine_secret), kind=m["kind"], index=int(m["index"]))
    handle = serve_proxy(proxy)
    print(json.dumps({"url": handle.url, "port": handle.port}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    handle.stop()
    proxy.sink.close()


if __name__ == "__main__":
    main(sys.argv[1:])
