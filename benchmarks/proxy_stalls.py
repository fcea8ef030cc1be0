"""Adversarial body shapes and a legitimate 783k-token prompt against the proxy (issue 34), the
stall stage of `benchmarks/proxy_bench.py` (run it there; `--stalls-only` runs just this stage).

For each shape, in one run and side by side: `--fair-keys` victim executions send small calls
50 ms apart, quiet and while one more execution (its own process) sends the shape as fast as its
rate budget lets it (it waits out each 429's Retry-After), in alternating rounds. Per shape: victims' p99 loaded / quiet
(goal <= 2), the shape's own p50 through the proxy and (the 783k prompt) the same ids sent to
the engine alone, and the proxy's CPU per shape call (its process and its body-parsing worker).

  nested_schemas_3mib   3 MiB of tool schemas nested 20 deep (within the limits: parsed off the loop, rendered, refused as over the context)
  anthropic_300k_blocks 300k one-character Anthropic content blocks (refused: proxy.max_body_items)
  responses_300k_items  300k Responses input items (refused: proxy.max_body_items)
  tools_20k             20k tools (refused: proxy.max_tools)
  tiny_messages_15mib   15 MiB of one-character messages (refused: proxy.max_body_items)
  prompt_783k           a legitimate 783k-token conversation (~290 turns of code), answered
  stream_top20_30k      a streamed 30,000-token answer with `top_logprobs: 20` from the instant engine, read whole
  body_top20_30k        the same answer not streamed: one JSON body of ~50 MB, read whole
  unread_top20_x4       the same call on 4 connections whose client never reads (raw sockets, a 4 KiB receive
                        buffer), held until the proxy has dropped every one (`proxy.client_stall_s`, 5 s
                        here): the loaded phase lasts that long; the dropped connections and the proxy's
                        resident memory (peak over the phase, MiB) are reported beside

Each quiet phase starts once the proxy and the engine have gone idle (`settle`): an engine keeps
generating an aborted call's backlog for seconds, and a quiet phase timed in it is not quiet.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from pathlib import Path

NESTED_DEPTH = 20
TOP20 = {"model": "m", "max_tokens": 30_000, "stream": True, "logprobs": True, "top_logprobs": 20, "messages": [{"role": "user", "content": "hi"}]}
UNREAD = {"unread_top20_x4": 4}  # shape -> connections that never read their answer
HOLD_LIMIT_S = 120.0  # an unread connection the proxy has not dropped by then is reported `held`


def _schema(depth: int) -> dict:
    s: dict = {"type": "string", "description": "a leaf"}
    for i in range(depth):
        s = {"type": "object", "description": f"level {i}", "properties": {f"field_{i}": s, "count": {"type": "integer"}}, "required": [f"field_{i}"]}
    return s


def conversation(tokens: int) -> list[dict]:
    """A conversation of ~`tokens` tokens (the project's tokenizer): turns of 8,000 characters of
    the tokenizer's corpus (Python source), alternating user / assistant, ending on a user turn."""
    from gyre.backends.models.tokenizer import ASSET_DIR, CORPUS_FILE

    corpus = Path(ASSET_DIR, CORPUS_FILE).read_text()
    msgs, chars, pos, i = [{"role": "system", "content": "You are a coding agent."}], int(tokens * 2.9), 0, 0
    while chars > 0:
        if pos + 8000 > len(corpus):
            pos = 0
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"[{i}] " + corpus[pos : pos + 8000]})
        pos, i, chars = pos + 8000, i + 1, chars - 8000
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "go on"})
    return msgs


def shapes(prompt_tokens: int = 783_000) -> dict[str, tuple[str, bytes]]:
    """name -> (path, body bytes)."""
    one = {"type": "function", "function": {"name": "t", "description": "d", "parameters": _schema(NESTED_DEPTH)}}
    n = (3 << 20) // len(json.dumps(one))
    tiny = {"role": "user", "content": "x"}
    out = {
        "nested_schemas_3mib": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                                         "tools": [{"type": "function", "function": dict(one["function"], name=f"t{i % 1000}_{i}")} for i in range(n)]}),
        "anthropic_300k_blocks": ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 300_000}]}),
        "responses_300k_items": ("/v1/responses", {"model": "m", "max_output_tokens": 16, "input": [tiny] * 300_000}),
        "tools_20k": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                               "tools": [{"type": "function", "function": {"name": f"t{i}", "description": "d", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(20_000)]}),
        "tiny_messages_15mib": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [tiny] * ((15 << 20) // len(json.dumps(tiny)) - 16)}),
        "prompt_783k": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": conversation(prompt_tokens)}),
        "stream_top20_30k": ("/v1/chat/completions", TOP20),
        "body_top20_30k": ("/v1/chat/completions", dict(TOP20, stream=False)),
        "unread_top20_x4": ("/v1/chat/completions", TOP20),
    }
    return {k: (p, json.dumps(b).encode()) for k, (p, b) in out.items()}


def tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its live children (the proxy and its body-parsing worker), found
    through /proc/PID/task/*/children (a few small reads, not a scan of /proc: it runs twice a call)."""
    def one(p) -> float:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    total = one(pid)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return total
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                total += sum(one(c) for c in f.read().split())
        except OSError:
            continue
    return total


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def settle(pids: list[int], idle_cpu: float = 0.05, step_s: float = 0.25, limit_s: float = 120.0) -> float:
    """Wait until `pids` together use under `idle_cpu` of a core over `step_s` (or `limit_s`);
    -> seconds waited."""
    t0 = time.perf_counter()
    c = sum(tree_cpu_s(p) for p in pids)
    while time.perf_counter() - t0 < limit_s:
        await asyncio.sleep(step_s)
        now = sum(tree_cpu_s(p) for p in pids)
        if now - c < idle_cpu * step_s:
            break
        c = now
    return time.perf_counter() - t0


async def hold_unread(stop, url: str, path: str, raw: bytes, key: str, proxy_pid: int, n: int) -> tuple:
    """`n` connections send `raw` and never read (a 4 KiB receive buffer), until the proxy has
    dropped them all (TCP state no longer established), `stop`, or HOLD_LIMIT_S. -> ("dropped" |
    "held", seconds, proxy CPU s, the proxy's peak resident MiB, connections dropped)."""
    import socket
    import urllib.parse

    loop = asyncio.get_running_loop()
    u = urllib.parse.urlsplit(url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    c0, t0, socks = tree_cpu_s(proxy_pid), time.perf_counter(), []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        await loop.sock_connect(s, (u.hostname, u.port))
        await loop.sock_sendall(s, head + raw)
        socks.append(s)
    peak, dropped = rss_mib(proxy_pid), 0
    while dropped < n and not stop.is_set() and time.perf_counter() - t0 < HOLD_LIMIT_S:
        await asyncio.sleep(0.1)
        peak = max(peak, rss_mib(proxy_pid))
        dropped = sum(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1 for s in socks)  # 1: TCP_ESTABLISHED
    for s in socks:
        s.close()
    return "dropped" if dropped == n else "held", time.perf_counter() - t0, tree_cpu_s(proxy_pid) - c0, peak, dropped


async def send_shape(go, busy, stop, url: str, path: str, raw: bytes, key: str, proxy_pid: int | None, unread: int = 0) -> list[tuple]:
    """The attacker: while `go` is set (until `stop`), sends `raw` to `path` as `key` as fast as the
    proxy lets it (it waits out each 429's Retry-After); `busy` is 1 while a call may be in flight.
    Per attempt: (status | "closed", seconds, proxy CPU s); with `unread` > 0, `hold_unread`'s."""
    import aiohttp

    if unread:
        out = []
        while not stop.is_set():
            busy.value = 1
            if not go.is_set():
                busy.value = 0
                await asyncio.sleep(0.01)
                continue
            out.append(await hold_unread(stop, url, path, raw, key, proxy_pid, unread))
        return out

    hdr = {"Authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)) as session:
        while not stop.is_set():
            busy.value = 1  # before looking at `go`: a pause waits for the call this may start
            if not go.is_set():
                busy.value = 0
                await asyncio.sleep(0.01)
                continue
            c0, t0 = tree_cpu_s(proxy_pid) if proxy_pid else 0.0, time.perf_counter()
            try:
                async with session.post(url + path, data=raw, headers=hdr) as r:
                    await r.read()
                    status, wait = r.status, float(r.headers.get("Retry-After", 0) or 0)
            except aiohttp.ClientError:  # refused before its body was read: the proxy closed the connection
                status, wait = "closed", 0.5
            out.append((status, time.perf_counter() - t0, (tree_cpu_s(proxy_pid) - c0) if proxy_pid else 0.0))
            if wait:
                await asyncio.sleep(wait)
    return out


def _quiet_collector() -> None:
    """Everything alive now out of the garbage collector's reach (`gc.freeze`, as the proxy does at
    serve time): a full collection in a client walking the libraries it imported would pause its
    loop 30-80 ms, timed as if the proxy were slow."""
    gc.collect()
    gc.freeze()


def _attacker_main(args: tuple, go, busy, stop, q) -> None:
    _quiet_collector()
    q.put(asyncio.run(send_shape(go, busy, stop, *args)))


async def quiet_then_loaded(session, victims, calls: int, attack: tuple, rounds: int = 4, idle_pids: list[int] | None = None,
                            hold: bool = False) -> tuple[list[float], list[float], list[tuple]]:
    """The victims' latencies alone and while an attacker (`send_shape(*attack)`) runs, side by
    side in one run: `rounds` alternations of a quiet and a loaded phase of `calls / rounds` victim
    calls each (the attacker starts 0.3 s before a loaded phase, and a quiet phase waits for its
    last call), so slow drifts of a shared machine fall on both alike. The attacker is its own
    process, as another harness is: its client-side work (sending MiBs, reading /proc) never runs
    on the loop that times the victims. `victims(session, n)` -> n latencies. Returns (quiet,
    loaded, the attacker's attempts). `idle_pids`: each quiet phase first waits for these processes
    to go idle (`settle`). `hold`: the loaded phase goes on (batches of victim calls) until the
    attacker's last attempt has ended (an unread stream ends when the proxy drops it)."""
    import multiprocessing as mp

    _quiet_collector()
    ctx = mp.get_context("spawn")
    go, stop, busy, q = ctx.Event(), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    p = ctx.Process(target=_attacker_main, args=(attack, go, busy, stop, q), daemon=True)
    p.start()
    quiet: list[float] = []
    loud: list[float] = []
    for r in range(rounds):
        n = calls // rounds + (r < calls % rounds)
        if idle_pids:
            await settle(idle_pids)
        quiet += await victims(session, n)
        go.set()
        await asyncio.sleep(0.3)
        loud += await victims(session, n)
        go.clear()
        while busy.value:
            if hold:
                loud += await victims(session, max(1, n // 4))
            else:
                await asyncio.sleep(0.01)
    stop.set()
    attempts = await asyncio.get_running_loop().run_in_executor(None, q.get, True, 600)
    p.join(10)
    return quiet, loud, attempts


async def run_shape(url: str, keys: list[str], path: str, raw: bytes, per_phase: int, proxy_pid: int, max_tokens: int = 8, unread: int = 0,
                    idle_pids: list[int] | None = None) -> dict:
    """Quiet victims, then victims while keys[0] sends `raw` to `path` within its rate budget;
    each quiet phase waits for `idle_pids` (the proxy's, the engine's) to go idle."""
    import aiohttp

    small = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "task: list the files"}]}

    async def victims(session, calls):
        lat: list[float] = []
        per = max(1, calls // (len(keys) - 1))

        async def one(key):
            for _ in range(per):
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=small, headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
        await asyncio.gather(*(one(k) for k in keys[1:]))
        return lat

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)) as session:
        await victims(session, len(keys) - 1)  # warm-up
        rss_before = rss_mib(proxy_pid)
        quiet, loud, attempts = await quiet_then_loaded(session, victims, per_phase, (url, path, raw, keys[0], proxy_pid, unread),
                                                        idle_pids=idle_pids, hold=unread > 0)
    codes: dict = {}
    for status, *_ in attempts:
        codes[str(status)] = codes.get(str(status), 0) + 1
    served = [(t, c) for status, t, c, *_ in attempts if status not in (429, "closed")]
    peak = max((a[3] for a in attempts if len(a) > 3), default=None)
    unread_out = {"unread_connections": unread * len(attempts), "unread_dropped": sum(a[4] for a in attempts),
                  "unread_held_s": [round(a[1], 1) for a in attempts]} if unread else {}
    n = len(served)
    return {"quiet_p99_ms": _pct(quiet, 99) * 1e3, "loaded_p99_ms": _pct(loud, 99) * 1e3, "p99_ratio": _pct(loud, 99) / _pct(quiet, 99),
            "quiet_p50_ms": _pct(quiet, 50) * 1e3, "loaded_p50_ms": _pct(loud, 50) * 1e3, "victim_calls": len(loud), "quiet_calls": len(quiet),
            "quiet_top_ms": [round(x * 1e3, 1) for x in sorted(quiet)[-8:]], "loaded_top_ms": [round(x * 1e3, 1) for x in sorted(loud)[-8:]],
            "shape_calls": n, "shape_status": codes, "shape_body_mib": len(raw) / 2**20,
            "shape_p50_ms": _pct([t for t, _ in served], 50) * 1e3 if n else None,
            "proxy_cpu_ms_per_shape_call": sum(c for _, c in served) / n * 1e3 if n else None,
            **({"proxy_peak_rss_mib": peak, "proxy_rss_before_mib": rss_before} if peak is not None else {}), **unread_out}


async def engine_alone_ms(engine_url: str, secret: str, ids: list[int], n: int = 3) -> float:
    """p50 of handing `ids` straight to the engine, the way the proxy does (one websocket, the ids
    as an int32 frame, `HttpEngine`), and reading 4 tokens."""
    from gyre.backends.engines.engine_http import HttpEngine
    from gyre.backends.protocols import SamplingParams

    client = HttpEngine(engine_url, name="alone", transport="ws", secret=secret)
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        out = [ev async for ev in client.generate(f"alone{i}", ids, SamplingParams(max_tokens=4))]
        assert out, "the engine sent no token"
        lat.append(time.perf_counter() - t0)
    await client.close()
    return _pct(lat, 50) * 1e3
