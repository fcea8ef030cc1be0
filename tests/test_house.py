"""The house rules of issue 31, held against the code's own imports (read with `ast`, nothing run):

* every import between rooms of `gyre/` goes down the layers docs/design.md §8 draws (a lazy
  import inside a function counts; a `TYPE_CHECKING` one does not);
* no import cycle between modules (lazy and `TYPE_CHECKING` imports count);
* a module over 600 lines says why in its docstring;
* only `runtime/controller.py` and its builder, `runtime/job.py`, import `Controller` (a
  `TYPE_CHECKING` import included): the rest sees it through protocols (`stop.Ranks`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GYRE = Path(__file__).resolve().parents[1] / "gyre"

# docs/design.md §8, lowest first: a room imports only from its own layer or those below it.
LAYERS = [
    {"errors", "ids", "backoff", "logging_utils", "serving", "topology", "checkpoint", "slurm", "dispatch", "_C"},
    {"loss", "trajectory", "scheduler"},
    {"executions", "sim"},
    {"backends"},
    {"proxy"},
    {"config", "config_checks", "help", "sized_defaults"},
    {"runtime", "plan"},
    {"run", "report", "doctor", "eval", "export"},
]
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _module(path: Path) -> str:
    parts = path.relative_to(GYRE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = GYRE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else "gyre"


def imports(path: Path, typing: bool = False, text: str | None = None) -> list[str]:
    """The gyre modules `path` (or `text` as if it were `path`) imports, anywhere in it; under
    `if TYPE_CHECKING:` only if `typing`."""
    module, tree = _module(path), ast.parse(path.read_text() if text is None else text)
    typing_only = set() if typing else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                                        and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            # `from gyre.x import y`: y may be a module of gyre.x
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        out += [n for n in names if n == "gyre" or n.startswith("gyre.")]
    return out


def graph(typing: bool = False) -> dict[str, list[str]]:
    return {_module(p): imports(p, typing) for p in GYRE.rglob("*.py")}


def upward(g: dict[str, list[str]]) -> list[str]:
    bad = []
    for module, targets in g.items():
        for target in targets:
            a, b = _room(module), _room(target)
            if a != b and b != "gyre" and LAYER[b] > LAYER[a]:
                bad.append(f"{module} -> {target} ({a}: layer {LAYER[a]}, {b}: layer {LAYER[b]})")
    return sorted(bad)


def cycles(g: dict[str, list[str]]) -> list[list[str]]:
    """Import cycles, lazy imports included (Tarjan's strongly connected components of more than one module)."""
    edges = {m: sorted({t for t in ts if t in g and t != m}) for m, ts in g.items()}
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_room_is_in_a_layer():
    rooms = {_room(m) for m in graph()} - {"gyre", "__main__"}
    assert rooms <= set(LAYER), f"rooms with no layer in LAYERS (and docs/design.md §8): {sorted(rooms - set(LAYER))}"


def test_no_import_goes_up_a_layer():
    assert upward(graph()) == []


def test_no_import_cycle():
    """A `TYPE_CHECKING` import is a real arrow: the two modules cannot be understood apart."""
    assert cycles(graph(typing=True)) == []


def test_large_modules_say_why():
    for p in GYRE.rglob("*.py"):
        text = p.read_text()
        if len(text.splitlines()) > 600:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "Over 600 lines:" in doc, f"{p.relative_to(GYRE.parent)}: over 600 lines and its docstring does not say why"


@pytest.mark.parametrize("planted", ["up", "cycle"])
def test_the_rules_catch_a_planted_import(planted):
    """The checks above fail on the bug they exist for."""
    g = graph()
    if planted == "up":  # the backends reaching into the runtime (found by the house review)
        g["gyre.backends.factory"] = g["gyre.backends.factory"] + ["gyre.runtime.rundir"]
        assert upward(g) == ["gyre.backends.factory -> gyre.runtime.rundir (backends: layer 3, runtime: layer 6)"]
    else:
        g["gyre.errors"] = g["gyre.errors"] + ["gyre.ids"]  # a lazy import in a function counts too
        g["gyre.ids"] = g["gyre.ids"] + ["gyre.errors"]
        assert ["gyre.errors", "gyre.ids"] in cycles(g)


def results_problems(root: Path) -> list[str]:
    """benchmarks/results/ holds one file per benchmark script, named after it, and no script writes
    there unless asked: no `--out`/`--results` default and no path into results/ outside its docstring."""
    bench = root / "benchmarks"
    scripts = {p.stem: p for p in bench.glob("*.py")}
    bad = [f"benchmarks/results/{p.name}: no benchmarks/{p.stem}.py" for p in sorted((bench / "results").iterdir())
           if p.suffix != ".json" or p.stem not in scripts]
    for name, p in sorted(scripts.items()):
        tree = ast.parse(p.read_text())
        doc = ast.get_docstring(tree) or ""
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value in ("--out", "--results") for a in node.args):
                if any(k.arg == "default" and not (isinstance(k.value, ast.Constant) and k.value.value is None) for k in node.keywords):
                    bad.append(f"benchmarks/{name}.py:{node.lineno}: --out has a default (write only when asked)")
            parts = [c.value for c in ast.iter_child_nodes(node) if isinstance(c, ast.Constant)]  # "benchmarks", "results"
            if isinstance(node, ast.BinOp | ast.Call) and "results" in parts or (
                    isinstance(node, ast.Constant) and str(node.value).startswith("benchmarks/results/") and node.value not in doc):
                bad.append(f"benchmarks/{name}.py:{node.lineno}: a path into benchmarks/results")
    return bad


