"""Cost as the work grows (issue 33): every series side by side in one run, each with a fitted
growth exponent (least squares on log-log: cost ∝ size^b; b = 1 is linear, b = 0 flat).
(Over 600 lines: the six series live side by side because the issue asks for them in one run.)

  * proxy      proxy + router + TITO store (a spawned process) routing to 8 and 64 engine
               endpoints, deterministic engines at `--token-delay` s/token served by
               `--engine-procs` other processes (each engine its own port, reached as in a run:
               HttpEngine over the websocket mux; `--in-process-engines`: inside the proxy
               process instead, their CPU then counted as the proxy's) with N = 64 … 4,096
               executions open at once: each an async client in this process, its own key,
               multi-turn (the whole history re-sent each turn, assistant turns as the proxy
               returned them), lognormal think times (`--think-s` mean). Added latency = call
               latency − tokens × token delay (so any lag of the engines or their link counts
               against the proxy); CPU s per call of the proxy process and, apart, of the engine
               processes; the proxy's garbage-collector pauses, and the share of the window it was
               runnable but had no core (the machine's other work); calls served vs offered
               (N / (think + token time)); RSS, descriptors and
               threads of the proxy process, per open execution over its idle baseline; TITO
               store bytes per recorded token; records lost (client 200s minus records in the
               store: must be 0); the legs of the added latency (`legs_ms_p50_p99`: client → proxy,
               inside the proxy less the tokens' time, proxy → client; the client's clock against
               the proxy's records).
  * context    one execution whose prompt is ~1k, 8k, 32k, 64k tokens (`--context-tokens`: a
               history of 300-word tool outputs, re-sent each call with its new turns), an instant
               engine in another process: the proxy's CPU a call and the call's latency, p50/p99.
  * scheduler  the decision core (gyre.scheduler.ElasticScheduler) driven by the simulator
               (gyre.sim: the paper's 122B duration law, C_e = 144, B = 4 groups per cell) at
               K = 8 … 256 cells; only the core's own calls are timed: time per event, per
               optimizer step, and control-plane messages per step (see `_messages`).
  * store      the control plane's TCPStore traffic at R = 64, 256 ranks (threads in a few client
               processes, each its own store connection, as in benchmarks/store_poll_bench.py):
               per step the controller sends every rank a command and waits for every reply;
               store requests per step, per rank, the step's round trip and the server's CPU.
  * trajectory gyre.trajectory (tree + selection + packing) on one execution of 636, 6,360 and
               63,600 calls (10/100 copies of benchmarks/trajectory_bench.py's execution at 0.1
               token scale: ~0.1M → ~10M unique tokens): time and peak memory (tracemalloc).
  * soak       many short executions (key, `--soak-calls-per-exec` calls, close) through the
               proxy + TITO store, `--soak-calls` calls in all (50,000: ~94 s at ~530 calls/s on
               the 2-core machine), no new execution after `--soak-max-s` (the run says if
               that bound cut it short), RSS/fds/threads sampled each second: growth after
               warm-up (the first 20 % of calls).

    python benchmarks/scale_bench.py            # the full run (~12 min on an idle 2-core machine: an estimate
                                                # from its parts: proxy ~6 min, soak ~1.5-3 (at most 8), rest ~3)
    python benchmarks/scale_bench.py --quick    # short form (~5 min on a loaded 2-core machine)

The last line printed is one JSON object with the figures. Left out: a real model (engines are
instant apart from their token delay), other nodes (clients, proxy, engine processes share this
machine's cores, so latency on a loaded machine is the machine's: see `calibration_loop_ns`).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proxy_bench import SYSTEM, TOOLS, _calibrate_ns, _cpu_s  # noqa: E402
from benchmarks.proxy_bench import _pct as _pct_of  # noqa: E402
from benchmarks.null_proxy import null_times  # noqa: E402


def _pct(xs, p):
    """Percentile p of xs (nan when there are none: a machine too loaded to finish a call)."""
    return _pct_of(xs, p) if xs else float("nan")

ADMIN = "scale-bench-admin"


# ---- shared helpers -----------------------------------------------------------------------------
def fit_exponent(xs, ys) -> float | None:
    """b of ys ≈ a·xs^b by least squares on log-log (None: fewer than 2 positive points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx, 3) if sxx else None


def proc_stats(pid: int) -> dict:
    """RSS (bytes), open descriptors and threads of process `pid` (Linux /proc)."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


# ---- proxy: a spawned process; its engines in other processes (as in a run) or, flagged, inside it ----
def _sampler_child(pid: int, period: float, conn, stop) -> None:
    """`proc_stats(pid)` every `period` s, sent over `conn`, until `stop` is set."""
    while not stop.wait(period):
        conn.send(proc_stats(pid))
    conn.close()


class Sampler:
    """`proc_stats` of a process sampled in another process: listing /proc/PID/fd with ~4,400
    descriptors takes 2-7 ms, which on the load generator's event loop delayed the calls that
    were due then (their latency charged to the proxy: p99 +20 ms at 4,096 open)."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        ctx = mp.get_context("spawn")  # (a fork would copy the load generator's ~4,000 sockets)
        self._conn, child = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_sampler_child, args=(pid, period, child, self._stop), daemon=True)
        self._proc.start()
        child.close()
        self.samples: list[dict] = []

    def drain(self) -> None:
        """Take the samples sent so far (the pipe's buffer never fills: a sample is ~70 bytes)."""
        while self._conn.poll():
            self.samples.append(self._conn.recv())

    def stop(self) -> list[dict]:
        """Stop sampling (blocks up to a period: call it off the event loop); every sample taken."""
        self._stop.set()
        try:
            while True:
                self.samples.append(self._conn.recv())
        except EOFError:
            pass
        self._proc.join(10)
        return self.samples


def _engines_child(q, first: int, count: int, token_delay: float, times_path: str | None = None) -> None:
    """Engines e{first}…: each a DeterministicEngine served on its own port (`serve_engine_async`,
    one endpoint each, as an engine rank serves), all on this process's one loop. times_path:
    each request's engine time (`_EngineClock`) is written there when the process is terminated."""
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.engines.engine_http import serve_engine_async

    _quiet_collector()  # stand-ins for GPU engines: their pauses are not the proxy's latency
    clock = _EngineClock(times_path) if times_path else None

    async def main() -> None:
        hs = []
        for i in range(first, first + count):
            engine = DeterministicEngine(f"e{i}", token_delay=token_delay, salt=i)
            if clock is not None:
                clock.wrap(engine)
            hs.append(await serve_engine_async(engine))
        q.put([(h.url, h.secret) for h in hs])
        await asyncio.Event().wait()

    asyncio.run(main())


class _EngineClock:
    """The engine's own time for each request, on the machine's wall clock: (request id, when
    `generate` began, when it yielded its last token). Subtracted from a call's latency it leaves
    what the proxy (and the client) added, the engine's lateness (a busy engine process's timers)
    not included. Written as JSON lines to `path` on SIGTERM."""

    def __init__(self, path: str) -> None:
        import signal

        self.path, self.rows = path, []
        signal.signal(signal.SIGTERM, self._dump)

    def wrap(self, engine) -> None:
        inner, rows = engine.generate, self.rows

        async def generate(request_id, input_ids, sampling):
            t0 = last = time.time()
            async for ev in inner(request_id, input_ids, sampling):
                last = time.time()
                yield ev
            rows.append((request_id, t0, last))

        engine.generate = generate

    def _dump(self, *_) -> None:
        Path(self.path).write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os._exit(0)


