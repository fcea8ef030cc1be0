"""`python -m gyre.doctor`: the preflight's table on this machine, planted failures, and each
check's logic against an expectation of its own (a hand-built sysfs, a bound socket, a tiny
real-family config, setup.py run with `setup` captured)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.config import parse_config
from gyre.doctor import cluster, node, versions
from gyre.doctor.table import FAIL, OK, SKIPPED, WARN, Line, exit_code, merge, render
from tests.realmodels import model_config
from tests.setup_py import setup_kwargs

ROOT = Path(__file__).resolve().parents[1]
# Every check the issue asks for, by the name the table gives it (issue 30, "python -m gyre.doctor").
CHECKS = ["torch", "cuda", "nccl", "sglang", "megatron-core", "mooncake", "transformer-engine", "gpus", "master port",
          "all-reduce", "prefix groups", "run dir", "proxy port", "rdma", "backends", "checkpoint", "dtype", "vocabulary",
          "chat format", "tools", "sandbox"]
STATUSES = {"ok", "warn", "fail", "skipped"}


# Each check takes the sections it reads; these hand it them from a parsed command line, as the
# doctor's `check` does.
def gpu_line(cfg, **kw):
    return node.gpu_line(cfg.backend, **kw)


def rdma_line(cfg, devices):
    return node.rdma_line(cfg.transfer, cfg.proxy, devices)


def proxy_port_line(cfg, **kw):
    return node.proxy_port_line(cfg.proxy, **kw)


def backends_line(cfg):
    return node.backends_line(cfg.backend, cfg.transfer, cfg.model, cfg.parallel, cfg.train.resumed())


def checkpoint_lines(cfg):
    return node.checkpoint_lines(cfg.model, cfg.backend, cfg.parallel, cfg.sglang, cfg.train)


def sandbox_line(cfg):
    return node.sandbox_line(cfg.executions.runner)


def run_dir_line(cfg, probes):
    return cluster.run_dir_line(cfg.run_dir, cfg.preset, probes, resume=cfg.train.resume, overwrite=cfg.overwrite)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doctor(cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), MASTER_PORT=str(free_port()))  # 29500 may be taken on a shared machine
    return subprocess.run([sys.executable, "-m", "gyre.doctor", *flags], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def table(out: str) -> dict[str, tuple[str, str]]:
    """{check: (status, detail)} of the printed table (fix lines and the header skipped)."""
    rows = {}
    for line in out.splitlines():
        status, _, rest = line.partition(" ")
        if status in STATUSES:
            rest = rest.strip()
            name = next(c for c in sorted(CHECKS, key=len, reverse=True) if rest.startswith(c))
            rows[name] = (status, rest[len(name):].strip())
    return rows


# ----------------------------------------------------------------------------- the command, end to end
def test_cpu_machine_prints_every_check_and_exits_0(tmp_path):
    r = doctor(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    assert list(rows) == CHECKS, r.stdout
    assert all(status != FAIL for status, _ in rows.values()), r.stdout
    if not torch.cuda.is_available():  # this machine: the GPU lines say why they were skipped
        for name in ("cuda", "nccl", "gpus"):
            assert rows[name][0] == SKIPPED and "no CUDA" in rows[name][1], rows[name]
    assert rows["all-reduce"][0] == OK  # a gloo world of one
    assert rows["run dir"][0] == OK and str(tmp_path) in rows["run dir"][1]
    assert not list(tmp_path.rglob(f"{cluster.PROBE_PREFIX}*")), "the probe file was left behind"
    lines = r.stdout.splitlines()
    for i, line in enumerate(lines):  # every warn / fail line is followed by its fix (a skip says why instead)
        if line.startswith((WARN, FAIL)):
            assert lines[i + 1].strip().startswith("fix: "), line


def test_unwritable_run_dir_fails_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # a parent that is a file: no writes under it, root or not
    r = doctor(tmp_path, "--run-dir", str(blocker / "run"))
    assert r.returncode == 1, r.stdout
    rows = table(r.stdout)
    assert rows["run dir"][0] == FAIL and str(blocker) in rows["run dir"][1]
    assert [n for n, (s, _) in rows.items() if s == FAIL] == ["run dir"]


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys")
def test_a_run_dir_where_the_filesystem_refuses_directories_is_refused_naming_the_flag():
    """Issue 53 item 7: `os.access` says root may write /sys, but mkdir there is refused; gyre.run
    gave a raw PermissionError traceback from the run-directory code."""
    from gyre.config_checks import check_run_dir
    from gyre.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--run-dir /sys/gyre-x: cannot create a directory in /sys: "):
        check_run_dir("/sys/gyre-x", "smoke")
    assert not Path("/sys/gyre-x").exists()


def test_unsupported_architecture_fails_naming_it(tmp_path):
    ckpt = tmp_path / "mamba"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    r = doctor(tmp_path, "--model.checkpoint", str(ckpt))
    assert r.returncode == 1, r.stdout
    rows = table(r.stdout)
    assert rows["checkpoint"][0] == FAIL and "MambaForCausalLM" in rows["checkpoint"][1]
    assert [n for n, (s, _) in rows.items() if s == FAIL] == ["checkpoint"]


def test_help_explains_and_lists_gyre_run_flags():
    r = subprocess.run([sys.executable, "-m", "gyre.doctor", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for name in CHECKS:
        assert name in r.stdout, name
    for flag in ("--model.checkpoint", "--backend.engine", "--backend.actor", "--run-dir", "--timeout-s"):
        assert flag in r.stdout, flag


def test_without_a_preset_it_checks_readme_command_ones_job(tmp_path):
    readme = (ROOT / "README.md").read_text()
    one = next(line for line in readme.splitlines() if line.startswith("pip install torch") and "torchrun" in line)
    preset = one.split("--preset", 1)[1].split()[0]  # the preset README command 1 runs
    r = doctor(tmp_path, "--timeout-s", "20")
    assert f"preset {preset}," in r.stdout.splitlines()[0] or r.stdout.splitlines()[0].endswith(f"preset {preset}"), r.stdout
    chosen = doctor(tmp_path, "--timeout-s", "20", "--preset", "smoke")
    assert chosen.stdout.splitlines()[0].endswith("preset smoke"), chosen.stdout


def test_bad_flag_exits_2(capsys):
    from gyre.doctor import main

    assert main(["--no-such-flag"]) == 2
    assert "no-such-flag" in capsys.readouterr().err


# ----------------------------------------------------------------------------- versions against setup.py
def test_pins_are_setup_pys_own(monkeypatch):
    kw = setup_kwargs()
    expected = [(r, "") for r in kw["install_requires"]] + [(r, e) for e, rs in kw["extras_require"].items() for r in rs]
    assert versions.requirements_of_setup((ROOT / "setup.py").read_text()) == expected
    reqs = versions.gyre_requirements()
    from packaging.requirements import Requirement

    gpu = {Requirement(r).name: str(Requirement(r).specifier) for r in kw["extras_require"]["gpu"]}
    for name in ("sglang", "megatron-core"):
        assert reqs[name] == (gpu[name], "extra 'gpu'")  # the gpu extra's pin, not the test extra's
    torch_req = Requirement(next(r for r in kw["install_requires"] if r.startswith("torch")))
    assert reqs["torch"] == (str(torch_req.specifier), "install_requires")


def test_requirements_of_metadata_reads_extras():
    assert versions.requirements_of_metadata(["torch>=2.6", 'sglang==0.5.23; extra == "gpu"', 'x; extra == "test"']) == \
        [("torch>=2.6", ""), ("sglang==0.5.23", "gpu"), ("x", "test")]


@pytest.mark.parametrize("found, needed, status", [
    (("sglang", "0.5.23"), "", OK), (("sglang", "0.5.22"), "", WARN), (("sglang", "0.5.22"), "--backend.engine sglang", FAIL),
    (None, "--backend.engine sglang", FAIL), (None, "", SKIPPED)])
def test_judge(found, needed, status):
    line = versions.judge("sglang", found, ("==0.5.23", "extra 'gpu'"), needed_by=needed, install="sglang==0.5.23")
    assert line.status == status
    assert "sglang==0.5.23" in line.detail
    assert (line.fix == "") == (status in (OK, SKIPPED))


# ----------------------------------------------------------------------------- GPUs, RDMA, ports
def test_gpu_line():
    cpu, meg = parse_config([]), parse_config(["--backend.actor", "megatron"])
    assert gpu_line(cpu, cuda=False, count=0, mem={}, ranks_here=1).status == SKIPPED
    no = gpu_line(meg, cuda=False, count=0, mem={}, ranks_here=1)
    assert no.status == FAIL and "--backend.actor megatron" in no.detail
    assert gpu_line(cpu, cuda=True, count=4, mem={}, ranks_here=8).status == FAIL  # 8 ranks, 4 GPUs
    g = node.GIB
    ok = gpu_line(cpu, cuda=True, count=2, mem={0: (139 * g, 140 * g), 1: (127 * g, 140 * g)}, ranks_here=2)
    assert ok.status == OK and "139.0/140.0" in ok.detail  # 13/140 = 9.3 % used: under 10 %
    busy = gpu_line(cpu, cuda=True, count=2, mem={0: (139 * g, 140 * g), 1: (100 * g, 140 * g)}, ranks_here=2)
    assert busy.status == WARN and "cuda:1 " in busy.detail  # 40/140 = 28.6 % used


def test_rdma(tmp_path):
    for dev, state in (("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")):
        (tmp_path / dev / "ports" / "1").mkdir(parents=True)
        (tmp_path / dev / "ports" / "1" / "state").write_text(state + "\n")
    devices = node.rdma_devices(tmp_path)
    assert devices == {"mlx5_0": ["ACTIVE"], "mlx5_1": ["DOWN"]}
    assert node.rdma_devices(tmp_path / "absent") == {}
    rdma = ["--transfer.transport", "mooncake", "--transfer.mooncake-protocol", "rdma"]
    assert rdma_line(parse_config(rdma), devices).status == OK
    assert rdma_line(parse_config(rdma), {"mlx5_1": ["DOWN"]}).status == FAIL
    named = rdma_line(parse_config(rdma + ["--transfer.mooncake-device", "mlx5_1"]), devices)
    assert named.status == FAIL and "mlx5_1" in named.detail
    assert rdma_line(parse_config([]), {}).status == SKIPPED  # Mooncake not chosen


def test_ports():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert node.port_in_use("127.0.0.1", port) == "in use"
        cfg = parse_config(["--proxy.port", str(port)])
        line = proxy_port_line(cfg, rank=0)
        assert line.status == FAIL and str(port) in line.detail
        assert proxy_port_line(cfg, rank=1).status == SKIPPED  # the proxy is rank 0's
        alone = cluster.master_port_line(cluster.Launch("alone"), {"MASTER_PORT": str(port)}, reached=None)
        assert alone.status == FAIL and str(port) in alone.detail
    assert node.port_in_use("127.0.0.1", port) is None  # closed: bindable again
    assert proxy_port_line(parse_config([]), rank=0).status == OK  # port 0


def test_launch_of():
    assert cluster.launch_of({}) == cluster.Launch("alone")
    t = cluster.launch_of({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"})
    assert (t.launcher, t.rank, t.world, t.local_rank, t.master_addr, t.master_port) == ("torchrun", 5, 8, 1, "h", 123)
    s = cluster.launch_of({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "n[003-004]", "GYRE_MASTER_PORT": "4000"})
    assert (s.launcher, s.rank, s.world, s.local_rank, s.master_addr, s.master_port) == ("srun", 9, 16, 1, "n003", 4000)
    assert cluster.launch_of({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "alone"  # one task: alone


# ----------------------------------------------------------------------------- the run directory
def test_filesystem_of():
    mounts = "/dev/sda1 / ext4 rw 0 0\nsrv:/export /shared nfs4 rw 0 0\nfs /shared\\040x lustre rw 0 0\n"
    assert cluster.filesystem_of(Path("/shared/runs/a"), mounts) == "nfs4"
    assert cluster.filesystem_of(Path("/sharedx/runs"), mounts) == "ext4"  # a prefix of the name is not the mount
    assert cluster.filesystem_of(Path("/shared x/r"), mounts) == "lustre"


def test_run_dir_line(tmp_path):
    cfg = parse_config(["--run-dir", str(tmp_path / "run")])
    probes = []
    for r in range(3):
        tag = f"host{r % 2}-{100 + r}-{r}"
        path, err = cluster.write_probe(cluster.nearest_existing(tmp_path / "run"), tag)
        assert err == "" and Path(path).read_text() == tag
        probes.append((tag, path, err))
    ok = run_dir_line(cfg, probes)
    assert ok.status == OK and "3 ranks on 2 node(s)" in ok.detail
    # rank 2 wrote to a directory rank 0 does not see (a node-local disk): its probe is not there
    os.unlink(probes[2][1])
    local = run_dir_line(cfg, probes)
    assert local.status == FAIL and "[2]" in local.detail and "shared" in local.detail
    _, err = cluster.write_probe(tmp_path / "nope", "t")
    assert "not a directory" in err
    bad = run_dir_line(cfg, [probes[0], ("t", None, err)])
    assert bad.status == FAIL and "rank 1" in bad.detail
    for _, path, _ in probes:
        cluster.remove_probe(path)
    assert not list(tmp_path.glob(f"{cluster.PROBE_PREFIX}*"))


def test_run_dir_that_gyre_run_would_refuse(tmp_path):
    from gyre.runtime.rundir import RUN_OUTPUTS

    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_OUTPUTS[0]).write_text("{}")  # a previous run's run.json
    probe = [(cluster.probe_tag(0), *cluster.write_probe(run, cluster.probe_tag(0)))]
    held = run_dir_line(parse_config(["--run-dir", str(run)]), probe)
    assert held.status == FAIL and RUN_OUTPUTS[0] in held.detail and "--overwrite" in held.fix
    assert run_dir_line(parse_config(["--run-dir", str(run), "--overwrite"]), probe).status == OK
    assert run_dir_line(parse_config(["--run-dir", str(run), "--train.resume"]), probe).status == OK
    absent = parse_config(["--run-dir", str(tmp_path / "absent"), "--train.resume"])
    assert run_dir_line(absent, probe).status == FAIL
    cluster.remove_probe(probe[0][1])


# ----------------------------------------------------------------------------- checkpoint, backends, sandbox
def _checkpoint(path: Path, family: str, **overrides) -> str:
    config = model_config(family, 64, **overrides)
    config.save_pretrained(str(path))
    return str(path)


def test_checkpoint_of_a_real_family(tmp_path):
    ckpt = _checkpoint(tmp_path / "q3", "qwen3")
    lines = checkpoint_lines(parse_config(["--model.checkpoint", ckpt]))
    assert [(ln.name, ln.status) for ln in lines] == [("checkpoint", OK), ("dtype", OK)]
    assert "Qwen3ForCausalLM" in lines[0].detail
    sg = checkpoint_lines(parse_config(["--model.checkpoint", ckpt, "--backend.engine", "sglang"]))
    assert "SGLang serves it as Qwen3ForCausalLM" in sg[0].detail and "bfloat16" in sg[1].detail  # auto: bf16
    assert sg[0].status == WARN and "safetensors" in sg[0].detail  # a config alone: SGLang starts on a copy
    (tmp_path / "q3" / "model.safetensors").write_bytes(b"")  # what sglang_checkpoint.startable_checkpoint looks for
    assert checkpoint_lines(parse_config(["--model.checkpoint", ckpt, "--backend.engine", "sglang"]))[0].status == OK


def test_checkpoint_refusals(tmp_path):
    ckpt = _checkpoint(tmp_path / "q2", "qwen2.5")
    heads = json.loads((Path(ckpt) / "config.json").read_text())["num_attention_heads"]
    tp = heads + 1  # cannot divide the heads
    lines = checkpoint_lines(parse_config(["--model.checkpoint", ckpt, "--backend.actor", "megatron",
                                                "--parallel.tp", str(tp), "--parallel.cell-size", str(tp)]))
    assert lines[0].status == FAIL and "megatron" in lines[0].detail
    from gyre.backends.models.hf import model_config as preset_config

    assert preset_config("small", 1).num_attention_heads % 3 != 0  # the preset's heads: tp 3 cannot split them
    preset = checkpoint_lines(parse_config(["--backend.actor", "megatron", "--parallel.tp", "3",
                                                 "--parallel.cell-size", "3"]))
    assert preset[0].status == FAIL and "--parallel.tp 3" in preset[0].detail
    f32 = checkpoint_lines(parse_config(["--model.checkpoint", ckpt, "--backend.engine", "sglang",
                                              "--model.dtype", "float32"]))
    assert [(ln.name, ln.status) for ln in f32][1] == ("dtype", FAIL) and f32[0].status != FAIL
    assert checkpoint_lines(parse_config(["--model.checkpoint", str(tmp_path / "absent")]))[0].status == FAIL
    prepared = checkpoint_lines(parse_config(["--preset", "cpu-demo", "--train.prepare-dir", str(tmp_path / "d"),
                                                   "--model.checkpoint", str(tmp_path / "d" / "warm")]))
    assert [(ln.name, ln.status) for ln in prepared] == [("checkpoint", SKIPPED), ("dtype", OK)]  # --train.prepare writes it
    half = _checkpoint(tmp_path / "fp16", "qwen3", torch_dtype="float16")
    assert node.stored_dtype(half) == "float16"
    warn = checkpoint_lines(parse_config(["--model.checkpoint", half, "--model.dtype", "bfloat16"]))[1]
    assert warn.status == WARN and warn.fix


# ----------------------------------------------------------------------------- the tokenizer and chat template
GEMMA = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"


@pytest.fixture(scope="module")
def chatml_checkpoint(tmp_path_factory):
    """A tiny SmolLM2-kind checkpoint (Llama, plain ChatML template, a default system prompt)."""
    from tests.realmodels import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ck") / "chatml", "chatml")


def _variant(base: Path, path: Path, template: str | None = None, rows: int | None = None) -> str:
    """`base` with another chat template or embedding rows (config.json vocab_size)."""
    shutil.copytree(base, path)
    if template is not None:
        tc = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    if rows is not None:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "vocab_size": rows}))
    return str(path)


# (checkpoint variant, flags) -> the line that fails, or None; gyre.run refuses exactly the failing ones
CHAT_CASES = {
    "chatml": (dict(), [], None),
    "chatml hermes tools": (dict(), ["--proxy.tool-format", "hermes"], None),
    "chatml no tools": (dict(), ["--proxy.tool-format", "none"], None),
    "unknown template": (dict(template=GEMMA), [], "chat format"),
    "unknown template named": (dict(template=GEMMA), ["--proxy.chat-format", "chatml"], None),
    "format the tokenizer cannot speak": (dict(), ["--proxy.chat-format", "llama3.1"], "chat format"),
    "hermes parser, no tool calls": (dict(), ["--proxy.tool-parser", "hermes"], "chat format"),
    "fewer embedding rows than ids": (dict(rows=1000), [], "vocabulary"),
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_the_doctor_fails_what_gyre_run_refuses(tmp_path, chatml_checkpoint, case):
    """The vocabulary / chat format / tools lines against gyre.run's own preflight
    (`check_train_config`, every rank, before the run directory): a line fails exactly when the
    run is refused, and says the refusal's message."""
    from gyre.config_checks import check_train_config
    from gyre.doctor.chat import chat_lines
    from gyre.errors import ConfigError
    from tests.jobs import write_tasks

    variant, flags, failing = CHAT_CASES[case]
    ckpt = _variant(chatml_checkpoint, tmp_path / "ck", **variant) if variant else str(chatml_checkpoint)
    argv = ["--job", "train", "--model.checkpoint", ckpt, "--executions.dataset.path", str(write_tasks(tmp_path / "t.jsonl")),
            "--executions.runner.sandbox", "none", "--run-dir", str(tmp_path / "run"), *flags]
    refusal = None
    try:
        check_train_config(parse_config(argv), 1)
    except ConfigError as e:
        refusal = str(e)
    cfg = parse_config(argv)
    lines = {ln.name: ln for ln in chat_lines(cfg.model, cfg.proxy, cfg.train)}
    assert list(lines) == ["vocabulary", "chat format", "tools"]
    failed = [n for n, ln in lines.items() if ln.status == FAIL]
    assert (refusal is None) == (failing is None), refusal
    assert failed == ([failing] if failing else [])
    if failing:
        assert lines[failing].detail == refusal and lines[failing].fix
    else:
        assert lines["chat format"].detail.startswith("chatml")
        tools = lines["tools"]
        assert (tools.status, "400" in tools.detail) == {"chatml": (WARN, True), "chatml hermes tools": (OK, False),
                                                         "chatml no tools": (OK, True)}.get(case, (WARN, True))