def test_benchmarks_write_results_only_when_asked_one_file_each(tmp_path):
    root = GYRE.parent
    assert results_problems(root) == []
    # planted: a default --out into the checkout, and a second file for one benchmark
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "x_bench.py").write_text(
        'import argparse\nap = argparse.ArgumentParser()\nap.add_argument("--out", default="benchmarks/results/x_bench.json")\n')
    (tmp_path / "benchmarks" / "results" / "x_bench.json").write_text("{}")
    (tmp_path / "benchmarks" / "results" / "x_bench_again.json").write_text("{}")
    assert results_problems(tmp_path) == ["benchmarks/results/x_bench_again.json: no benchmarks/x_bench_again.py",
                                          "benchmarks/x_bench.py:3: --out has a default (write only when asked)",
                                          "benchmarks/x_bench.py:3: a path into benchmarks/results"]


README_MAX_LINES = 250  # a front page (torchtitan's is 191, nanochat's 230); the depth lives in docs/


def readme_too_long(text: str) -> str | None:
    """Why `text` is not a front page, or None."""
    n = len(text.splitlines())
    return f"README.md is {n} lines, over {README_MAX_LINES}: move the depth to docs/" if n > README_MAX_LINES else None


def docstrings_naming_issues(sources: dict[str, str]) -> list[str]:
    """The modules (name → source) whose module docstring names an issue number ("issue 34"): a
    docstring says what the code does and points at docs/, not at the tracker's history."""
    import re

    return sorted(name for name, src in sources.items()
                  if re.search(r"\bissue \d+", ast.get_docstring(ast.parse(src)) or "", re.IGNORECASE))


def test_the_readme_is_a_front_page_and_docstrings_name_no_issue():
    assert readme_too_long((GYRE.parent / "README.md").read_text()) is None
    assert docstrings_naming_issues({str(p.relative_to(GYRE.parent)): p.read_text() for p in GYRE.rglob("*.py")}) == []
    # planted: one line too many, and an issue number in a module docstring (not in a function's)
    assert readme_too_long("line\n" * 251) and readme_too_long("line\n" * 250) is None
    planted = {"a.py": '"""Fast path (issue 34: 25 ms a call)."""\n',
               "b.py": '"""Fast path."""\n\ndef f():\n    """issue 34"""\n',
               "c.py": '"""Fast path, see Issue 7."""\nimport os\n'}
    assert docstrings_naming_issues(planted) == ["a.py", "c.py"]


def test_the_cycle_rule_counts_a_type_checking_only_back_edge():
    """core imports roles at run time; roles naming core's types under TYPE_CHECKING closes a circle."""
    roles = GYRE / "proxy" / "roles.py"
    planted = roles.read_text() + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gyre.proxy.core import Proxy\n"
    assert "gyre.proxy.roles" in graph()["gyre.proxy.core"]
    g = graph(typing=True)
    g["gyre.proxy.roles"] = imports(roles, typing=True, text=planted)
    assert any({"gyre.proxy.core", "gyre.proxy.roles"} <= set(c) for c in cycles(g))
    g["gyre.proxy.roles"] = imports(roles, text=planted)  # the rule as it was: blind to it
    assert not any({"gyre.proxy.core", "gyre.proxy.roles"} <= set(c) for c in cycles(g))


