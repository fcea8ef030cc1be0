"""Proxy benchmark (issue 5): what the black-box proxy adds on top of calling the engine directly.

Side by side, one run, same instant engine (`DeterministicEngine`, no delay, `--max-tokens`
tokens per call), each server in its own process, the load generator in this one:

  * direct      client -> engine over HTTP (`serve_engine`, token ids in, token lines out)
  * proxy       client -> proxy (OpenAI chat API: render + splice + route + detokenize + tool
                parser + TITO record to the on-disk store) -> the same engine (HttpEngine,
                multiplexed websocket transport, the default)
  * proxy-embed the proxy with the engine in its own process (no second HTTP hop)
  * proxy-http  as `proxy`, the engine reached by one streamed POST per call instead of the
                multiplexed websocket (HttpEngine transport="http")
  * proxy-large-vocab  as `proxy`, with a real 131,072-id vocabulary: Mistral's Tekken tokenizer
                (the tekken*.json the `mistral-common` wheel ships; `--large-vocab PATH` for
                another tokenizer directory or tekken.json, `--large-vocab none` to skip), its
                engine sampling ids over the whole vocabulary (past the 1,000 control tokens).
                Tekken ships no HF chat template: the project's Qwen2.5 template renders the
                turns (its <|im_start|> markers are plain text to Tekken). Its start-up cost is
                reported too: the tokenizer load, the byte table (best of 3) and Proxy() whole.

Latency: one client, sequential requests, p50 / p99; the proxy's *added* latency is its p50/p99
minus the direct p50/p99. Throughput: `--concurrency` clients, each its own execution (key),
requests/s. Then `--streams` concurrent streaming calls held open at once against a slow engine
(every stream must receive its first chunk while all are open, and finish with [DONE]).
Fairness (issue 20): against a proxy with the default limits, `--fair-keys` executions send
small calls one after another (50 ms apart), first alone (quiet) and then while another execution sends
near-maximal bodies (`--fair-body-mb` of prompt text, refused as over the context) as fast as it
is let; `fair_p99_ratio` is their p99 latency under that load over the quiet p99 (goal: <= 2).
The throughput and latency variants run with `calls_per_second_per_key=0` (an instant engine
answers one client faster than any per-key rate a real model allows; the check still runs).
Each message differs per request, so the last turn is tokenized every call (the system prompt
hits the per-turn token cache, as a re-sent history does). The last line printed is one JSON
object with the figures named in the issue.

Stalls (issue 34, benchmarks/proxy_stalls.py): adversarial body shapes (3 MiB of nested tool
schemas, 300k Anthropic blocks, 300k Responses items, 20k tools, 15 MiB of tiny messages) and a
legitimate 783k-token prompt, each against victims quiet and loaded side by side in one run, the
proxy at its default limits (context 1M tokens), the engine in its own process: `stall_p99_ratio`
per shape (goal <= 2), the shape's added p50 beside the engine alone, proxy CPU per shape call.

    python benchmarks/proxy_bench.py [--requests 2000] [--concurrency 32] [--streams 1000] [--rounds 4] [--fair-requests 400]
    python benchmarks/proxy_bench.py --quick            # a few minutes: fewer calls, no large vocabulary
    python benchmarks/proxy_bench.py --stalls-only      # only the issue-34 stage
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402
from benchmarks.proxy_stalls import quiet_then_loaded  # noqa: E402

SYSTEM = "You are a coding agent. You can run shell commands with the bash tool. " * 4
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


# ---- server processes ---------------------------------------------------------------------------
def _engine_main(q, token_delay, vocab_size=1024, first_regular_id=7, eos_token_id=2):
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.engines.engine_http import serve_engine

    h = serve_engine(DeterministicEngine("bench", token_delay=token_delay, vocab_size=vocab_size,
                                         first_regular_id=first_regular_id, eos_token_id=eos_token_id))
    q.put((h.port, h.secret))  # engines answer only with the run's secret (engine_http)
    h.thread.join()


def _proxy_main(q, engine_url, n_keys, token_delay, store_dir, transport="ws", limits=False, engine_secret=None,
                tokenizer_dir=None, config_kw=None):
    from gyre.proxy import Proxy, ProxyConfig, StoreSink, serve_proxy
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.engines.engine_http import HttpEngine
    from gyre.trajectory.store import TitoStore

    kw = {}
    if tokenizer_dir:  # the large-vocabulary variant: that directory's tokenizer and stop ids
        from gyre.backends.models.vocab import load_vocab

        vocab = load_vocab(None, tokenizer_dir)
        kw = {"tokenizer": vocab.tokenizer, "stop_ids": vocab.stop_ids}
    ckw = dict(config_kw or {}) if limits else {"calls_per_second_per_key": 0, **(config_kw or {})}
    proxy = Proxy(ProxyConfig(**ckw), sink=StoreSink(TitoStore(store_dir)), **kw)
    if engine_url:
        proxy.router.add_engine(HttpEngine(engine_url, name="bench", transport=transport, secret=engine_secret),
                                kind="cell", index=0)
    else:
        proxy.router.add_engine(DeterministicEngine("bench", token_delay=token_delay), kind="cell", index=0)
    keys = [proxy.issue_key(f"exec-{i}") for i in range(n_keys)]
    h = serve_proxy(proxy)
    q.put((h.port, keys))
    h.thread.join()


def _start(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args), daemon=True)
    p.start()
    return p, q.get(timeout=120)


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calibrate_ns() -> float:
    """ns per empty Python loop iteration (about 15-30 on an idle core; higher = shared CPU)."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200_000):
            pass
        best = min(best, (time.perf_counter() - t) / 200_000 * 1e9)
    return best