def engine_times(paths: list[str]) -> dict[str, list[tuple[float, float]]]:
    """{execution: sorted [(begun, last token)]} from the `_EngineClock` files (the proxy's
    request ids begin with "<execution>/")."""
    out: dict = {}
    for p in paths:
        if os.path.exists(p):
            for line in Path(p).read_text().splitlines():
                rid, t0, t1 = json.loads(line)
                out.setdefault(rid.split("/", 1)[0], []).append((t0, t1))
    return {k: sorted(v) for k, v in out.items()}


def _quiet_collector() -> None:
    """No garbage-collector pauses in this process from here on (everything alive frozen, the
    collector off): for the load generator and the engine stand-ins, whose own pauses (30-60 ms
    full collections over 4,096 harnesses' histories) landed in the added latency as if the
    proxy's. Their reference cycles are few and the runs short; the proxy keeps its collector."""
    gc.collect()
    gc.freeze()
    gc.disable()


async def _loop_lag(lags: list[float], period: float = 0.001) -> None:
    """How late this loop wakes a `period` s sleep, appended to `lags` until cancelled: what the
    load generator itself adds to each call it times."""
    clock = time.perf_counter
    while True:
        t = clock()
        await asyncio.sleep(period)
        lags.append(clock() - t - period)


def start_engines(n_engines: int, n_procs: int, token_delay: float, times_dir: str | None = None) -> tuple[list, list[tuple[str, str]]]:
    """n_engines engine endpoints spread over n_procs spawned processes: (processes, [(url, secret)]).
    times_dir: each process writes its requests' engine times to times_dir/engines<k>.jsonl when terminated."""
    ctx = mp.get_context("spawn")
    procs, qs, first = [], [], 0
    for k in range(n_procs):
        count = n_engines // n_procs + (k < n_engines % n_procs)
        q = ctx.Queue()
        times = os.path.join(times_dir, f"engines{k}.jsonl") if times_dir else None
        p = ctx.Process(target=_engines_child, args=(q, first, count, token_delay, times), daemon=True)
        p.start()
        procs.append(p)
        qs.append(q)
        first += count
    return procs, [e for q in qs for e in q.get(timeout=180)]


def _proxy_child(q, engines: int | list, token_delay: float, store_dir: str, gcs=None, overrides: dict | None = None) -> None:
    """engines: [(url, secret)] of engine endpoints (reached as a run does: HttpEngine over the
    websocket mux), or a count of DeterministicEngines run inside this process. gcs: a shared
    array [collections, pause s in all, longest pause s, full collections, longest full s, objects freed] the
    garbage collector's pauses add to. overrides: ProxyConfig fields other than their defaults."""
    if gcs is not None:
        t0 = [0.0]

        def on_gc(phase, info) -> None:
            if phase == "start":
                t0[0] = time.perf_counter()
            else:
                dt = time.perf_counter() - t0[0]
                gcs[0] += 1
                gcs[1] += dt
                gcs[2] = max(gcs[2], dt)
                gcs[5] += info["collected"]  # what the pauses freed: 0 means the proxy made no cyclic garbage
                if info["generation"] == 2:
                    gcs[3] += 1
                    gcs[4] = max(gcs[4], dt)

        gc.callbacks.append(on_gc)
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.engines.engine_http import HttpEngine
    from gyre.proxy import Proxy, ProxyConfig, StoreSink, serve_proxy
    from gyre.trajectory.store import TitoStore

    config = ProxyConfig(admin_token=ADMIN, **(overrides or {}))
    proxy = Proxy(config, sink=StoreSink(TitoStore(store_dir)))
    if isinstance(engines, int):
        for i in range(engines):
            proxy.router.add_engine(DeterministicEngine(f"e{i}", token_delay=token_delay, salt=i), kind="cell", index=i)
    else:
        for i, (url, secret) in enumerate(engines):
            proxy.router.add_engine(HttpEngine(url, name=f"e{i}", transport="ws", secret=secret), kind="cell", index=i)
    h = serve_proxy(proxy)
    q.put(h.port)
    h.thread.join()


def start_proxy(engines: int | list, token_delay: float, store_dir: str, gcs=None, overrides: dict | None = None,
                impl: str = "gyre"):
    """impl "null": `benchmarks/null_proxy.py`, the proxy's HTTP surface doing none of its work."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if impl == "null":
        from benchmarks.null_proxy import serve

        p = ctx.Process(target=serve, args=(q, engines, store_dir), daemon=True)
    else:
        p = ctx.Process(target=_proxy_child, args=(q, engines, token_delay, store_dir, gcs, overrides), daemon=True)
    p.start()
    return p, f"http://127.0.0.1:{q.get(timeout=180)}"


def _run_wait_s(pid: int) -> float:
    """Seconds the threads of `pid` have spent runnable but waiting for a core (Linux schedstat):
    how much of a latency the machine's other work, not the process, caused."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            pass
    return total / 1e9