def test_the_doctor_command_on_a_plain_chatml_checkpoint(tmp_path, chatml_checkpoint):
    """End to end: a template no format knows fails the preflight (exit 1, the fix names the flag);
    the plain ChatML one passes, warning that tools will get a 400 until --proxy.tool-format hermes."""
    unknown = _variant(chatml_checkpoint, tmp_path / "gemma", template=GEMMA)
    r = doctor(tmp_path, "--model.checkpoint", unknown)
    assert r.returncode == 1, r.stdout
    rows = table(r.stdout)
    assert rows["chat format"][0] == FAIL and "no known chat format" in rows["chat format"][1]
    assert [n for n, (s, _) in rows.items() if s == FAIL] == ["chat format"]
    lines = r.stdout.splitlines()
    fix = lines[next(i for i, ln in enumerate(lines) if ln.startswith(FAIL)) + 1]
    assert "--proxy.chat-format" in fix
    r = doctor(tmp_path, "--model.checkpoint", str(chatml_checkpoint))
    assert r.returncode == 0, r.stdout
    rows = table(r.stdout)
    assert rows["chat format"][0] == OK and rows["chat format"][1].startswith("chatml (the template's)")
    assert rows["tools"][0] == WARN and "--proxy.tool-format hermes" in rows["tools"][1]
    assert rows["vocabulary"] == (OK, f"1536 token ids ({chatml_checkpoint}) <= 1536 embedding rows")