# ---- load generation ----------------------------------------------------------------------------
def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _run_load(kind, url, keys, n, concurrency, max_tokens, prompt_ids):
    import aiohttp

    lat: list[float] = []
    errors = 0
    counter = iter(range(n))

    async def one(session, i, key):
        nonlocal errors
        t0 = time.perf_counter()
        if kind == "direct":
            body = {"request_id": f"r{i}", "input_ids": prompt_ids + [i % 900 + 7], "sampling": {"max_tokens": max_tokens}}
            async with session.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                data = await r.read()
                ok = r.status == 200 and data.count(b"\n") == max_tokens
        else:
            body = {"model": "m", "max_tokens": max_tokens, "tools": TOOLS,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}: list the files in src/"}]}
            async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                data = await r.json()
                ok = r.status == 200 and data["usage"]["completion_tokens"] == max_tokens
        lat.append(time.perf_counter() - t0)
        if not ok:
            errors += 1

    async def worker(w, session):
        key = keys[w % len(keys)] if keys else None
        for i in counter:
            await one(session, i, key)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for i in range(min(10, n)):  # warm-up (connections, caches)
            await one(session, -1 - i, keys[0] if keys else None)
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, session) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"n": len(lat), "errors": errors, "req_per_s": len(lat) / wall, "p50_ms": _pct(lat, 50) * 1e3, "p99_ms": _pct(lat, 99) * 1e3, "samples": lat}


async def _hold_streams(url, keys, n, max_tokens):
    """Open n streaming calls at once; every one must get its first chunk while all are open."""
    import aiohttp

    first = 0
    done = 0
    open_now = 0
    peak = 0
    all_open = asyncio.Event()

    async def one(i, session):
        nonlocal first, done, open_now, peak
        body = {"model": "m", "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": f"stream {i}"}]}
        async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}) as r:
            assert r.status == 200, await r.text()
            got_first = False
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                if not got_first and b"data: " in buf:
                    got_first = True
                    first += 1
                    open_now += 1
                    peak = max(peak, open_now)
                    if first == n:
                        all_open.set()
            open_now -= 1
            if buf.endswith(b"data: [DONE]\n\n"):
                done += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(one(i, session) for i in range(n)))
    return {"streams": n, "peak_open": peak, "completed": done, "wall_s": time.perf_counter() - t0}