def _children(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them (Linux /proc)."""
    return [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]


async def _admin_key(session, url: str, eid: str) -> str:
    async with session.post(url + "/admin/keys", json={"execution_id": eid}, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["key"]


async def _admin_close(session, url: str, eid: str) -> dict:
    async with session.delete(url + f"/admin/executions/{eid}", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


class Harness:
    """One execution: multi-turn chat, the whole history re-sent each turn. `stream`: each call
    streamed (SSE, as Claude Code and Codex call), its chunks counted (`chunks`)."""

    def __init__(self, eid: str, key: str, max_tokens: int, rng: random.Random, stream: bool = False) -> None:
        self.eid, self.key, self.max_tokens, self.rng, self.stream = eid, key, max_tokens, rng, stream
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{eid}: fix the failing test in src/"}]
        self.ok = self.errors = self.chunks = 0

    async def call(self, session, url: str) -> tuple[float, int, float, float, float | None] | None:
        """(latency s, tokens generated, wall clock when sending and when the answer was read,
        time to the first streamed chunk s or None), or None on an error."""
        body = {"model": "m", "max_tokens": self.max_tokens, "tools": TOOLS, "messages": self.messages}
        if self.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        w0, t0 = time.time(), time.perf_counter()
        first = None
        async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {self.key}"}) as r:
            if r.status == 200 and self.stream:
                data, first = await self._read_stream(r, t0)
            else:
                data = await r.json()
            dt, w1 = time.perf_counter() - t0, time.time()
            if r.status != 200:
                self.errors += 1
                return None
        self.ok += 1
        msg = data["choices"][0]["message"]
        self.messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls") and v is not None})
        tool_id = (msg.get("tool_calls") or [{}])[0].get("id")
        result = f"output of step {self.ok}: " + "x" * self.rng.randrange(100, 400)
        self.messages.append({"role": "tool", "tool_call_id": tool_id, "content": result} if tool_id else {"role": "user", "content": result})
        return dt, data["usage"]["completion_tokens"], w0, w1, first

    async def _read_stream(self, r, t0: float) -> tuple[dict, float | None]:
        """A streamed answer as the non-streamed body's fields this harness uses, and the time
        to its first chunk with text or a tool call."""
        content, calls, usage, first = [], {}, {}, None
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices", ()):
                d = ch["delta"]
                if d.get("content") or d.get("tool_calls"):
                    self.chunks += 1
                    first = time.perf_counter() - t0 if first is None else first
                content.append(d.get("content") or "")
                for tc in d.get("tool_calls") or ():
                    c = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
                    c["function"]["name"] += tc.get("function", {}).get("name") or ""
                    c["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
        msg = {"role": "assistant", "content": "".join(content) or None, "tool_calls": [calls[k] for k in sorted(calls)] or None}
        return {"choices": [{"message": msg}], "usage": usage}, first


def _think(rng: random.Random, mean: float) -> float:
    return rng.lognormvariate(math.log(mean) - 0.5 * 0.8**2, 0.8)  # mean `mean`, σ 0.8 in log space


def store_records(store_dir: str, times: dict | None = None) -> tuple[dict, int, int]:
    """{execution: records} in the store, its bytes, and the tokens those records hold (Σ in+out).
    `times`: filled with {execution: [(start, end), ...]}, the proxy's wall clock when each call's
    body was read and when its output was complete, in call order."""
    from gyre.trajectory.store import load_execution

    counts, size, tokens = {}, 0, 0
    for p in Path(store_dir).glob("*.tito"):
        recs = load_execution(p)
        counts[p.stem] = len(recs)
        if times is not None:
            times[p.stem] = sorted((r.start_time, r.end_time) for r in recs)
        size += p.stat().st_size
        tokens += sum(len(r.input_ids) + len(r.output_ids) for r in recs)
    return counts, size, tokens


async def _proxy_load(url: str, pid: int, n: int, a, engine_pids: list[int], gcs) -> dict:
    import aiohttp

    rng = random.Random(n)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        warm = Harness("warm", await _admin_key(session, url, "warm"), a.max_tokens, rng, a.stream)
        for _ in range(5):  # first-call costs (render pool, caches) before the baseline
            await warm.call(session, url)
        harnesses = [Harness(f"x{i}", await _admin_key(session, url, f"x{i}"), a.max_tokens, random.Random(i), a.stream) for i in range(n)]
        _quiet_collector()  # until the series ends (`proxy_series`)
        await asyncio.sleep(0.5)
        base = proc_stats(pid)
        sampler = Sampler(pid)  # started before the load: its start-up is not in the window
        lat, added, walls, ttft = [], [], [], []  # walls: (execution, tokens, sent, answered) of each call timed
        stop, measuring = asyncio.Event(), [False]
        open_now = [0]

        async def run(h: Harness) -> None:
            await asyncio.sleep(rng.uniform(0, a.think_s))  # staggered start
            open_now[0] += 1
            while not stop.is_set():
                counted = measuring[0]  # calls started in the window count, whenever they end
                got = await h.call(session, url)
                if got is not None and counted:
                    lat.append(got[0])
                    added.append(got[0] - got[1] * a.token_delay)
                    walls.append((h.eid, *got[1:4]))
                    if got[4] is not None:
                        ttft.append(got[4])
                try:
                    await asyncio.wait_for(stop.wait(), _think(h.rng, a.think_s))
                except asyncio.TimeoutError:
                    pass

        tasks = [asyncio.ensure_future(run(h)) for h in harnesses]
        await asyncio.sleep(a.think_s * 1.5)  # every execution open and past its first call
        measuring[0] = True
        chunks0 = sum(h.chunks for h in harnesses)
        gc0 = (gcs[0], gcs[1], gcs[3], gcs[5])
        gcs[2] = gcs[4] = 0.0  # the longest pauses in the window
        kids = _children(pid)  # the proxy's body-parse workers (large bodies only)
        ecpu0, kcpu0, wait0 = sum(_cpu_s(e) for e in engine_pids), sum(_cpu_s(k) for k in kids), _run_wait_s(pid)
        cpu0, t0, calls0, ccpu0 = _cpu_s(pid), time.monotonic(), sum(h.ok for h in harnesses), time.process_time()
        health, lags = [], []
        lag_task = asyncio.ensure_future(_loop_lag(lags))
        while time.monotonic() - t0 < a.window_s:
            await asyncio.sleep(0.5)
            h0 = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
            health.append(time.perf_counter() - h0)
            sampler.drain()
        cpu, calls = _cpu_s(pid) - cpu0, sum(h.ok for h in harnesses) - calls0
        chunks = sum(h.chunks for h in harnesses) - chunks0
        lag_task.cancel()
        samples = await asyncio.to_thread(sampler.stop) or [proc_stats(pid)]
        client_cpu = time.process_time() - ccpu0
        engine_cpu = sum(_cpu_s(e) for e in engine_pids) - ecpu0
        kids_cpu = sum(_cpu_s(k) for k in kids) - kcpu0
        run_wait = _run_wait_s(pid) - wait0
        gc_win = (gcs[0] - gc0[0], gcs[1] - gc0[1], gcs[2], gcs[3] - gc0[2], gcs[4], gcs[5] - gc0[3])
        measuring[0] = False
        peak = samples[-1]  # every execution open, with the history it has built up
        stop.set()
        await asyncio.gather(*tasks)
    return {"base": base, "peak": {k: max(s[k] for s in samples) for k in base}, "end": peak, "lat": lat, "added": added,
            "cpu_s": cpu, "window_calls": calls, "chunks": chunks, "ttft": ttft, "client_cpu_s": client_cpu, "engine_cpu_s": engine_cpu, "proxy_children_cpu_s": kids_cpu, "run_wait_s": run_wait, "gc": gc_win, "health": health, "lags": lags, "open": open_now[0],
            "ok": {h.eid: h.ok for h in harnesses} | {"warm": warm.ok}, "errors": sum(h.errors for h in harnesses), "walls": walls}


def _legs(walls: list, times: dict, token_delay: float, engine: dict | None = None) -> dict:
    """Where the added latency of the timed calls went, p50 and p99 of each leg (ms), from the
    client's wall clock and the proxy's record of each call (one machine, one clock):
    to_proxy (the client's encode and send, the proxy's read and parse), in_proxy (body read to
    output complete, less the tokens' time: render, route, the engine link and its lateness),
    to_client (the answer's encode and write, the client's read and decode).
    A call is matched to the record its interval holds (an execution's calls run one at a time;
    a refused call leaves no record); `unmatched` counts calls with none.
    engine ({execution: [(begun, last token)]}, `_EngineClock`): the engine's own time replaces
    the tokens' nominal time in in_proxy, its lateness beyond that is its own leg
    (engine_late), and `proxy_added` is the call's latency less the engine's time: what the
    proxy and the client's link added, the quantity the goal is about."""
    legs: dict = {"to_proxy": [], "in_proxy": [], "to_client": []} | ({"engine_late": [], "proxy_added": []} if engine is not None else {})
    unmatched = engine_unmatched = 0
    for eid, tokens, sent, answered in walls:
        recs = times.get(eid, [])
        k = bisect.bisect_left(recs, (sent,))
        if k == len(recs) or recs[k][1] > answered:
            unmatched += 1
            continue
        start, end = recs[k]
        engine_s = tokens * token_delay
        if engine is not None:
            runs = engine.get(eid, [])
            j = bisect.bisect_left(runs, (start,))
            if j == len(runs) or runs[j][1] > end:
                engine_unmatched += 1
                continue
            engine_s = runs[j][1] - runs[j][0]
            legs["engine_late"].append(engine_s - tokens * token_delay)
            legs["proxy_added"].append(answered - sent - engine_s)
        legs["to_proxy"].append(start - sent)
        legs["in_proxy"].append(end - start - engine_s)
        legs["to_client"].append(answered - end)
    out = {k: [round(_pct(v, 50) * 1e3, 2), round(_pct(v, 99) * 1e3, 2)] if v else None for k, v in legs.items()}
    return out | {"calls": len(legs["in_proxy"]), "unmatched": unmatched} | ({"engine_unmatched": engine_unmatched} if engine is not None else {})


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of process `pid` (and the threads it starts later) onto `cpus` (Linux)."""
    if cpus:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def _cpus(text: str | None) -> set[int] | None:
    """"0-3,8" -> {0, 1, 2, 3, 8}."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def proxy_series(a) -> list[dict]:
    rows, cpus_before = [], os.sched_getaffinity(0)
    overrides = {k: v for k, v in (("gc_young_objects", a.proxy_gc_young), ("gc_every_s", a.proxy_gc_every_s),
                                   ("engine_hold_s", a.proxy_hold_s),
                                   ("stream_interval_s", a.proxy_stream_interval_s)) if v is not None}
    if a.load_cpus:  # this process (the harnesses) and, inheriting it, the engine processes
        pin(os.getpid(), _cpus(a.load_cpus))
    for engines in a.engines:
        for n in a.open_executions:
            store = tempfile.mkdtemp(prefix="scale-proxy-")
            eprocs, endpoints = ([], engines) if a.in_process_engines else start_engines(engines, a.engine_procs, a.token_delay, store)
            try:
                gcs = mp.get_context("spawn").Array("d", 6, lock=False)
                p, url = start_proxy(endpoints, a.token_delay, store, gcs, overrides, a.proxy_impl)
                pin(p.pid, _cpus(a.proxy_cpus))
                try:
                    res = asyncio.run(_proxy_load(url, p.pid, n, a, [q.pid for q in eprocs], gcs))
                finally:
                    gc.unfreeze()  # the collector back on (`_quiet_collector`): the harnesses are gone
                    gc.enable()
                    p.terminate()
                    p.join(10)
            finally:
                for q in eprocs:
                    q.terminate()
                    q.join(10)
            times: dict = {}
            counts, size, tokens = store_records(store, times)
            if a.proxy_impl == "null":  # no TITO records: the calls it answered, timed where Gyre's are
                times = null_times(store)
                counts = {eid: len(v) for eid, v in times.items()}
            clocked = engine_times([os.path.join(store, f"engines{k}.jsonl") for k in range(len(eprocs))]) if eprocs else None
            shutil.rmtree(store, ignore_errors=True)
            legs = _legs(res["walls"], times, a.token_delay, clocked)
            lost = sum(max(0, ok - counts.get(eid, 0)) for eid, ok in res["ok"].items())
            extra = sum(max(0, counts.get(eid, 0) - ok) for eid, ok in res["ok"].items())
            b, e = res["base"], res["end"]
            engine_s = [x - y for x, y in zip(res["lat"], res["added"])] or [0.0]  # a call's token time
            row = {"proxy_impl": a.proxy_impl, "engines": engines, "engine_procs": 0 if a.in_process_engines else min(a.engine_procs, engines),
                   "open_executions": n, "opened": res["open"], "window_calls": res["window_calls"],
                   "calls_per_s": round(res["window_calls"] / a.window_s, 1),
                   "offered_calls_per_s": round(n / (a.think_s + sum(engine_s) / len(engine_s)), 1),  # at zero added latency
                   # the latency less the engine's own time (`_EngineClock`; in-process engines: their nominal time)
                   "proxy_added_ms_p50": (legs.get("proxy_added") or [round(_pct(res["added"], 50) * 1e3, 2)])[0],
                   "proxy_added_ms_p99": (legs.get("proxy_added") or [0, round(_pct(res["added"], 99) * 1e3, 2)])[1],
                   # less the tokens' nominal time: the engine's lateness counted as the proxy's
                   "added_ms_p50": round(_pct(res["added"], 50) * 1e3, 2), "added_ms_p99": round(_pct(res["added"], 99) * 1e3, 2),
                   "latency_ms_p50": round(_pct(res["lat"], 50) * 1e3, 2), "latency_ms_p99": round(_pct(res["lat"], 99) * 1e3, 2),
                   "proxy_cpu_ms_per_call": round(res["cpu_s"] / max(res["window_calls"], 1) * 1e3, 3),
                   "proxy_cpu_fraction": round(res["cpu_s"] / a.window_s, 2),
                   "proxy_run_wait_fraction": round(res["run_wait_s"] / a.window_s, 2),  # runnable, no core free
                   "client_cpu_fraction": round(res["client_cpu_s"] / a.window_s, 2),
                   "client_loop_lag_ms_p50_p99": [round(_pct(res["lags"], q) * 1e3, 2) for q in (50, 99)],
                   "proxy_children_cpu_ms_per_call": round(res["proxy_children_cpu_s"] / max(res["window_calls"], 1) * 1e3, 3),
                   "proxy_gc_collections": int(res["gc"][0]), "proxy_gc_ms_per_call": round(res["gc"][1] / max(res["window_calls"], 1) * 1e3, 3),
                   "proxy_gc_pause_ms_max": round(res["gc"][2] * 1e3, 1), "proxy_gc_full_collections": int(res["gc"][3]),
                   "proxy_gc_full_pause_ms_max": round(res["gc"][4] * 1e3, 1),
                   "proxy_gc_objects_freed": int(res["gc"][5]),  # by the collector in the window (cycles only)
                   "engine_cpu_ms_per_call": round(res["engine_cpu_s"] / max(res["window_calls"], 1) * 1e3, 3),
                   "engine_cpu_fraction": round(res["engine_cpu_s"] / a.window_s, 2),
                   "health_ms_p50": round(_pct(res["health"], 50) * 1e3, 2), "health_ms_max": round(max(res["health"]) * 1e3, 2),
                   "rss_base_mib": round(b["rss"] / 2**20, 1), "rss_open_mib": round(e["rss"] / 2**20, 1),
                   "rss_kib_per_open_execution": round((e["rss"] - b["rss"]) / n / 1024, 1),
                   "fds_base": b["fds"], "fds_open": e["fds"], "fds_peak": res["peak"]["fds"],
                   "fds_per_open_execution": round((e["fds"] - b["fds"]) / n, 3),
                   "threads_base": b["threads"], "threads_peak": res["peak"]["threads"],
                   "tito_bytes_per_token": round(size / max(tokens, 1), 3), "records": sum(counts.values()),
                   "records_lost": lost, "records_unexpected": extra, "errors": res["errors"],
                   "legs_ms_p50_p99": legs}
            if a.stream:
                tokens_per_call = sum(engine_s) / len(engine_s) / a.token_delay
                row |= {"stream": True, "stream_interval_s": a.proxy_stream_interval_s or 0.0,
                        "tokens_per_call": round(tokens_per_call, 1),
                        "proxy_cpu_us_per_token": round(res["cpu_s"] / max(res["window_calls"] * tokens_per_call, 1) * 1e6, 2),
                        "chunks_per_call": round(res["chunks"] / max(res["window_calls"], 1), 1),
                        "ttft_ms_p50_p99": [round(_pct(res["ttft"], q) * 1e3, 2) for q in (50, 99)] if res["ttft"] else None}
            print("proxy", row, flush=True)
            rows.append(row)
    pin(os.getpid(), cpus_before if a.load_cpus else None)  # the later series as they were
    return rows


# ---- context: one execution's prompt growing -----------------------------------------------------
def _filler(j: int) -> dict:
    """A past turn of a long agent context: a tool's output of 300 words."""
    return {"role": "user", "content": f"output of step {j}: " + " ".join(f"w{(j * 131 + k * 7) % 997}" for k in range(300))}


async def _prompt_tokens(session, url: str, key: str, messages: list) -> int:
    body = {"model": "m", "max_tokens": 1, "tools": TOOLS, "messages": messages}
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["usage"]["prompt_tokens"]


async def _context_load(url: str, pid: int, target: int, a) -> dict:
    """One harness whose history is ~`target` tokens, `--context-calls` calls one after another
    (each re-sends the history plus its last turns, as a harness does)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        key = await _admin_key(session, url, f"ctx{target}")
        head = [{"role": "system", "content": SYSTEM}]
        one = await _prompt_tokens(session, url, key, head + [_filler(0)])
        per = await _prompt_tokens(session, url, key, head + [_filler(0), _filler(1)]) - one  # tokens a filler turn
        h = Harness(f"ctx{target}", key, a.max_tokens, random.Random(target))
        h.messages[1:1] = [_filler(j) for j in range(max(0, round((target - one) / per)))]
        keep = len(h.messages) + 4  # the history stays ~target: the latest two turns and answers ride on it
        for _ in range(3):  # the history's turns into the encode cache, as after a harness's first calls
            await h.call(session, url)
        lat = []
        cpu0 = _cpu_s(pid)
        for _ in range(a.context_calls):
            got = await h.call(session, url)
            if got is not None:
                lat.append(got[0])
                del h.messages[keep - 4 : -4]
        cpu = _cpu_s(pid) - cpu0
        tokens = await _prompt_tokens(session, url, key, h.messages)
    return {"prompt_tokens": tokens, "calls": a.context_calls, "errors": h.errors,
            "proxy_cpu_ms_per_call": round(cpu / a.context_calls * 1e3, 3),
            "latency_ms_p50": round(_pct(lat, 50) * 1e3, 2), "latency_ms_p99": round(_pct(lat, 99) * 1e3, 2)}


def context_series(a) -> list[dict]:
    """The proxy's CPU a call and a call's latency (engine instant, in another process) as one
    execution's prompt grows to `--context-tokens`: what a long agent context costs per call."""
    rows = []
    eprocs, endpoints = start_engines(1, 1, 0.0)
    store = tempfile.mkdtemp(prefix="scale-context-")
    p, url = start_proxy(endpoints, 0.0, store, overrides={"max_context_tokens": 2 * max(a.context_tokens) + 4096,
                                                          "calls_per_second_per_key": 0})
    try:
        for target in a.context_tokens:
            rows.append(asyncio.run(_context_load(url, p.pid, target, a)))
            print("context", rows[-1], flush=True)
    finally:
        p.terminate()
        p.join(10)
        for q in eprocs:
            q.terminate()
            q.join(10)
        shutil.rmtree(store, ignore_errors=True)
    return rows


# ---- scheduler decision core -------------------------------------------------------------------
_TIMED = ("start", "on_execution_started", "on_execution_finished", "on_group_ready", "on_switch_done",
          "request_work", "on_work_done", "on_step_done", "tick")


def _messages(decisions, K: int) -> int:
    """Control-plane messages the decisions cost: a switch = command + done report; an optimizer
    step = one command to each cell of its reduce + its done; a publish = one per cell; a work
    item = the claim + its done report (counted in request_work)."""
    from gyre.scheduler import OptimizerStep, Publish, SwitchToRollout, SwitchToTrain

    n = 0
    for d in decisions:
        if isinstance(d, (SwitchToTrain, SwitchToRollout)):
            n += 2
        elif isinstance(d, OptimizerStep):
            n += len(d.cells) + 1
        elif isinstance(d, Publish):
            n += K
    return n


def scheduler_series(a) -> list[dict]:
    from gyre.scheduler.config import SchedulerConfig
    from gyre.sim.config import ClusterConfig, SimConfig
    from gyre.sim.__main__ import build_durations
    from gyre.sim.engine import Simulation

    rows = []
    for K in a.cells:
        cfg = SimConfig(scheduler=SchedulerConfig(batch_groups=4 * K, cell_concurrency=144), cluster=ClusterConfig(num_cells=K),
                        steps=a.sched_steps)
        sim = Simulation(cfg, build_durations(cfg))
        sched, acc = sim.sched, {"events": 0, "s": 0.0, "msgs": 0, "max_s": {}, "max_cpu": {}, "all": []}
        gcs = {"n": 0, "t0": 0.0, "max": 0.0, "sum": 0.0}

        def on_gc(phase, info, _g=gcs):  # a collection's pause: it lands in whichever call allocates
            if phase == "start":
                _g["t0"] = time.perf_counter()
            else:
                dt = time.perf_counter() - _g["t0"]
                _g["n"], _g["sum"], _g["max"] = _g["n"] + 1, _g["sum"] + dt, max(_g["max"], dt)

        for name in _TIMED:
            fn = getattr(sched, name)

            def timed(*args, _fn=fn, _name=name, **kw):
                g0, c0, t0 = gcs["n"], time.thread_time(), time.perf_counter()
                out = _fn(*args, **kw)
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                acc["events"] += 1
                acc["s"] += dt
                acc["max_s"][_name] = max(acc["max_s"].get(_name, 0.0), dt)
                if gcs["n"] == g0:  # the call's own CPU time, no collection inside it
                    acc["max_cpu"][_name] = max(acc["max_cpu"].get(_name, 0.0), dc)
                acc["all"].append(dt)
                if _name == "request_work":
                    acc["msgs"] += 2 if out is not None else 0
                else:
                    acc["msgs"] += _messages(out, K)
                return out

            setattr(sched, name, timed)
        gc.collect()
        gc.callbacks.append(on_gc)
        t0 = time.perf_counter()
        try:
            sim.run()
        finally:
            gc.callbacks.remove(on_gc)
        wall = time.perf_counter() - t0
        steps = sched.version
        row = {"cells": K, "batch_groups": 4 * K, "steps": steps, "events": acc["events"],
               "us_per_event": round(acc["s"] / acc["events"] * 1e6, 2),
               "us_per_event_p99": round(_pct(acc["all"], 99) * 1e6, 2), "us_per_event_p9999": round(_pct(acc["all"], 99.99) * 1e6, 1),
               "max_ms_by_kind": {k: round(v * 1e3, 3) for k, v in acc["max_s"].items()},
               "max_cpu_ms_by_kind_without_gc": {k: round(v * 1e3, 3) for k, v in acc["max_cpu"].items()},
               "gc_collections": gcs["n"], "gc_pause_ms_max": round(gcs["max"] * 1e3, 1), "gc_pause_s_total": round(gcs["sum"], 2),
               "event_log_len": len(sched.log),
               "ms_per_step": round(acc["s"] / steps * 1e3, 2), "events_per_step": round(acc["events"] / steps),
               "messages_per_step": round(acc["msgs"] / steps, 1), "sim_wall_s": round(wall, 1)}
        print("scheduler", row, flush=True)
        rows.append(row)
    return rows


# ---- control-plane store traffic ------------------------------------------------------------------
def _step_clients(port: int, ranks: list[int], steps: int, out) -> None:
    """One client process: a thread per simulated rank, each answering `steps` commands."""
    from torch.distributed import TCPStore

    from benchmarks.store_poll_bench import _Counted
    from gyre.runtime.control import ControlPlane

    calls, lock = [], threading.Lock()

    def rank_main(rank: int) -> None:
        store = _Counted(TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120)))
        cp = ControlPlane(store, rank)
        store.inner.add("ready", 1)
        per_step = []
        for _ in range(steps):
            c0 = store.calls
            cmd = cp.recv(timeout=300)
            cp.send("controller", (rank, cmd))
            per_step.append(store.calls - c0)
        with lock:
            calls.append(per_step)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(calls)


