"""benchmarks/gpu_check.py's dry run, on CPU (default tier: no GPU needed). It is what stands
between a broken device check and a wasted device slot: the wheel set (complete, under the cap),
the CUDA build plan, the test selection (every file there, every one collecting), the run's config.
Each check is also shown failing on a planted fault."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The run's config names --backend.actor megatron, which the factory refuses without megatron-core.
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core not installed (it is in the test extra)")


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def returned(folder: Path) -> list[str]:
    """The files under `folder` as the lent machine returns them: at most 8, none deeper than two
    folders (asserted), relative paths sorted."""
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert len(files) <= 8, f"{len(files)} files under {folder}: {files[:12]}"
    assert all(len(Path(f).parts) <= 3 for f in files), files
    return files


@needs_megatron
@pytest.mark.jobs  # runs the device check's dry run end to end (subprocess pytest and config checks)
def test_the_one_command_dry_run_passes_here_and_writes_one_json(tmp_path):
    out = tmp_path / "out" / "gpu_check.json"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--no-nvcc", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert returned(out.parent) == ["gpu_check.json"]
    res = json.loads(out.read_text())
    status = {k: v["status"] for k, v in res["stages"].items()}
    assert status == {"wheels": "pass", "build_plan": "pass", "nvcc_compile_only": "skip", "test_selection": "pass",
                      "run_config": "pass", "proxy_scale_args": "pass"}, res
    assert res["ok"] and res["stages"]["wheels"]["figures"]["total_mib"] < 64
    collected = res["stages"]["test_selection"]["figures"]["collected"]
    assert all(n > 0 for n in collected.values()) and len(collected) == 3
    cfg = res["stages"]["run_config"]["figures"]
    assert (cfg["actor"], cfg["device"], cfg["offload_actor"]) == ("megatron", "cuda", True) and cfg["steps"] >= 4
    assert cfg["resolved_dtype"] == "bfloat16"  # the run stage trains what a user's default gives
    assert any("TP > 1" in k for k in res["one_gpu_cannot_try"])


def test_a_missing_test_file_fails_the_selection(gc):
    res = gc.dry_run(None, nvcc=False, kernel_tests=gc.KERNEL_TESTS + ["tests/gpu/test_not_there.py"])
    assert res["test_selection"].status == "fail" and "test_not_there.py" in res["test_selection"].reason
    assert not (ROOT / "tests" / "gpu" / "test_not_there.py").exists()


def test_the_wheel_set_must_be_recorded_and_under_the_cap(gc, tmp_path):
    manifest = tmp_path / "m.json"
    real = json.loads(gc.MANIFEST.read_text())
    manifest.write_text(json.dumps({**real, "huge==1.0": {"file": "huge-1.0-py3-none-any.whl", "bytes": 40 << 20}}))
    problems, figures = gc.check_manifest(manifest, gc.WHEELS + ["huge==1.0"])
    assert any("over the 64 MiB" in p for p in problems) and figures["total_mib"] > 64
    problems, _ = gc.check_manifest(gc.MANIFEST, gc.WHEELS + ["unfetched==0.1"])
    assert problems == ["unfetched==0.1: not in gpu_check_wheels.json (fetch again)"]
    assert gc.check_manifest(gc.MANIFEST, gc.WHEELS)[0] == []
    res = gc.dry_run(None, nvcc=False, wheel_specs=gc.WHEELS + ["huge==1.0"], manifest=manifest, kernel_tests=[],
                     megatron_tests=[])
    assert res["wheels"].status == "fail"


def test_wheel_files_on_disk_are_matched_by_name_and_summed(gc, tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    from benchmarks.gpu_wheels import wheel_name

    for spec in gc.WHEELS:  # sparse files: sizes without the bytes
        name, version = wheel_name(spec), spec.split("==")[1]
        with open(d / f"{name}-{version}-py3-none-any.whl", "wb") as f:
            f.truncate(1 << 20)
    problems, figures = gc.check_wheels(d, gc.WHEELS)
    assert problems == [] and figures["wheels"] == len(gc.WHEELS)
    with open(d / "pillow-13.0.0-py3-none-any.whl", "wb") as f:
        f.truncate(40 << 20)
    problems, _ = gc.check_wheels(d, gc.WHEELS)
    assert len(problems) == 1 and "over the 64 MiB" in problems[0]
    (d / "tyro-1.0.17-py3-none-any.whl").unlink()
    assert "tyro==1.0.17: 0 wheels" in gc.check_wheels(d, gc.WHEELS)[0][0]


@needs_megatron
def test_the_run_config_is_checked_as_on_the_box(gc):
    res = gc.dry_run(None, nvcc=False, kernel_tests=[], megatron_tests=[], run_args=gc.RUN_ARGS + ["--train.steps", "2"])
    assert res["run_config"].status == "fail" and "train.steps 2 < 4" in res["run_config"].reason
    res = gc.dry_run(None, nvcc=False, kernel_tests=[], megatron_tests=[], run_args=gc.RUN_ARGS + ["--backend.device", "tpu"])
    assert res["run_config"].status == "fail"
    res = gc.dry_run(None, nvcc=False, kernel_tests=[], megatron_tests=[], run_args=gc.RUN_ARGS + ["--model.dtype", "float32"])
    assert res["run_config"].status == "fail" and "trains in float32, not bfloat16" in res["run_config"].reason
    ok = gc.dry_run(None, nvcc=False, kernel_tests=[], megatron_tests=[])
    assert ok["run_config"].status == "pass" and ok["run_config"].figures["resolved_dtype"] == "bfloat16"


def test_the_device_stages_are_budgeted_within_eight_minutes(gc):
    assert gc.BUDGET_S <= 8 * 60 - 10
    assert list(gc.STAGES) == ["install", "doctor", "build", "kernel_tests", "megatron_step", "run", "loss_bench", "proxy_scale"]
    assert gc.STAGES["proxy_scale"] == 100
    assert gc.CUDA_ARCH == "9.0" and gc.BENCH_SHAPE == (16384, 151936)


def test_a_one_stage_rerun_brings_what_it_needs_and_fits_the_budget(gc):
    assert gc.selected(["run"]) == ["install", "run"] and gc.selected(["loss_bench"]) == ["build", "loss_bench"]
    assert gc.selected(["proxy_scale"]) == ["proxy_scale"] and gc.selected(None) == list(gc.STAGES)
    for name in gc.STAGES:  # caps, worst case: never cut short by the default budget alone
        assert sum(gc.STAGES[n] for n in gc.selected([name])) <= gc.BUDGET_S, name


def test_the_rerun_hint_brings_back_the_stages_a_failure_skipped(gc):
    """install failed: doctor, megatron_step and run were skipped for it, so the rerun names them
    too (selected() adds what a stage needs, not what needs it); a passed stage is not redone."""
    st = {n: gc.Stage("pass") for n in gc.STAGES}
    st["install"] = gc.Stage("fail", "pip exited 1")
    for n in ("doctor", "megatron_step", "run"):
        st[n] = gc.Stage("skip", "needs install, which failed")
    st["proxy_scale"] = gc.Stage("skip", "out of time (60s of the 470s budget left)")
    hint = gc.rerun_hint(st)
    assert hint["stages"] == ["install", "doctor", "megatron_step", "run", "proxy_scale"], hint
    assert "--only install doctor megatron_step run proxy_scale" in hint["command"]
    assert gc.rerun_hint({n: gc.Stage("pass") for n in gc.STAGES}) is None


def test_the_proxy_scale_arguments_are_parsed_by_scale_bench_itself(gc):
    st = gc.check_proxy_scale_args()
    assert st.status == "pass", st.reason
    assert st.figures["only"] == ["proxy"] and st.figures["open_executions"] == [1024, 4096]
    assert (st.figures["engines"], st.figures["window_s"], st.figures["proxy_cpus"], st.figures["load_cpus"]) == ([8], 15.0, "0", "1-15")
    bad = gc.check_proxy_scale_args(["--only", "proxy", "--proxy-cores", "0"])  # a flag it does not have
    assert bad.status == "fail" and "unrecognized arguments: --proxy-cores" in bad.reason


FAKE_RUN = """import json, sys
from pathlib import Path
run = Path(sys.argv[sys.argv.index("--run-dir") + 1])
for i in range(229):  # what gyre.run leaves: records, trajectories, checkpoints, folders deep
    f = run / "executions" / f"e{i % 7}" / "calls" / f"{i}.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("{}")
