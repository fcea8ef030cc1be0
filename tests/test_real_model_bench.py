"""benchmarks/real_model_bench.py in its fast form on a tiny Llama: it runs end to end, its last
line is one JSON object holding the issue's figures, and every ratio is recomputed here from the
raw per-round numbers printed beside it (no timing is asserted: the machine is shared)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADLINES = ["engine_vs_bare_1", "engine_vs_bare_8", "staggered_vs_generate", "actor_vs_transformers", "rss_over_accounting"]


@pytest.mark.jobs  # a whole script end to end (2-6 min on 2 cores): never beside a training job
def test_quick_tiny_run_prints_the_figures_and_each_ratio_is_its_raw_numbers(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.real_model_bench", "--quick", "--tiny", "--rounds", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(HEADLINES) <= set(figures) and set(HEADLINES) == set(figures["goals"])
    raw, rss = figures["raw"], figures["rss"]
    assert all(len(v) == 2 for v in raw.values())  # one value per alternating round

    def med(num, den):
        return statistics.median(a / b for a, b in zip(raw[num], raw[den]))

    for B in (1, 8):
        assert figures[f"engine_vs_bare_{B}"] == med(f"engine_tok_s_{B}", f"bare_tok_s_{B}")
    assert figures["staggered_vs_generate"] == med("staggered_fifo_makespan_s", "staggered_engine_makespan_s")
    assert figures["staggered_vs_generate_batched"] == med("staggered_batched_makespan_s", "staggered_engine_makespan_s")
    # the schedule's own tokens (--quick: 6 requests); fifo computes exactly those, batched pads
    cfg = json.loads(out.read_text())["config"]
    assert raw["staggered_fifo_work_tokens"] == raw["staggered_engine_work_tokens"]
    assert all(6 * (cfg["prompt_range"][0] + cfg["out_range"][0]) <= w <= 6 * (cfg["prompt_range"][1] + cfg["out_range"][1])
               for w in raw["staggered_engine_work_tokens"])
    assert figures["staggered_batched_work"] == med("staggered_batched_work_tokens", "staggered_engine_work_tokens") >= 1
    assert figures["actor_vs_transformers"] == med("train_actor_tok_s", "train_transformers_tok_s")
    # the accounting is its parts, the parts are the tiny model's (2 layers, hidden 64, vocab 512)
    n_params = 512 * 64 + 2 * (4 * 64 * 64 - 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert rss["weights_bytes"] == rss["grads_bytes"] == 4 * n_params and rss["adamw_bytes"] == 8 * n_params
    assert rss["accounting_bytes"] == rss["weights_bytes"] + rss["grads_bytes"] + rss["adamw_bytes"] + rss["activations_bytes"]
    assert 0 < rss["activations_bytes"] and rss["rss_before_model_bytes"] < rss["peak_rss_bytes"]
    assert figures["rss_over_accounting"] == rss["peak_rss_bytes"] / rss["accounting_bytes"]
    for name, goal in figures["goals"].items():
        assert goal["value"] == round(figures[name], 3)
        assert goal["met"] == (figures[name] <= 1.3 if name == "rss_over_accounting" else figures[name] >= float(goal["goal"][3:]))
    record = json.loads(out.read_text())
    assert record["figures"] == figures and record["git_commit"] and record["config"]["rounds"] == 2
    assert {"cpus", "loadavg_1_5_15_at_end"} <= set(record["machine"]) and len(record["load_before_1_5_15"]) == 3