def store_series(a) -> list[dict]:
    from torch.distributed import TCPStore

    from benchmarks.store_poll_bench import _Counted
    from benchmarks.store_poll_bench import _cpu_s as server_cpu
    from gyre.runtime.control import ControlPlane

    rows = []
    for R in a.ranks:
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.store_poll_bench", "--serve"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        port = int(server.stdout.readline())
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_step_clients, args=(port, list(range(i, R, a.store_procs)), a.store_steps, out))
                 for i in range(a.store_procs)]
        for p in procs:
            p.start()
        main = _Counted(TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120)))
        ctl = ControlPlane(main, "controller")
        while int(main.inner.add("ready", 0)) < R:
            time.sleep(0.05)
        rtts, ctl_calls = [], []
        cpu0 = server_cpu(server.pid)
        for s in range(a.store_steps):
            time.sleep(0.2)  # the ranks idle between steps (their poll backs off)
            c0, t0 = main.calls, time.perf_counter()
            for r in range(R):
                ctl.send(r, ("step", s))
            got = {ctl.recv(timeout=120)[0] for _ in range(R)}
            rtts.append(time.perf_counter() - t0)
            ctl_calls.append(main.calls - c0)
            assert got == set(range(R)), "a reply went missing"
        cpu = server_cpu(server.pid) - cpu0
        rank_calls = []
        for _ in procs:
            rank_calls += out.get(timeout=120)
        for p in procs:
            p.join()
        server.stdin.close()
        server.wait()
        rank_per_step = sum(sum(c) for c in rank_calls) / a.store_steps
        row = {"ranks": R, "steps": a.store_steps, "controller_requests_per_step": round(sum(ctl_calls) / a.store_steps, 1),
               "rank_requests_per_step": round(rank_per_step, 1),
               "requests_per_step": round(sum(ctl_calls) / a.store_steps + rank_per_step, 1),
               "requests_per_step_per_rank": round((sum(ctl_calls) / a.store_steps + rank_per_step) / R, 2),
               "step_round_trip_ms_p50": round(_pct(rtts, 50) * 1e3, 1), "step_round_trip_ms_max": round(max(rtts) * 1e3, 1),
               "store_ms_per_request": round(_pct(rtts, 50) / max(1.0, sum(ctl_calls) / a.store_steps) * 1e3, 3),
               "server_cpu_s_per_step": round(cpu / a.store_steps, 4)}
        print("store", row, flush=True)
        rows.append(row)
    return rows


