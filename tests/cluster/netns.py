"""Two "nodes" on one machine: two network namespaces joined by a veth pair, each with its own
address in a private range and nothing else (no default route, no link to the host's network),
so traffic goes only between them, and a process run in one sees only its own address and
loopback, as a rank on a real node does. Creating namespaces needs root (CAP_NET_ADMIN);
`problem()` says why not where it cannot.

    with TwoNodes() as nodes:
        nodes.addr[0], nodes.addr[1]              # e.g. "10.211.37.1", "10.211.37.2"
        nodes.popen(1, ["python", "-c", "..."])   # runs inside node 1's namespace
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from typing import Any, Sequence


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def problem() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"gyre-probe-{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()[:200]}"
    _ip("netns", "del", probe)
    return None


class TwoNodes:
    """Namespaces `<name>-0` and `<name>-1`, veth `<tag>a`/`<tag>b` between them, addresses
    10.<a>.<b>.1 and .2 /24 (random a, b, so parallel tests do not collide), loopback up."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"gyre-{tag}-0", f"gyre-{tag}-1"]
        self.ifname = [f"gv{tag}a", f"gv{tag}b"]  # each node's one interface (GLOO_SOCKET_IFNAME)
        net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.addr = [f"{net}.1", f"{net}.2"]

    def __enter__(self) -> "TwoNodes":
        try:
            for ns in self.ns:
                self._must("netns", "add", ns)
            self._must("link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1])
            for ns, veth, addr in zip(self.ns, self.ifname, self.addr):
                self._must("link", "set", veth, "netns", ns)
                self._must("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                self._must("-n", ns, "link", "set", veth, "up")
                self._must("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth pair, and so both
            _ip("netns", "del", ns)

    @staticmethod
    def _must(*args: str) -> None:
        r = _ip(*args)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.ns[node], *argv]

    def env(self, node: int) -> dict[str, str]:
        """What a process on node `node` needs besides its namespace: gloo picks its interface from
        the host name, which every namespace shares with the machine (so it would pick loopback)."""
        return {"GLOO_SOCKET_IFNAME": self.ifname[node]}

    def popen(self, node: int, argv: Sequence[str], *, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(node, argv), env={**os.environ, **self.env(node), **(env or {})}, **kw)