# Only the assembler sees the whole config: every builder and check takes the sections it reads
# (torchtitan's `Configurable`; gyre/loss/config.py works this way).
WHOLE_CONFIG = {
    "gyre.config", "gyre.run", "gyre.runtime.job",  # the config itself, the entry, the assembler
    "gyre.config_checks",  # its entries (check_job, check_train_config, check_prepared) hand out sections
    "gyre.doctor",  # the doctor's entry (`check`) hands each line its sections
}


def whole_config_users(sources: dict[str, str]) -> set[str]:
    """The modules that import `GyreConfig` (a `TYPE_CHECKING` import too) or annotate with it."""
    out = set()
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
            elif isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
                names = [ast.unparse(node.annotation)]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
                names = [ast.unparse(node.returns)]
            else:
                continue
            if any("GyreConfig" in n for n in names):
                out.add(module)
    return out


def _sources() -> dict[str, str]:
    return {_module(p): p.read_text() for p in GYRE.rglob("*.py")}


def test_only_the_assembler_sees_the_whole_config():
    assert whole_config_users(_sources()) == WHOLE_CONFIG


@pytest.mark.parametrize("planted", ["if TYPE_CHECKING:\n    from gyre.config import GyreConfig\n",
                                     "def build(cfg: 'GyreConfig') -> None: ...\n",
                                     "def view() -> GyreConfig: ...\n"])
def test_the_whole_config_rule_catches_a_planted_use(planted):
    sources = _sources()
    sources["gyre.backends.factory"] += "\n" + planted
    assert whole_config_users(sources) - WHOLE_CONFIG == {"gyre.backends.factory"}