# ---- trajectory processor --------------------------------------------------------------------------
def _execution(copies: int):
    """One execution of copies × 636 calls: trajectory_bench's synthetic execution at token scale 0.1,
    `copies` times (other seeds), its calls numbered on."""
    import dataclasses

    from benchmarks.trajectory_bench import synthesize

    out = []
    for c in range(copies):
        for r in synthesize(c, 0.1):
            out.append(dataclasses.replace(r, call_id=len(out)))
    return out


def trajectory_series(a) -> list[dict]:
    from benchmarks.trajectory_bench import peak_memory, process, timed
    from gyre.trajectory.tree import build_tree

    rows = []
    for copies in a.trajectory_copies:
        recs = _execution(copies)
        tree = build_tree(recs)
        t, _ = timed(lambda: process(recs, 5, 0, 524_288), a.trajectory_repeats)
        peak = peak_memory(lambda: process(recs, 5, 0, 524_288))
        u = tree.stats.unique_tokens
        row = {"calls": len(recs), "unique_tokens": u, "seconds": round(t, 3), "peak_mib": round(peak / 2**20, 1),
               "us_per_unique_token": round(t / u * 1e6, 4), "peak_bytes_per_unique_token": round(peak / u, 1)}
        print("trajectory", row, flush=True)
        rows.append(row)
        del recs, tree
        gc.collect()
    return rows


