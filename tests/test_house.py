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
    "gyre.runtime.controller", "gyre.runtime.proxy_access",  # the run on rank 0; the data plane (proxy work)
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