async def _fairness(url, keys, n, body_mb, max_tokens):
    """Victims (keys[1:]) send small calls in turn, quiet and then while keys[0] sends huge bodies."""
    import aiohttp

    big = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * ((body_mb << 20) // 5)}]}).encode()

    async def victims(session, calls):
        lat = []
        per = max(1, calls // (len(keys) - 1))

        async def one(key, i):
            body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"task {i}: list the files"}]}
            for j in range(per):
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)  # a harness's pace (under the default 50 calls/s per key)
        await asyncio.gather(*(one(k, i) for i, k in enumerate(keys[1:])))
        return lat

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await victims(session, len(keys) - 1)  # warm-up
        quiet, loud, attempts = await quiet_then_loaded(session, victims, n, (url, "/v1/chat/completions", big, keys[0], None))
    hostile = {"sent": len(attempts), "codes": {}, "s": [t for _, t, _ in attempts]}
    for status, _, _ in attempts:
        hostile["codes"][status] = hostile["codes"].get(status, 0) + 1
    return {"quiet_p50_ms": _pct(quiet, 50) * 1e3, "quiet_p99_ms": _pct(quiet, 99) * 1e3, "loaded_p50_ms": _pct(loud, 50) * 1e3,
            "loaded_p99_ms": _pct(loud, 99) * 1e3, "fair_p99_ratio": _pct(loud, 99) / _pct(quiet, 99), "victim_calls": len(loud),
            "hostile_bodies": hostile["sent"], "hostile_body_mb": body_mb, "hostile_status": hostile["codes"],
            "hostile_refusal_p50_ms": _pct(hostile["s"], 50) * 1e3 if hostile["s"] else None}


def _large_vocab_dir(spec: str, root: str) -> str | None:
    """A tokenizer directory for the large-vocabulary variant (None: skipped): `auto` = the newest
    tekken*.json in the installed mistral-common; a tekken.json file or a directory otherwise.
    A bare tekken.json gets ChatML's control tokens, the project's chat template, and `</s>` (id 2) and
    `<|im_end|>` as its stop ids."""
    import shutil

    from gyre.backends.models.tokenizer import CHAT_TEMPLATE

    if spec == "none":
        return None
    if spec == "auto":
        try:
            import mistral_common
        except ImportError:
            print("large vocabulary: skipped (pip install mistral-common, or --large-vocab PATH)")
            return None
        found = sorted(Path(mistral_common.__file__).parent.rglob("tekken*.json"))
        if not found:
            print("large vocabulary: skipped (this mistral-common ships no tekken*.json)")
            return None
        spec = str(found[-1])
    if Path(spec).is_dir():
        return spec
    from gyre.backends.models.tokenizer import SPECIAL_TOKENS, load_tokenizer

    raw, d = Path(root) / "large_vocab_raw", Path(root) / "large_vocab"
    raw.mkdir(parents=True, exist_ok=True)
    shutil.copy(spec, raw / "tekken.json")
    # Tekken has no chat template of the kinds Gyre knows (gyre/proxy/formats): give it ChatML's
    # control tokens and the project's (Qwen2.5) template, as a ChatML fine-tune of it would
    # (131,072 + 7 ids). The byte table and the detokenizer still meet the whole real vocabulary.
    tok = load_tokenizer(str(raw))
    tok.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in tok.get_vocab()]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(d))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, tok.convert_tokens_to_ids("<|im_end|>")]}))
    return str(d)


def _large_vocab_startup(tokenizer_dir: str) -> dict:
    """What the large vocabulary costs once, at start: the tokenizer load (transformers), the
    byte table (best of 3) and a whole Proxy() (renderer included), in this process."""
    from gyre.backends.models import vocab as V
    from gyre.proxy import Proxy, ProxyConfig

    t0 = time.perf_counter()
    v = V.load_vocab(None, tokenizer_dir)
    load_s = time.perf_counter() - t0
    builds = []
    for _ in range(3):
        v.tokenizer._gyre_byte_table = None
        t0 = time.perf_counter()
        table = V.byte_table(v.tokenizer)
        builds.append(time.perf_counter() - t0)
    v.tokenizer._gyre_byte_table = None
    t0 = time.perf_counter()
    Proxy(ProxyConfig(), tokenizer=v.tokenizer, stop_ids=v.stop_ids)
    proxy_s = time.perf_counter() - t0
    return {"ids": len(table), "undecodable": len(table.undecodable), "tokenizer_load_s": load_s,
            "byte_table_build_s": min(builds), "byte_table_builds_s": builds, "proxy_init_s": proxy_s,
            "first_regular_id": _first_regular_id(v.tokenizer), "stop_ids": list(v.stop_ids)}