# ----------------------------------------------------------------------------- tests shaped like the package
# A module's tests are at tests/<its path>/test_<module>.py, or the module is named here with the
# test file(s) that cover it: a module tested only through its callers, or by a file about a
# property rather than a module (tests/faults/, tests/security/, tests/contracts/). Keys are paths
# under gyre/; values name test files (each must exist). A new module gets its test at the path.
TESTED_THROUGH = {
    "backends/actors/accounting.py": "tests/backends/actors/test_actor_memory.py",
    "backends/actors/memory.py": "tests/runtime/test_handover.py, tests/backends/actors/test_cpu_actor.py",
    "backends/config.py": "tests/backends/test_build_config_view.py, tests/backends/engines/test_pacing.py",
    "backends/engines/engine_host.py": "tests/runtime/test_engine_sigquit.py, tests/security/test_engine_auth.py",
    "backends/engines/engine_mux.py": "tests/backends/engines/test_engine_http.py",
    "backends/factory.py": "tests/backends/models/test_arch_registry.py, tests/contracts/test_actor_contract.py",
    "backends/memplan/advice.py": "tests/test_memplan.py",
    "backends/models/arch/base.py": "tests/backends/models/test_arch_registry.py",
    "backends/models/arch/checkpointing.py": "tests/backends/actors/test_actor_memory.py",
    "backends/models/arch/llama.py": "tests/backends/engines/test_decoder.py",
    "backends/models/arch/qwen2.py": "tests/backends/engines/test_decoder.py",
    "backends/models/arch/qwen3.py": "tests/backends/engines/test_decoder.py",
    "backends/models/arch/qwen3_moe.py": "tests/backends/engines/test_decoder.py",
    "backends/models/sizes.py": "tests/test_memplan.py",
    "backends/protocols.py": "tests/contracts/test_engine_contract.py, tests/contracts/test_actor_contract.py",
    "backends/transfer/migration_policy.py": "tests/backends/transfer/test_migration.py",
    "backends/transfer/readback.py": "tests/backends/transfer/test_buckets.py",
    "backends/transfer/weights.py": "tests/contracts/test_transport_contract.py, tests/runtime/test_board_retention.py",
    "backoff.py": "tests/runtime/test_control_poll.py",
    "config.py": "tests/test_config_checks.py, tests/test_entrypoint.py",
    "doctor/chat.py": "tests/test_doctor.py",
    "doctor/cluster.py": "tests/test_doctor.py",
    "doctor/node.py": "tests/test_doctor.py",
    "doctor/table.py": "tests/test_doctor.py",
    "doctor/versions.py": "tests/test_doctor.py",
    "errors.py": "tests/runtime/test_engine_sigquit.py, tests/runtime/test_stop.py",
    "executions/config.py": "tests/test_config_checks.py, tests/executions/test_runner.py",
    "executions/eval_sandbox.py": "tests/executions/test_evaluator_sandbox.py",
    "executions/logcap.py": "tests/executions/test_runner_procs.py",
    "executions/procs.py": "tests/executions/test_runner_procs.py",
    "executions/remote.py": "tests/executions/test_runner.py, tests/security/test_sandbox.py",
    "executions/sandbox.py": "tests/security/test_sandbox.py, tests/executions/test_evaluator_sandbox.py",
    "help.py": "tests/test_entrypoint.py",
    "logging_utils.py": "tests/faults/test_config_job.py",
    "loss/_ext.py": "tests/loss/test_extension.py",
    "loss/config.py": "tests/loss/test_asymmetric_eps.py, tests/test_config_checks.py",
    "loss/gspo.py": "tests/loss/test_reference.py, tests/loss/test_invariants.py, tests/loss/test_asymmetric_eps.py",
    "loss/logprobs.py": "tests/loss/test_reference.py",
    "loss/prepass.py": "tests/loss/test_invariants.py",
    "plan.py": "tests/test_memplan.py, tests/sim/test_plan.py",
    "proxy/anthropic_api.py": "tests/proxy/test_formats_sdk.py, tests/proxy/test_sdk.py",
    "proxy/bodies.py": "tests/proxy/test_stalls.py",
    "proxy/config.py": "tests/proxy/test_roles.py, tests/test_config_checks.py",
    "proxy/core.py": "tests/proxy/test_sdk.py, tests/proxy/test_formats_render.py, tests/proxy/test_disconnect_poll.py",
    "proxy/formats/base.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/chatml.py": "tests/proxy/test_formats_parsers.py, tests/proxy/test_formats_sdk.py",
    "proxy/formats/choice.py": "tests/proxy/test_tool_format.py",
    "proxy/formats/hermes_prompt.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/llama31.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/qwen25.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/qwen3.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/qwen35.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/formats/qwen3_coder.py": "tests/proxy/test_formats_render.py, tests/proxy/test_formats_parsers.py",
    "proxy/keys.py": "tests/proxy/test_closed_state.py, tests/proxy/test_roles.py",
    "proxy/limits.py": "tests/proxy/test_errors.py, tests/proxy/test_claude_code_context.py",
    "proxy/responses_api.py": "tests/proxy/test_responses.py, tests/proxy/test_responses_state.py",
    "proxy/responses_store.py": "tests/proxy/test_responses_state.py",
    "proxy/server.py": "tests/proxy/test_stalls.py, tests/proxy/test_sdk.py",
    "proxy/tool_ids.py": "tests/proxy/test_twins.py",
    "proxy/validate.py": "tests/proxy/test_errors.py, tests/proxy/test_media.py",
    "run.py": "tests/backends/test_devices.py, tests/test_entrypoint.py",
    "runtime/controller.py": "tests/runtime/test_controller_reduce.py, tests/runtime/test_controller_shutdown.py",
    "runtime/job.py": "tests/runtime/test_memory_order.py, tests/runtime/test_train_e2e.py",
    "runtime/outputs.py": "tests/runtime/test_metrics.py, tests/runtime/test_tracking.py",
    "runtime/peers.py": "tests/runtime/test_attempts.py",
    "runtime/plane_attach.py": "tests/faults/test_lossless_restart.py",
    "runtime/plane_routes.py": "tests/runtime/test_execution_plane.py",
    "runtime/plane_wire.py": "tests/runtime/test_plane_client.py, tests/runtime/test_execution_plane.py",
    "runtime/proxy_access.py": "tests/executions/test_with_proxy.py, tests/runtime/test_plane_client.py",
    "runtime/runlock.py": "tests/runtime/test_rundir.py, tests/faults/test_run_lock.py",
    "runtime/worker.py": "tests/runtime/test_handover.py, tests/runtime/test_load_queue.py",
    "runtime/writes.py": "tests/runtime/test_stop.py",
    "scheduler/config.py": "tests/scheduler/test_core.py, tests/sim/test_calibrate.py",
    "serving.py": "tests/security/test_engine_auth.py, tests/backends/transfer/test_transfer_host.py",
    "sim/config.py": "tests/sim/test_properties.py, tests/sim/test_theory.py",
    "sim/engine.py": "tests/sim/test_properties.py, tests/sim/test_theory.py, tests/sim/test_timeout.py",
    "sim/profile.py": "tests/sim/test_calibrate.py, tests/sim/test_timeout.py",
    "sim/report.py": "tests/sim/test_calibrate.py",
    "sim/variants.py": "tests/sim/test_table1.py",
    "slurm.py": "tests/test_launch.py",
    "trajectory/advantages.py": "tests/trajectory/test_advantages_packing_materialize.py",
    "trajectory/materialize.py": "tests/trajectory/test_advantages_packing_materialize.py",
    "trajectory/microstep.py": "tests/loss/test_reference.py, tests/trajectory/test_loss_integration.py",
    "trajectory/packing.py": "tests/trajectory/test_advantages_packing_materialize.py, tests/trajectory/test_properties.py",
    "trajectory/record.py": "tests/trajectory/test_tree_selection.py, tests/trajectory/test_store.py",
    "trajectory/selection.py": "tests/trajectory/test_tree_selection.py, tests/trajectory/test_properties.py",
    "trajectory/tree.py": "tests/trajectory/test_tree_selection.py, tests/trajectory/test_properties.py",
}