def test_backends_line():
    assert backends_line(parse_config([])).status == OK
    sg = backends_line(parse_config(["--backend.engine", "sglang"]))
    if not torch.cuda.is_available():
        assert sg.status == FAIL and "--backend.engine sglang" in sg.detail


def test_sandbox_line(monkeypatch):
    from gyre.executions import sandbox

    monkeypatch.setattr(sandbox, "bwrap_works", lambda: True)
    assert sandbox_line(parse_config([])).status == OK
    monkeypatch.setattr(sandbox, "bwrap_works", lambda: False)
    assert sandbox_line(parse_config([])).status == WARN  # auto falls back to none
    assert sandbox_line(parse_config(["--executions.runner.sandbox", "bwrap"])).status == FAIL
    assert sandbox_line(parse_config(["--executions.runner.sandbox", "none"])).status == WARN
    assert sandbox_line(parse_config(["--executions.runner.sandbox", "container"])).status == FAIL  # no image
    nocli = parse_config(["--executions.runner.sandbox", "container", "--executions.runner.container-image", "img",
                          "--executions.runner.container-cli", "no-such-cli-here"])
    assert sandbox_line(nocli).status == FAIL
    monkeypatch.setattr(node.shutil, "which", lambda name: None)
    assert sandbox_line(parse_config(["--executions.runner.sandbox", "unshare"])).status == FAIL