def _first_regular_id(tokenizer) -> int:
    """The first id past the tokenizer's leading block of special tokens (Tekken: 1000)."""
    special = set(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    i = 0
    while i in special:
        i += 1
    return i


def _stalls_stage(args, engine_url, esecret, store, procs) -> dict:
    """Issue 34: each shape of benchmarks/proxy_stalls.py against victims, one proxy at its default
    limits (context 1M tokens) in front of the engine process."""
    from benchmarks import proxy_stalls as S
    from gyre.backends.models.tokenizer import load_tokenizer

    built = S.shapes()
    names = list(built) if args.stall_shapes == "all" else args.stall_shapes.split(",")
    p, (port, keys) = _start(_proxy_main, engine_url, args.fair_keys + len(names), 0.0, store + "/s", "ws", True, esecret, None,
                             {"max_context_tokens": 1 << 20, "client_stall_s": 5.0})
    victims, attackers = keys[: args.fair_keys], keys[args.fair_keys :]  # a fresh attacker per shape: no debt carried over
    engine_pid = procs[0].pid  # main() starts the engine first
    procs.append(p)
    url, out = f"http://127.0.0.1:{port}", {}
    for i, name in enumerate(names):
        path, raw = built[name]
        out[name] = asyncio.run(S.run_shape(url, [attackers[i]] + victims, path, raw, args.stall_calls, p.pid, unread=S.UNREAD.get(name, 0),
                                            idle_pids=[p.pid, engine_pid]))
        if name == "prompt_783k":
            tok = load_tokenizer()
            ids = tok.apply_chat_template(json.loads(raw)["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            alone = asyncio.run(S.engine_alone_ms(engine_url, esecret, ids))
            out[name].update(prompt_tokens=len(ids), engine_alone_p50_ms=alone,
                             added_p50_ms=(out[name]["shape_p50_ms"] or float("nan")) - alone)
        o = out[name]
        print(f"stall {name:22s} victims p99 {o['quiet_p99_ms']:.1f} ms quiet, {o['loaded_p99_ms']:.1f} ms loaded: ratio {o['p99_ratio']:.2f} | "
              f"shape {o['shape_body_mib']:.1f} MiB x{sum(o['shape_status'].values())} {o['shape_status']}, p50 {o['shape_p50_ms'] or 0:.0f} ms, "
              f"proxy CPU {o['proxy_cpu_ms_per_shape_call'] or 0:.0f} ms/call" + (f", proxy RSS {o['proxy_rss_before_mib']:.0f} -> peak {o['proxy_peak_rss_mib']:.0f} MiB" if "proxy_peak_rss_mib" in o else "") + (f", unread connections dropped {o['unread_dropped']}/{o['unread_connections']} after {o['unread_held_s']} s" if "unread_dropped" in o else "") + (f", engine alone {o['engine_alone_p50_ms']:.0f} ms" if "engine_alone_p50_ms" in o else ""), flush=True)
    p.terminate()
    return out


def _stall_figures(stalls: dict) -> dict:
    f = {f"stall_p99_ratio_{k}": v["p99_ratio"] for k, v in stalls.items()}
    f.update({f"stall_proxy_cpu_ms_per_call_{k}": v["proxy_cpu_ms_per_shape_call"] for k, v in stalls.items()})
    f["stall_p99_ratio_max"] = max((v["p99_ratio"] for v in stalls.values()), default=None)
    if "prompt_783k" in stalls:
        f["prompt_783k_added_p50_ms"] = stalls["prompt_783k"].get("added_p50_ms")
        f["prompt_783k_engine_alone_p50_ms"] = stalls["prompt_783k"].get("engine_alone_p50_ms")
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per variant in the throughput runs (all rounds)")
    ap.add_argument("--latency-requests", type=int, default=300, help="sequential requests per variant (all rounds)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent clients in the throughput runs")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the variants")
    ap.add_argument("--streams", type=int, default=1000, help="concurrent open streams to hold")
    ap.add_argument("--stream-token-delay", type=float, default=0.2, help="engine delay per token for the streams run (s)")
    ap.add_argument("--stream-tokens", type=int, default=20)
    ap.add_argument("--fair-requests", type=int, default=400, help="small calls per phase of the fairness run (all victims)")
    ap.add_argument("--fair-keys", type=int, default=4, help="victim executions in the fairness run")
    ap.add_argument("--fair-body-mb", type=int, default=15, help="prompt text per hostile body, MiB (the body limit is 16)")
    ap.add_argument("--large-vocab", default="auto", help="tokenizer of the large-vocabulary variant: auto (mistral-common's "
                    "Tekken, 131k ids), a tekken.json or tokenizer directory, or none")
    ap.add_argument("--stall-calls", type=int, default=1600, help="victim calls per phase (quiet, loaded) per shape in the stalls stage, "
                    "over 4 alternating rounds (the p99 is then the 16th worst)")
    ap.add_argument("--stall-shapes", default="all", help="comma-separated shape names of the stalls stage (benchmarks/proxy_stalls.py), or all")
    ap.add_argument("--stalls-only", action="store_true", help="run only the stalls stage")
    ap.add_argument("--quick", action="store_true", help="fewer calls everywhere, no large vocabulary (minutes, noisier; sets the counts, overriding their flags)")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.latency_requests, args.rounds, args.streams = 200, 60, 1, 100
        args.fair_requests, args.stall_calls, args.large_vocab = 100, 80, "none"

    from gyre.backends.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompt_ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task 0: list the files in src/"}], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt_ids = list(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids)

    procs = []
    store = tempfile.mkdtemp(prefix="proxy-bench-")
    try:
        p, (eport, esecret) = _start(_engine_main, 0.0)
        procs.append(p)
        engine_url = f"http://127.0.0.1:{eport}"
        if args.stalls_only:
            stalls = _stalls_stage(args, engine_url, esecret, store, procs)
            write_results(args.out, {**provenance("aiohttp", "openai", "tokenizers"), "config": vars(args), "stalls": stalls,
                                     "figures": _stall_figures(stalls)})
            return
        p, (pport, keys) = _start(_proxy_main, engine_url, args.concurrency, 0.0, store + "/a", "ws", False, esecret)
        procs.append(p)
        p, (xport, xkeys) = _start(_proxy_main, "", args.concurrency, 0.0, store + "/b")
        procs.append(p)
        p, (hport, hkeys) = _start(_proxy_main, engine_url, args.concurrency, 0.0, store + "/d", "http", False, esecret)
        procs.append(p)
        proxy_url, embed_url, phttp_url = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{xport}", f"http://127.0.0.1:{hport}"
        large_dir = _large_vocab_dir(args.large_vocab, store)
        large = None
        if large_dir:
            large = _large_vocab_startup(large_dir)
            print(f"large vocabulary: {large['ids']} ids ({large_dir}); start-up: tokenizer load {large['tokenizer_load_s']:.2f} s, "
                  f"byte table {large['byte_table_build_s'] * 1e3:.0f} ms (best of 3), Proxy() {large['proxy_init_s']:.2f} s", flush=True)
            p, (lport, lsecret) = _start(_engine_main, 0.0, large["ids"], large["first_regular_id"], large["stop_ids"][0])
            procs.append(p)
            large_engine_pid = p.pid
            p, (lpport, lkeys) = _start(_proxy_main, f"http://127.0.0.1:{lport}", args.concurrency, 0.0, store + "/l", "ws",
                                        False, lsecret, large_dir)
            procs.append(p)
            large_proxy_pid = p.pid

        calib = _calibrate_ns()
        print(f"machine load check: {calib:.0f} ns per empty loop iteration (idle core: ~15-30), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        engine_pid, proxy_pid, embed_pid, phttp_pid = (p.pid for p in procs[:4])
        variants = [
            ("direct", engine_url, [esecret] * args.concurrency, "direct", [engine_pid]),
            ("proxy", proxy_url, keys, "proxy", [proxy_pid, engine_pid]),
            ("proxy_embed", embed_url, xkeys, "proxy", [embed_pid]),
            ("proxy_http", phttp_url, hkeys, "proxy", [phttp_pid, engine_pid]),
        ]
        if large is not None:
            variants.append(("proxy_large_vocab", f"http://127.0.0.1:{lpport}", lkeys, "proxy",
                             [large_proxy_pid, large_engine_pid]))
        # Interleaved rounds (every variant once per round) so that load from other work on the
        # machine hits all variants alike; latency percentiles over all samples, throughput the
        # median of the rounds.
        acc = {v[0]: {"lat": [], "rps": [], "cpu": [0.0] * len(v[4]), "n": 0, "errors": 0} for v in variants}
        calibs = [calib]
        for rnd in range(args.rounds):
            calibs.append(_calibrate_ns())
            for name, url, ks, kind, pids in variants:
                a = acc[name]
                lat = asyncio.run(_run_load(kind, url, ks, max(1, args.latency_requests // args.rounds), 1, args.max_tokens, prompt_ids))
                c0 = [_cpu_s(p) for p in pids]
                thr = asyncio.run(_run_load(kind, url, ks, max(1, args.requests // args.rounds), args.concurrency, args.max_tokens, prompt_ids))
                a["cpu"] = [acc_c + _cpu_s(p) - c for acc_c, p, c in zip(a["cpu"], pids, c0)]
                a["lat"] += lat["samples"]
                a["rps"].append(thr["req_per_s"])
                a["n"] += thr["n"]
                a["errors"] += lat["errors"] + thr["errors"]
        res: dict = {}
        for name, *_ in variants:
            a = acc[name]
            cpu_us = [c / a["n"] * 1e6 for c in a["cpu"]]
            lat = {"p50_ms": _pct(a["lat"], 50) * 1e3, "p99_ms": _pct(a["lat"], 99) * 1e3, "n": len(a["lat"]), "errors": a["errors"]}
            thr = {"req_per_s": sorted(a["rps"])[len(a["rps"]) // 2], "rounds": a["rps"], "n": a["n"], "errors": 0}
            res[name] = {"latency": lat, "throughput": thr, "server_cpu_us_per_req": cpu_us}
            print(f"{name:12s} seq p50 {lat['p50_ms']:.3f} ms  p99 {lat['p99_ms']:.3f} ms | {args.concurrency} clients: "
                  f"{thr['req_per_s']:.0f} req/s (median of {args.rounds} rounds)  server CPU/req {' + '.join(f'{c:.0f}' for c in cpu_us)} us"
                  f"  errors {a['errors']}", flush=True)
        for name in ("proxy", "proxy_embed", "proxy_http") + (("proxy_large_vocab",) if large is not None else ()):
            r = res[name]
            print(f"{name:12s} added p50 {r['latency']['p50_ms'] - res['direct']['latency']['p50_ms']:.3f} ms, "
                  f"added p99 {r['latency']['p99_ms'] - res['direct']['latency']['p99_ms']:.3f} ms, "
                  f"throughput ratio vs direct {r['throughput']['req_per_s'] / res['direct']['throughput']['req_per_s']:.2f}")

        for p in procs[1:]:
            p.terminate()
        p, (sport, skeys) = _start(_proxy_main, "", 64, args.stream_token_delay, store + "/c")
        procs.append(p)
        streams = asyncio.run(_hold_streams(f"http://127.0.0.1:{sport}", skeys, args.streams, args.stream_tokens))
        print(f"streams      {streams['peak_open']} of {streams['streams']} open at once, {streams['completed']} completed in {streams['wall_s']:.1f} s")
        procs[-1].terminate()
        p, (fport, fkeys) = _start(_proxy_main, "", args.fair_keys + 1, 0.0, store + "/f", "ws", True)
        procs.append(p)
        fair = asyncio.run(_fairness(f"http://127.0.0.1:{fport}", fkeys, args.fair_requests, args.fair_body_mb, args.max_tokens))
        print(f"fairness     victims p99 {fair['quiet_p99_ms']:.2f} ms quiet, {fair['loaded_p99_ms']:.2f} ms while one execution sent "
              f"{fair['hostile_bodies']} bodies of {args.fair_body_mb} MiB ({fair['hostile_status']}, refused in {fair['hostile_refusal_p50_ms']:.0f} ms p50): "
              f"ratio {fair['fair_p99_ratio']:.2f}", flush=True)
        stalls = _stalls_stage(args, engine_url, esecret, store, procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()

    figures = {
        "added_latency_p50_ms": res["proxy"]["latency"]["p50_ms"] - res["direct"]["latency"]["p50_ms"],
        "added_latency_p99_ms": res["proxy"]["latency"]["p99_ms"] - res["direct"]["latency"]["p99_ms"],
        "proxy_req_per_s": res["proxy"]["throughput"]["req_per_s"],
        "direct_req_per_s": res["direct"]["throughput"]["req_per_s"],
        "embedded_added_latency_p50_ms": res["proxy_embed"]["latency"]["p50_ms"] - res["direct"]["latency"]["p50_ms"],
        "embedded_req_per_s": res["proxy_embed"]["throughput"]["req_per_s"],
        "proxy_http_transport_req_per_s": res["proxy_http"]["throughput"]["req_per_s"],
        "concurrent_streams_held": streams["peak_open"],
        "streams_completed": streams["completed"],
        "fair_p99_ratio": fair["fair_p99_ratio"],
        "fair_quiet_p99_ms": fair["quiet_p99_ms"],
        "fair_loaded_p99_ms": fair["loaded_p99_ms"],
        "proxy_cpu_us_per_req": res["proxy"]["server_cpu_us_per_req"][0],
        "engine_cpu_us_per_req": res["direct"]["server_cpu_us_per_req"][0],
        "calibration_loop_ns": sorted(calibs)[len(calibs) // 2],
        "calibration_loop_ns_max": max(calibs),
        "load_average_1min_at_end": os.getloadavg()[0],
        "errors": sum(r[k]["errors"] for r in res.values() for k in ("latency", "throughput")),
    }
    if large is not None:  # beside the small-vocabulary figures above, same run
        lv = res["proxy_large_vocab"]
        figures.update({
            "large_vocab_ids": large["ids"],
            "large_vocab_added_latency_p50_ms": lv["latency"]["p50_ms"] - res["direct"]["latency"]["p50_ms"],
            "large_vocab_added_latency_p99_ms": lv["latency"]["p99_ms"] - res["direct"]["latency"]["p99_ms"],
            "large_vocab_proxy_req_per_s": lv["throughput"]["req_per_s"],
            "large_vocab_proxy_cpu_us_per_req": lv["server_cpu_us_per_req"][0],
            "large_vocab_byte_table_build_s": large["byte_table_build_s"],
            "large_vocab_tokenizer_load_s": large["tokenizer_load_s"],
            "large_vocab_proxy_init_s": large["proxy_init_s"],
        })
    figures.update(_stall_figures(stalls))
    out = {
        **provenance("aiohttp", "openai", "tokenizers"),
        "config": vars(args),
        "results": res,
        "streams": streams,
        "fairness": fair,
        "stalls": stalls,
        "large_vocab": large,
        "figures": figures,
        "left_out": [
            "a real model: the engine is instant, so the figures are the proxy's own cost",
            "the load generator, proxy and engine share the same 2 cores (and other engineers' work: "
            "see calibration_loop_ns; server CPU per request is the less load-dependent figure)",
            "SGLang engines (GPU): the proxy reaches them through the same RolloutEngine protocol",
            "fairness / stalls: the hostile client runs in this process beside the victims; a large body is parsed in "
            "the proxy's worker process (gyre/proxy/bodies.py), so its parse competes with the victims for the cores, "
            "not for the proxy's event loop",
        ],
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