def untested(gyre: Path, tests: Path, through: dict[str, str]) -> list[str]:
    """What breaks the test-path rule: a module with neither tests/<path>/test_<module>.py nor an
    entry; an entry naming no test file or one that does not exist; an entry for a module that is
    gone or already has its test at the path. Pure (reads the two trees)."""
    out = []
    modules = sorted(p.relative_to(gyre).as_posix() for p in gyre.rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    for m in modules:
        at_path = (tests / m).parent / f"test_{Path(m).name}"
        if at_path.exists() and m in through:
            out.append(f"gyre/{m}: has {at_path.relative_to(tests.parent)}, drop its TESTED_THROUGH entry")
        elif not at_path.exists() and m not in through:
            out.append(f"gyre/{m}: no {at_path.relative_to(tests.parent)} and no TESTED_THROUGH entry")
    for m, files in sorted(through.items()):
        if m not in modules:
            out.append(f"TESTED_THROUGH[{m!r}]: no such module gyre/{m}")
        named = [f.strip() for f in files.split(",")]
        missing = [f for f in named if not f.startswith("tests/") or not (tests.parent / f).is_file()]
        if missing or not named:
            out.append(f"TESTED_THROUGH[{m!r}]: no such test file {missing}")
    return out


def test_every_module_has_its_test_at_its_path_or_names_where_it_is_tested():
    assert untested(GYRE, GYRE.parent / "tests", TESTED_THROUGH) == []


@pytest.mark.parametrize("planted", ["module without a test", "stale file", "gone module", "both"])
def test_the_test_path_rule_catches_a_planted_violation(planted, tmp_path):
    gyre, tests = tmp_path / "gyre", tmp_path / "tests"
    for p in ("gyre/a/b.py", "gyre/a/__init__.py", "gyre/__main__.py", "gyre/c.py", "tests/a/test_b.py",
              "tests/test_x.py"):
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text("")
    through = {"c.py": "tests/test_x.py"}
    assert untested(gyre, tests, through) == []
    if planted == "module without a test":
        (gyre / "a" / "new.py").write_text("")
        assert untested(gyre, tests, through) == ["gyre/a/new.py: no tests/a/test_new.py and no TESTED_THROUGH entry"]
    elif planted == "stale file":
        (tests / "test_x.py").unlink()
        assert untested(gyre, tests, through) == ["TESTED_THROUGH['c.py']: no such test file ['tests/test_x.py']"]
    elif planted == "gone module":
        (gyre / "c.py").unlink()
        assert untested(gyre, tests, through) == ["TESTED_THROUGH['c.py']: no such module gyre/c.py"]
    else:
        (tests / "test_c.py").write_text("")
        assert untested(gyre, tests, through) == ["gyre/c.py: has tests/test_c.py, drop its TESTED_THROUGH entry"]


CONTROLLER_USERS = {"gyre.runtime.controller", "gyre.runtime.job"}  # the class, and the one place that builds it


def controller_importers(sources: dict[str, str]) -> list[str]:
    """The modules (name -> source) that import `gyre.runtime.controller`, wherever the import is,
    `TYPE_CHECKING` included, other than `CONTROLLER_USERS`."""
    out = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if "gyre.runtime.controller" in names and module not in CONTROLLER_USERS:
                out.append(module)
    return sorted(set(out))


def test_only_the_controller_and_its_builder_import_it():
    assert controller_importers({_module(p): p.read_text() for p in GYRE.rglob("*.py")}) == []


def test_the_controller_rule_catches_a_planted_typing_import():
    """The stop's shape before it had its own protocol: a `TYPE_CHECKING` import of `Controller`."""
    sources = {_module(p): p.read_text() for p in GYRE.rglob("*.py")}
    sources["gyre.runtime.stop"] += "\nif TYPE_CHECKING:\n    from gyre.runtime.controller import Controller\n"
    sources["gyre.runtime.summary"] += "\nimport gyre.runtime.controller\n"
    assert controller_importers(sources) == ["gyre.runtime.stop", "gyre.runtime.summary"]


TEST_PATH = r"tests/[\w./*-]*\.py"  # a test file as the docs and docstrings name it (a `*` glob allowed)


def missing_test_paths(texts: dict[str, str], root: Path) -> list[str]:
    """Every `tests/...py` path named in the texts (name -> text: gyre/ sources, docs/*.md, the
    READMEs) that matches no file under `root`: the tests move, the pointers to them must follow."""
    import re

    return sorted(f"{name}: {path}" for name, text in texts.items() for path in set(re.findall(TEST_PATH, text))
                  if not any(root.glob(path)))


def _pointing_texts(root: Path) -> dict[str, str]:
    files = [*(root / "gyre").rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md",
             root / "benchmarks" / "README.md"]
    return {str(p.relative_to(root)): p.read_text() for p in files}


def test_every_test_path_named_in_docs_and_docstrings_exists():
    assert missing_test_paths(_pointing_texts(GYRE.parent), GYRE.parent) == []


def test_the_test_path_pointer_rule_catches_a_moved_test(tmp_path):
    (tmp_path / "tests" / "backends" / "actors").mkdir(parents=True)
    (tmp_path / "tests" / "backends" / "actors" / "test_cpu_actor.py").write_text("")
    texts = {"docs/a.md": "tested in `tests/backends/actors/test_cpu_actor.py` and tests/backends/actors/test_*.py",
             "gyre/b.py": '"""Exact (tests/backends/test_cpu_actor.py)."""\n# see tests/backends/test_gone_*.py\n'}
    assert missing_test_paths(texts, tmp_path) == ["gyre/b.py: tests/backends/test_cpu_actor.py",
                                                  "gyre/b.py: tests/backends/test_gone_*.py"]


DOCSTRING_MAX_LINES = 30
LONG_DOCSTRINGS = {  # module -> why its docstring is longer than one screen
    "gyre/runtime/messages.py": "the whole command protocol between controller and workers, drawn once",
    "gyre/doctor/__init__.py": "printed as `python -m gyre.doctor --help`: the table of every check",
}


def long_docstrings(sources: dict[str, str], allowed: dict[str, str]) -> list[str]:
    """The modules (name -> source) whose module docstring runs over DOCSTRING_MAX_LINES source
    lines and that `allowed` does not name: a module docstring is one screen that points at docs/."""
    out = []
    for name, src in sources.items():
        body = ast.parse(src).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > DOCSTRING_MAX_LINES and name not in allowed:
                out.append(f"{name}: module docstring of {n} lines, over {DOCSTRING_MAX_LINES}: move the depth to docs/")
    return sorted(out)


def test_module_docstrings_are_one_screen():
    assert long_docstrings({str(p.relative_to(GYRE.parent)): p.read_text() for p in GYRE.rglob("*.py")},
                           LONG_DOCSTRINGS) == []
    assert all((GYRE.parent / m).is_file() for m in LONG_DOCSTRINGS)


def test_the_docstring_rule_catches_a_planted_long_one():
    planted = {"a.py": '"""' + "line\n" * 30 + '"""\n',      # 31 lines
               "b.py": '"""' + "line\n" * 29 + '"""\n',      # 30 lines: fine
               "c.py": "x = 1\n" + '"""' + "line\n" * 40 + '"""\n',  # not a module docstring
               "d.py": '"""' + "line\n" * 40 + '"""\n'}      # allowed
    assert long_docstrings(planted, {"d.py": "why"}) == ["a.py: module docstring of 31 lines, over 30: move the depth to docs/"]