# ---- soak ---------------------------------------------------------------------------------------------
async def _soak_load(url: str, pid: int, a) -> dict:
    import aiohttp

    samples, done, errors = [], [0], [0]
    stop = asyncio.Event()
    lost = [0]
    per_exec = a.soak_calls_per_exec
    n_execs = math.ceil(a.soak_calls / per_exec)
    next_exec = iter(range(n_execs))

    async def sampler() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append({"t": time.monotonic() - t0, "calls": done[0], **proc_stats(pid)})
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    deadline = time.monotonic() + a.soak_max_s
    started, bound_hit = [0], [False]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(w: int) -> None:
            for i in next_exec:
                if time.monotonic() > deadline:  # the time bound: no new execution starts
                    bound_hit[0] = True
                    break
                started[0] += 1
                eid = f"s{i}"
                h = Harness(eid, await _admin_key(session, url, eid), a.max_tokens, random.Random(i))
                for _ in range(per_exec):
                    await h.call(session, url)
                done[0] += h.ok
                errors[0] += h.errors
                stats = await _admin_close(session, url, eid)
                lost[0] += max(0, h.ok - stats["calls"])

        s = asyncio.ensure_future(sampler())
        await asyncio.gather(*(worker(w) for w in range(a.soak_concurrency)))
        stop.set()
        await s
    return {"samples": samples, "calls": done[0], "errors": errors[0], "lost_by_stats": lost[0],
            "executions": started[0], "time_bound_hit": bound_hit[0]}