# ----------------------------------------------------------------------------- the table
def test_merge_render_exit_code():
    a, b = Line("gpus", OK, "8 GPUs"), Line("gpus", FAIL, "0 GPUs", "fix it")
    assert merge([("rank 0", [a]), ("rank 1", [a])]) == [a]
    m = merge([("rank 0", [a, Line("run dir", OK, "shared")]), ("rank 1", [b]), ("rank 2", [b])])
    assert m[0] == Line("gpus", FAIL, "rank 1, rank 2: 0 GPUs", "fix it") and m[1] == Line("run dir", OK, "shared")
    once = merge([("rank 0", [Line("rdma", SKIPPED, "none here")]), ("rank 8", [Line("rdma", OK, "mlx5_0")])])
    assert once == [Line("rdma", OK, "mlx5_0")]  # the other node's skip does not hide it
    out = render(m)
    assert out.splitlines()[1].split()[:2] == ["fail", "gpus"] and "fix: fix it" in out.splitlines()[2]
    assert exit_code(m) == 1 and exit_code([a, Line("x", WARN, "w", "f")]) == 0
    with pytest.raises(ValueError, match="status"):
        Line("x", "bad", "")


# ----------------------------------------------------------------------------- across ranks
def _check_on_rank(cfg_args):
    from gyre.doctor import check

    lines, rc, header = check(parse_config(cfg_args), dict(os.environ), 60.0)
    return lines, rc, header