ho = {"actor_offload": {"count": 2}, "actor_restore": {"count": 2}}
(run / "summary.json").write_text(json.dumps({"steps": 4, "aborted_calls": 0, "calls": 18, "handover_s": ho}))
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1 * s}) + "\\n" for s in range(4)))
"""
FAKE_SCALE = """import shutil, sys
shutil.copyfile(sys.argv[1], sys.argv[sys.argv.index("--out") + 1])
"""


def test_a_device_run_returns_its_json_and_two_small_files(gc, tmp_path, monkeypatch):
    """The device run's stages with CPU stand-ins: a run writing 229 files in nested folders, a
    scale bench giving a committed proxy record; the output folder gets back what the lent
    machine returns (≤ 8 files, ≤ 2 folders deep), gpu_check.json among them."""
    (tmp_path / "fake_run.py").write_text(FAKE_RUN)
    (tmp_path / "fake_scale.py").write_text(FAKE_SCALE)
    record = ROOT / "benchmarks" / "results" / "scale_bench.json"  # the proxy series, with its legs
    passed = lambda *a, **k: gc.Stage("pass")  # noqa: E731
    for name in ("stage_install", "stage_build", "_pytest"):
        monkeypatch.setattr(gc, name, passed)
    monkeypatch.setattr(gc, "DOCTOR", [sys.executable, "-c", "print('ok       torch               2.11')"])
    monkeypatch.setattr(gc, "stage_loss_bench", lambda t: gc.Stage("fail", "planted"))
    monkeypatch.setattr(gc, "RUN_LAUNCHER", [sys.executable, str(tmp_path / "fake_run.py")])
    monkeypatch.setattr(gc, "proxy_scale_command", lambda out: [sys.executable, str(tmp_path / "fake_scale.py"), str(record), "--out", str(out)])
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "out" / "gpu_check.json"
    assert gc.main(["--out", str(out)]) == 1  # the planted loss_bench failure
    assert returned(out.parent) == ["gpu_check.json", "gpu_check_run_metrics.jsonl", "gpu_check_run_summary.json"]
    res = json.loads(out.read_text())
    assert {k: v["status"] for k, v in res["stages"].items()} == {
        "install": "pass", "doctor": "pass", "build": "pass", "kernel_tests": "pass", "megatron_step": "pass", "run": "pass",
        "loss_bench": "fail", "proxy_scale": "pass"}, res["stages"]
    assert res["stages"]["run"]["figures"]["loss_by_step"] == [0.0, 0.1, 0.2, 0.30000000000000004]
    rows = res["stages"]["proxy_scale"]["figures"]["rows"]
    want = json.loads(record.read_text())["series"]["proxy"]
    assert rows == [{k: w[k] for k in gc.PROXY_SCALE_KEYS} for w in want] and len(rows) >= 2
    assert all(r["legs_ms_p50_p99"]["proxy_added"] and r["proxy_added_ms_p99"] is not None for r in rows)
    assert res["rerun"]["stages"] == ["build", "loss_bench"] and "--only loss_bench" in res["rerun"]["command"]
    # --only: the chosen stage and what it needs; the rest not selected
    monkeypatch.setattr(gc, "stage_loss_bench", passed)
    assert gc.main(["--out", str(out), "--only", "loss_bench"]) == 0
    st = {k: v["status"] for k, v in json.loads(out.read_text())["stages"].items()}
    assert [k for k, v in st.items() if v == "pass"] == ["build", "loss_bench"]
    # out of budget: proxy_scale cannot fit (more than the budget) and is not started, the others still are
    monkeypatch.setattr(gc, "FIT_S", {**{n: 1 for n in gc.STAGES}, "proxy_scale": 61})
    assert gc.main(["--out", str(out), "--budget-s", "60"]) == 0
    res = json.loads(out.read_text())
    assert res["stages"]["proxy_scale"]["status"] == "skip" and "out of time: proxy_scale" in res["stages"]["proxy_scale"]["reason"]
    assert res["stages"]["loss_bench"]["status"] == "pass" and res["rerun"]["stages"] == ["proxy_scale"]


def test_the_doctor_stage_passes_on_a_clean_table_and_names_a_failed_line(gc, tmp_path):
    """The stage runs the real `python -m gyre.doctor`: with CPU flags on this machine its table
    has no fail; with the device run's flags (the Megatron actor on CUDA) here it fails, naming
    the lines that did."""
    ok = gc.stage_doctor(tmp_path, 120, ["--preset", "cpu-demo-smoke", "--backend.actor", "cpu"])
    assert ok.status == "pass", ok.reason + ok.log_tail
    assert any(ln.startswith("ok ") and "torch" in ln for ln in ok.figures["lines"])
    bad = gc.stage_doctor(tmp_path, 120)  # RUN_ARGS: --backend.actor megatron --backend.device cuda
    assert bad.status == "fail" and "exited 1" in bad.reason and "gpus" in bad.reason and "backends" in bad.reason


def test_the_box_keeps_its_packages_unless_older_than_the_pin(gc):
    assert gc._older("4.10.0", "4.16.0") and not gc._older("4.16.0", "4.16.0") and not gc._older("5.0", "4.16.0")
    assert not gc._older("not-a-version", "1.0")


def test_the_cpu_tests_named_for_what_one_gpu_cannot_try_exist(gc):
    import re

    named = {p for v in gc.ONE_GPU_LIMITS.values() for p in re.findall(r"tests/[\w/]+\.py", v)}
    assert len(named) >= 5 and all((ROOT / p).exists() for p in named), sorted(p for p in named if not (ROOT / p).exists())


# ---------------------------------------------------------------------------- budget and logs (unit)
def test_a_timed_out_commands_log_comes_back_as_text(gc):
    """subprocess.run(text=True) leaves a TimeoutExpired's output as the raw bytes read so far
    (CPython's Popen._check_timeout), stdout and stderr apart: the stage's log_tail is their text,
    lines and non-ASCII intact, not an escaped b'...' string. First the exception CPython builds,
    then a real child killed at its timeout."""
    e = subprocess.TimeoutExpired(["x"], 5, output="step 1 ✓\nstep 2\n".encode(), stderr=b"Traceback: stuck\n")
    assert gc.timeout_output(e) == "step 1 ✓\nstep 2\nTraceback: stuck\n"
    assert gc.timeout_output(subprocess.TimeoutExpired(["x"], 5)) == ""  # nothing read yet: both None
    assert gc.timeout_output(subprocess.TimeoutExpired(["x"], 5, output="already text\n")) == "already text\n"

    def stage(timeout):  # a child that prints, then hangs past its timeout
        gc._sh(["sh", "-c", "printf 'loading ✓\\nstill going\\n'; printf 'warn\\n' >&2; exec sleep 60"], timeout)

    st = gc.run_stage("doctor", stage, 5)
    assert st.status == "fail" and st.reason == "timed out after 5s"
    assert st.log_tail.splitlines() == ["loading ✓", "still going", "warn"], st.log_tail
    assert "b'" not in st.log_tail and "\\n" not in st.log_tail


def test_a_stage_that_cannot_fit_the_time_left_is_skipped_by_name_and_never_started(gc, monkeypatch, tmp_path):
    started = []
    stage = lambda name: lambda *a, **k: started.append(name) or gc.Stage("pass")  # noqa: E731
    for fn, name in (("stage_install", "install"), ("stage_build", "build"), ("stage_doctor", "doctor"),
                     ("stage_run", "run"), ("stage_loss_bench", "loss_bench"), ("stage_proxy_scale", "proxy_scale")):
        monkeypatch.setattr(gc, fn, stage(name))
    monkeypatch.setattr(gc, "_pytest", lambda paths, *a, **k: started.append(paths[0]) or gc.Stage("pass"))
    clock = [1000.0]
    monkeypatch.setattr(gc, "_now", lambda: clock[0])  # no stage takes any time: only FIT_S decides
    stages = gc.run_device(None, tmp_path / "x.json", 85.0, None)
    assert all(gc.FIT_S[n] <= gc.STAGES[n] for n in gc.STAGES)  # every cap is at least what its stage needs
    skipped = [n for n, st in stages.items() if st.status == "skip"]
    assert skipped == [n for n in gc.STAGES if gc.FIT_S[n] > 85] == ["proxy_scale"]
    assert "proxy_scale" not in started and "run" in started  # run needs 80 s: it fits 85
    why = stages["proxy_scale"].reason
    assert why.startswith("out of time: proxy_scale needs at least 90s, 85s of the 85s budget left"), why
    assert gc.rerun_hint(stages)["stages"] == ["proxy_scale"]
    # the pure decision, with the time left at each side of a stage's need
    assert gc.skip_reason("run", {}, list(gc.STAGES), gc.FIT_S["run"], 470) is None
    assert gc.skip_reason("run", {}, list(gc.STAGES), gc.FIT_S["run"] - 1, 470).startswith("out of time: run ")
    assert gc.skip_reason("run", {"install": gc.Stage("fail")}, list(gc.STAGES), 400, 470) == "needs install, which failed"
    assert gc.skip_reason("run", {}, ["loss_bench"], 400, 470) == "not selected (--only)"


def test_the_install_stage_has_one_timeout_for_pip_and_the_import_check(gc, monkeypatch, tmp_path):
    """pip took 70 s of the stage's 90: the runtime import check gets the 20 left, not 90 more; when
    pip took all of it, the check is not started and the stage times out."""
    clock, timeouts = [0.0], []
    monkeypatch.setattr(gc, "_now", lambda: clock[0])
    monkeypatch.setattr(gc, "check_wheels", lambda wheels, specs: ([], {}))
    monkeypatch.setattr(gc, "WHEELS", ["gyre-not-a-real-package==1.0"])  # not installed: pip is run for it

    def sh(cmd, timeout, **kw):
        timeouts.append(timeout)
        clock[0] += took.pop(0)
        return 0, ""

    monkeypatch.setattr(gc, "_sh", sh)
    took = [70.0, 1.0]
    st = gc.stage_install(tmp_path, 90)
    assert st.status == "pass" and timeouts == [90, 20], timeouts
    clock[0], timeouts[:] = 0.0, []
    took[:] = [90.0]
    with pytest.raises(subprocess.TimeoutExpired):
        gc.stage_install(tmp_path, 90)
    assert timeouts == [90]  # the import check was never started
    clock[0], timeouts[:], took[:] = 0.0, [], [95.0]  # pip itself ran out: the stage fails, timed out
    st = gc.run_stage("install", lambda t: gc.stage_install(tmp_path, t), 90)
    assert st.status == "fail" and st.reason == "timed out after 90s"