def soak(a) -> dict:
    store = tempfile.mkdtemp(prefix="scale-soak-")
    p, url = start_proxy(8, 0.0, store)
    t0 = time.monotonic()
    try:
        res = asyncio.run(_soak_load(url, p.pid, a))
    finally:
        p.terminate()
        p.join(10)
    wall = time.monotonic() - t0
    counts, size, tokens = store_records(store)
    shutil.rmtree(store, ignore_errors=True)
    sm = res["samples"]
    warm = [s for s in sm if s["calls"] >= 0.2 * res["calls"]] or sm
    w0, tail = warm[0], sm[-max(1, len(sm) // 10):]

    def growth(k):
        return (max(s[k] for s in tail) - w0[k]) / w0[k]

    out = {"calls": res["calls"], "executions": res["executions"], "wall_s": round(wall, 1), "calls_per_s": round(res["calls"] / wall, 1),
           "time_bound_hit": res["time_bound_hit"], "errors": res["errors"],
           "records": sum(counts.values()), "records_lost": res["calls"] - sum(counts.values()),
           "rss_mib_after_warmup": round(w0["rss"] / 2**20, 1), "rss_mib_end": round(tail[-1]["rss"] / 2**20, 1),
           "rss_growth_pct": round(100 * growth("rss"), 2),
           "rss_slope_kib_per_1k_calls": round(fit_slope([s["calls"] for s in warm], [s["rss"] for s in warm]) * 1000 / 1024, 2),
           "fds_after_warmup": w0["fds"], "fds_max_tail": max(s["fds"] for s in tail),
           "threads_after_warmup": w0["threads"], "threads_max_tail": max(s["threads"] for s in tail),
           "tito_bytes_per_token": round(size / max(tokens, 1), 3),
           "samples": [[round(s["t"], 1), s["calls"], s["rss"], s["fds"], s["threads"]] for s in sm]}
    print("soak", {k: v for k, v in out.items() if k != "samples"}, flush=True)
    return out


def fit_slope(xs, ys) -> float:
    """Least-squares slope of ys on xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


# ---- main -----------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short form: smaller sizes, shorter windows")
    ap.add_argument("--only", nargs="+", choices=["proxy", "context", "scheduler", "store", "trajectory", "soak"], help="run only these series")
    ap.add_argument("--open-executions", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--engines", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--engine-procs", type=int, default=2, help="processes serving the proxy series' engine endpoints")
    ap.add_argument("--in-process-engines", action="store_true",
                    help="proxy series: run the engines inside the proxy process (their CPU then counts as the proxy's)")
    ap.add_argument("--token-delay", type=float, default=0.02, help="engine seconds per token (50 tokens/s a stream)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=10.0, help="mean think (tool) time between an execution's calls")
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--proxy-cpus", help="proxy series: the CPUs the proxy process runs on, e.g. 0 or 0-1 (default: any); "
                    "with --load-cpus, the proxy's latency without the load generator and engines on its cores")
    ap.add_argument("--load-cpus", help="proxy series: the CPUs of the load generator (this process) and the engine processes, e.g. 1-7")
    ap.add_argument("--proxy-gc-young", type=int, default=None,
                    help="the proxy's ProxyConfig.gc_young_objects (default: its default; 0: Python's own collector threshold)")
    ap.add_argument("--proxy-gc-every-s", type=float, default=None,
                    help="the proxy's ProxyConfig.gc_every_s (default: its default, automatic collection off and a "
                    "full one on that clock; 0: Python's automatic collector)")
    ap.add_argument("--proxy-impl", choices=("gyre", "null"), default="gyre",
                    help="proxy series: Gyre's proxy, or benchmarks/null_proxy.py (its HTTP surface and engine link, none of "
                         "its work): the floor any Python proxy pays on this machine")
    ap.add_argument("--stream", action="store_true", help="proxy series: every call streamed (SSE), as Claude Code and Codex call")
    ap.add_argument("--proxy-stream-interval-s", type=float, default=None, help="proxy series: ProxyConfig.stream_interval_s (default: its default)")
    ap.add_argument("--proxy-hold-s", type=float, default=None,
                    help="the proxy's ProxyConfig.engine_hold_s (default: its default; 0: engines send each token at once)")
    ap.add_argument("--context-tokens", type=int, nargs="+", default=[1000, 8000, 32000, 64000],
                    help="context series: the prompt sizes (tokens) of one execution's calls")
    ap.add_argument("--context-calls", type=int, default=200, help="context series: calls measured at each size")
    ap.add_argument("--cells", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--sched-steps", type=int, default=6)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--store-steps", type=int, default=10)
    ap.add_argument("--store-procs", type=int, default=4)
    ap.add_argument("--trajectory-copies", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--trajectory-repeats", type=int, default=2)
    ap.add_argument("--soak-calls", type=int, default=50_000)
    ap.add_argument("--soak-calls-per-exec", type=int, default=5)
    ap.add_argument("--soak-concurrency", type=int, default=32)
    ap.add_argument("--soak-max-s", type=float, default=480.0, help="no new soak execution starts after this many seconds")
    ap.add_argument("--out", help="the results file to write (machine, versions, config, commit, figures); default: none, print only")
    if ap.parse_known_args()[0].quick:  # smaller defaults; sizes given on the command line still win
        ap.set_defaults(open_executions=[64, 256, 1024], engines=[8], window_s=6.0, think_s=4.0, cells=[8, 32, 128],
                        sched_steps=4, ranks=[16, 64], store_steps=5, context_tokens=[1000, 8000, 32000], context_calls=100, store_procs=2, trajectory_copies=[1, 10],
                        trajectory_repeats=1, soak_calls=5_000)
    a = ap.parse_args()
    if a.proxy_impl == "null" and a.in_process_engines:
        ap.error("--proxy-impl null reaches its engines over the websocket transport: drop --in-process-engines")
    from benchmarks.provenance import provenance, write_results

    config = vars(a) | {"out": a.out and os.path.relpath(a.out, ROOT)}  # no machine paths in the results

    series = a.only or ["proxy", "context", "scheduler", "store", "trajectory", "soak"]
    calib = [_calibrate_ns()]
    print(f"machine load check: {calib[0]:.0f} ns per empty loop iteration (idle core: ~15-30), "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    res: dict = {}
    t_all = time.monotonic()
    for name in series:
        t0 = time.monotonic()
        res[name] = globals()[f"{name}_series" if name != "soak" else "soak"](a)
        calib.append(_calibrate_ns())
        print(f"[{name}: {time.monotonic() - t0:.0f} s]", flush=True)
        if a.out:  # what is done so far survives a later failure
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps({"benchmark": "scale_bench", "partial": True, "config": config, "series": res}, indent=2) + "\n")
    figures = summarize(res, a)
    figures["calibration_loop_ns_max"] = round(max(calib), 1)
    figures["wall_s"] = round(time.monotonic() - t_all, 1)
    figures["goals"] = goals(res, a)  # last: the line ends with what was met
    record = {"benchmark": "scale_bench", **provenance("aiohttp", "numpy"), "config": config, "series": res, "figures": figures,
              "left_out": ["a real model: engines are deterministic, instant apart from their token delay",
                           "other nodes: load generator, proxy, engine processes, store clients share this machine's cores "
                           "(timings on a loaded machine are the machine's: calibration_loop_ns_max)"]}
    write_results(a.out, record)


def summarize(res: dict, a) -> dict:
    f: dict = {}
    if "proxy" in res:
        rows = res["proxy"]
        for e in sorted({r["engines"] for r in rows}):
            rs = [r for r in rows if r["engines"] == e]
            ns = [r["open_executions"] for r in rs]
            top = rs[-1]
            f[f"proxy_e{e}"] = {"open_executions": top["open_executions"], "proxy_added_ms_p50": top["proxy_added_ms_p50"],
                                "proxy_added_ms_p99": top["proxy_added_ms_p99"], "added_ms_p99": top["added_ms_p99"],
                                "cpu_ms_per_call": top["proxy_cpu_ms_per_call"],
                                "rss_kib_per_open_execution": top["rss_kib_per_open_execution"], "fds_open": top["fds_open"],
                                "threads_peak": top["threads_peak"], "tito_bytes_per_token": top["tito_bytes_per_token"],
                                "exp_added_p99": fit_exponent(ns, [r["proxy_added_ms_p99"] for r in rs]),
                                "exp_cpu_per_call": fit_exponent(ns, [r["proxy_cpu_ms_per_call"] for r in rs]),
                                "exp_rss": fit_exponent(ns, [r["rss_open_mib"] - r["rss_base_mib"] for r in rs]),
                                "exp_fds": fit_exponent(ns, [r["fds_open"] - r["fds_base"] for r in rs])}
        f["proxy_records_lost"] = sum(r["records_lost"] for r in rows)
        f["proxy_errors"] = sum(r["errors"] for r in rows)
    if res.get("context"):
        rs = res["context"]
        t = [r["prompt_tokens"] for r in rs]
        f["context"] = {"prompt_tokens": t[-1], "cpu_ms_per_call": rs[-1]["proxy_cpu_ms_per_call"], "latency_ms_p50": rs[-1]["latency_ms_p50"],
                        "cpu_ms_per_call_smallest": rs[0]["proxy_cpu_ms_per_call"],
                        "exp_cpu_per_call": fit_exponent(t, [r["proxy_cpu_ms_per_call"] for r in rs]),
                        "exp_latency": fit_exponent(t, [r["latency_ms_p50"] for r in rs]), "errors": sum(r["errors"] for r in rs)}
    if "scheduler" in res:
        rs = res["scheduler"]
        ks = [r["cells"] for r in rs]
        f["scheduler"] = {"cells": ks[-1], "us_per_event": rs[-1]["us_per_event"], "us_per_event_p99": rs[-1]["us_per_event_p99"],
                          "max_ms_by_kind": rs[-1]["max_ms_by_kind"], "max_cpu_ms_by_kind_without_gc": rs[-1]["max_cpu_ms_by_kind_without_gc"],
                          "gc_pause_ms_max": rs[-1]["gc_pause_ms_max"], "event_log_len": rs[-1]["event_log_len"],
                          "ms_per_step": rs[-1]["ms_per_step"], "messages_per_step": rs[-1]["messages_per_step"],
                          "exp_us_per_event": fit_exponent(ks, [r["us_per_event"] for r in rs]),
                          "exp_messages_per_step": fit_exponent(ks, [r["messages_per_step"] for r in rs])}
    if "store" in res:
        rs = res["store"]
        rk = [r["ranks"] for r in rs]
        f["store"] = {"ranks": rk[-1], "requests_per_step": rs[-1]["requests_per_step"],
                      "requests_per_step_per_rank": rs[-1]["requests_per_step_per_rank"],
                      "step_round_trip_ms_p50": rs[-1]["step_round_trip_ms_p50"],
                      "exp_requests_per_step": fit_exponent(rk, [r["requests_per_step"] for r in rs]),
                      "exp_round_trip": fit_exponent(rk, [r["step_round_trip_ms_p50"] for r in rs])}
    if "trajectory" in res:
        rs = res["trajectory"]
        u = [r["unique_tokens"] for r in rs]
        f["trajectory"] = {"calls": rs[-1]["calls"], "unique_tokens": u[-1], "seconds": rs[-1]["seconds"], "peak_mib": rs[-1]["peak_mib"],
                           "exp_time": fit_exponent(u, [r["seconds"] for r in rs]),
                           "exp_memory": fit_exponent(u, [r["peak_mib"] for r in rs])}
    if "soak" in res:
        s = res["soak"]
        f["soak"] = {k: s[k] for k in ("calls", "executions", "wall_s", "time_bound_hit", "records_lost", "errors", "rss_growth_pct", "rss_slope_kib_per_1k_calls",
                                       "fds_after_warmup", "fds_max_tail", "threads_after_warmup", "threads_max_tail")}
    return f


def goals(res: dict, a) -> dict:
    """The issue's goals, each {"value", "goal", "met"}, for the series this run measured."""
    g: dict = {}

    def put(name, value, goal, met):
        g[name] = {"value": value, "goal": goal, "met": bool(met)}

    top = [r for r in res.get("proxy", []) if r["open_executions"] == max(x["open_executions"] for x in res["proxy"])]
    for r in top:
        e = r["engines"]
        put(f"proxy_e{e}_added_ms_p99", r["proxy_added_ms_p99"], f"<= 5 at {r['open_executions']} open", r["proxy_added_ms_p99"] <= 5)
        put(f"proxy_e{e}_kib_per_open_execution", r["rss_kib_per_open_execution"], "<= 1024", r["rss_kib_per_open_execution"] <= 1024)
    if "proxy" in res or "soak" in res:
        lost = sum(r["records_lost"] for r in res.get("proxy", [])) + (res["soak"]["records_lost"] if "soak" in res else 0)
        put("records_lost", lost, "0", lost == 0)
    if res.get("scheduler"):
        r = res["scheduler"][-1]
        put("decision_us_per_event", r["us_per_event"], f"<= 1000 at K = {r['cells']}", r["us_per_event"] <= 1000)
        worst = max(r["max_cpu_ms_by_kind_without_gc"].values())
        put("decision_max_cpu_ms_without_gc", worst, "<= 1 (one call, GC pauses apart: gc_pause_ms_max)", worst <= 1)
    if len(res.get("store", [])) >= 2:
        b = fit_exponent([r["ranks"] for r in res["store"]], [r["requests_per_step"] for r in res["store"]])
        put("store_requests_exponent_in_ranks", b, "~1 (linear; 2 = O(ranks^2))", b is not None and b <= 1.2)
    if len(res.get("trajectory", [])) >= 2:
        u = [r["unique_tokens"] for r in res["trajectory"]]
        for k, key in (("time", "seconds"), ("memory", "peak_mib")):
            b = fit_exponent(u, [r[key] for r in res["trajectory"]])
            put(f"trajectory_{k}_exponent", b, f"~1 (linear) to {max(u):,} unique tokens", b is not None and b <= 1.2)
    if "soak" in res:
        s = res["soak"]
        put("soak_calls", s["calls"], ">= 50000", s["calls"] >= 50_000)
        put("soak_rss_growth_pct", s["rss_growth_pct"], "<= 5 after warm-up", s["rss_growth_pct"] <= 5)
        put("soak_fds_growth", s["fds_max_tail"] - s["fds_after_warmup"], "flat: within 2 per concurrent execution (its connection, its file)",
            s["fds_max_tail"] <= s["fds_after_warmup"] + 2 * a.soak_concurrency)
        put("soak_threads_growth", s["threads_max_tail"] - s["threads_after_warmup"], "0", s["threads_max_tail"] <= s["threads_after_warmup"])
    return g


if __name__ == "__main__":
    main()