@pytest.mark.multirank
def test_three_ranks(tmp_path):
    from tests.distributed import run_ranks

    results = run_ranks(_check_on_rank, 3, ["--run-dir", str(tmp_path / "run")], init=False)
    lines, rc, header = results[0]
    rows = {ln.name: ln for ln in lines}
    assert rc == 0 and all(r[1] == 0 for r in results)
    assert header and "3 ranks" in header and results[1][2] is None  # rank 0 prints, the others do not
    assert rows["all-reduce"].status == OK and "3 ranks" in rows["all-reduce"].detail
    assert rows["prefix groups"].status == OK and "k=2..3" in rows["prefix groups"].detail  # K = 3 cells of 1
    assert rows["run dir"].status == OK and "3 ranks" in rows["run dir"].detail
    assert rows["master port"].status == OK
    assert not list(tmp_path.glob(f"{cluster.PROBE_PREFIX}*"))


def _srun_tasks(tmp_path: Path, flags: list[str], wrap: dict[int, list[str]] | None = None) -> list[subprocess.CompletedProcess]:
    """`srun --ntasks 2 python -m gyre.doctor FLAGS` on this machine: two processes with Slurm's
    variables (the rendezvous: the nodelist's first host at GYRE_MASTER_PORT); `wrap[rank]` is a
    command prefix for that task (`sh -c ... "$@"`)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
        env.update(PYTHONPATH=str(ROOT), SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_JOB_NODELIST="localhost", GYRE_MASTER_PORT=str(port))
        argv = [*(wrap or {}).get(rank, []), sys.executable, "-m", "gyre.doctor", "--timeout-s", "60", *flags]
        procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.multirank
def test_srun_tasks_share_the_run_dir(tmp_path):
    r0, r1 = _srun_tasks(tmp_path, ["--run-dir", str(tmp_path / "run")])
    assert (r0.returncode, r1.returncode) == (0, 0), r0.stdout + r0.stderr + r1.stderr
    rows = table(r0.stdout)
    assert "srun, 2 ranks" in r0.stdout and r1.stdout == ""  # rank 0 prints the one table
    assert rows["master port"][0] == OK and "localhost:" in rows["master port"][1]
    assert rows["run dir"][0] == OK and "2 ranks" in rows["run dir"][1]
    assert rows["prefix groups"][0] == OK  # 2 cells of 1: the prefix group k=2


def _can_mount_privately() -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.multirank
@pytest.mark.skipif(not _can_mount_privately(), reason="needs `unshare --mount` and mount rights (a private tmpfs)")
def test_a_node_local_run_dir_fails(tmp_path):
    """Rank 1 sees its own tmpfs at the run directory's path (as a node-local disk would be): rank 0
    cannot see rank 1's probe, and the run dir line fails naming rank 1."""
    run = tmp_path / "run"
    run.mkdir()
    private = ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs none {run} && exec \"$@\"", "sh"]
    r0, r1 = _srun_tasks(tmp_path, ["--run-dir", str(run)], wrap={1: private})
    assert r0.returncode == 1 and r1.returncode == 1, r0.stdout + r0.stderr + r1.stderr  # every task exits as rank 0
    status, detail = table(r0.stdout)["run dir"]
    assert status == FAIL and "ranks [1]" in detail and "shared" in detail
    assert not list(run.glob(f"{cluster.PROBE_PREFIX}*"))


def test_a_rendezvous_nobody_hosts_fails_the_master_port_line(tmp_path):
    """Task 1 of 2 alone (task 0, which hosts the rendezvous, never started): after --timeout-s the
    rank prints its own table, the master port line failed naming the address, and it exits 1."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0",
               SLURM_JOB_NODELIST="localhost", GYRE_MASTER_PORT=str(port))
    r = subprocess.run([sys.executable, "-m", "gyre.doctor", "--timeout-s", "2", "--run-dir", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = table(r.stdout)
    assert rows["master port"][0] == FAIL and f"localhost:{port}" in rows["master port"][1]
    assert rows["all-reduce"] == (SKIPPED, "no process group")
