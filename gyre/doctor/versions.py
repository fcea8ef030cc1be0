"""The doctor's version lines: what is installed against what Gyre supports.

The supported versions are read from one place, the requirements of setup.py (`install_requires`
and `extras_require`): from the checkout's setup.py when Gyre runs from one (that file is then
the truth, even before a re-install), else from the installed distribution's metadata, which pip
wrote from the same setup.py. Nothing here repeats a pin.

    reqs = gyre_requirements()                         # {"sglang": ("==0.5.23", "gpu"), ...}
    lines = version_lines(cfg.backend, cfg.transfer, cfg.proxy, reqs, cuda=torch.cuda.is_available())
"""

from __future__ import annotations

import ast
import importlib.metadata as md
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.doctor.table import FAIL, OK, WARN, Line, skipped

if TYPE_CHECKING:
    from gyre.backends.config import BackendConfig, TransferConfig
    from gyre.proxy.config import ProxyConfig

SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"  # beside the package in a checkout


def _literal(node: ast.AST, names: dict[str, Any]) -> Any:
    """A literal of setup.py, where a bare name is one of its module-level string constants
    (`TORCH = "torch>=2.6"`)."""
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.List):
        return [_literal(e, names) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k, names): _literal(v, names) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def requirements_of_setup(source: str) -> list[tuple[str, str]]:
    """(requirement, extra) pairs of a setup.py's `setup(install_requires=..., extras_require=...)`
    call ('' for install_requires), read with `ast` (setup.py is never run)."""
    tree = ast.parse(source)
    names = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            kw = {k.arg: k.value for k in node.keywords}
            out = [(r, "") for r in _literal(kw["install_requires"], names)] if "install_requires" in kw else []
            for extra, reqs in (_literal(kw["extras_require"], names) if "extras_require" in kw else {}).items():
                out += [(r, extra) for r in reqs]
            return out
    raise ValueError("setup.py: no setup(...) call")


def requirements_of_metadata(requires: list[str] | None = None) -> list[tuple[str, str]]:
    """The same pairs from the installed distribution's metadata (`Requires-Dist` lines;
    default: gyre's)."""
    from packaging.requirements import Requirement

    out = []
    for text in md.requires("gyre") or [] if requires is None else requires:
        req = Requirement(text)
        extra = ""
        if req.marker is not None:
            extra = next((e for e in _extras_in(str(req.marker))), "")
        out.append((f"{req.name}{req.specifier}", extra))
    return out


def _extras_in(marker: str) -> list[str]:
    # 'extra == "gpu"' → ["gpu"]
    return [part.split("==", 1)[1].strip().strip("\"'") for part in marker.split(" and ")
            if "extra" in part and "==" in part]


def gyre_requirements(setup_py: Path = SETUP_PY) -> dict[str, tuple[str, str]]:
    """{normalized distribution name: (specifier, where)} of every Gyre requirement. A package
    named in several places keeps the core install's, else the `gpu` extra's, else the first
    extra's (e.g. megatron-core: 'gpu', though 'test' pins it too)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pairs = requirements_of_setup(setup_py.read_text()) if setup_py.is_file() else requirements_of_metadata()
    rank = {"": 0, "gpu": 1}
    out: dict[str, tuple[str, str, int]] = {}
    for text, extra in pairs:
        req = Requirement(text)
        name, r = canonicalize_name(req.name), rank.get(extra, 2)
        if name not in out or r < out[name][2]:
            out[name] = (str(req.specifier), "install_requires" if not extra else f"extra '{extra}'", r)
    return {k: (spec, where) for k, (spec, where, _) in out.items()}


def installed(*dists: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of `dists` that is installed, else None."""
    for d in dists:
        try:
            return d, md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def judge(label: str, found: tuple[str, str] | None, pin: tuple[str, str] | None, *, needed_by: str,
          install: str, pin_name: str = "") -> Line:
    """The line of one package: installed and inside the pin (ok); outside it (fail when the
    chosen backends use it, else warn); missing (fail when they use it, else skipped).
    `needed_by`: the flag that makes the package necessary ('' when nothing chosen needs it);
    `pin_name`: the requirement's name in setup.py when it is not `label`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    wants = f"setup.py {pin[1]}: {pin_name or label}{pin[0]}" if pin and pin[0] else "not pinned by setup.py"
    if found is None:
        if needed_by:
            return Line(label, FAIL, f"not installed; {needed_by} needs it ({wants})", _pip(install, pin))
        return skipped(label, f"not installed (nothing chosen needs it; {wants})")
    dist, version = found
    what = f"{version}" + (f" ({dist})" if dist.replace("_", "-") != label else "")
    if not pin or not pin[0]:
        return Line(label, OK, f"{what}; {wants}")
    try:
        inside = Version(version) in SpecifierSet(pin[0])
    except InvalidVersion:
        inside = False
    if inside:
        return Line(label, OK, f"{what}; {wants}")
    return Line(label, FAIL if needed_by else WARN,
                f"{what} is outside {wants}" + (f"; {needed_by} uses it" if needed_by else ""),
                _pip(install, pin))


def _pip(install: str, pin: tuple[str, str] | None) -> str:
    extra = pin[1].removeprefix("extra ").strip("'") if pin and pin[1].startswith("extra ") else ""
    return f"pip install '{install}'" + (f" (every pin of the extra: pip install --no-build-isolation -e '.[{extra}]')"
                                         if extra else "")


def version_lines(backend: BackendConfig, transfer: TransferConfig, proxy: ProxyConfig, reqs: dict[str, tuple[str, str]],
                  *, cuda: bool) -> list[Line]:
    """torch, CUDA, NCCL, sglang, megatron-core, mooncake, transformer-engine."""
    import torch

    def pin(name: str) -> tuple[str, str] | None:
        return reqs.get(name)

    def spec(name: str) -> str:
        return f"{name}{reqs[name][0]}" if name in reqs else name

    b, t = backend, transfer
    mooncake_by = ("--transfer.transport mooncake" if t.transport == "mooncake" else
                   "--proxy.migration-transport mooncake" if proxy.migration_transport == "mooncake" else "")
    lines = [judge("torch", installed("torch"), pin("torch"), needed_by="gyre", install=spec("torch"))]
    if torch.version.cuda is None:
        lines.append(skipped("cuda", "no CUDA (torch is a CPU build)"))
    elif not cuda:
        lines.append(skipped("cuda", f"no CUDA (torch built for CUDA {torch.version.cuda}, no GPU visible)"))
    else:
        lines.append(Line("cuda", OK, f"torch built for CUDA {torch.version.cuda}"))
    if cuda:
        nccl = torch.cuda.nccl.version()
        lines.append(Line("nccl", OK, ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    else:
        lines.append(skipped("nccl", "no CUDA"))
    lines.append(judge("sglang", installed("sglang"), pin("sglang"),
                       needed_by="--backend.engine sglang" if b.engine == "sglang" else "", install=spec("sglang")))
    lines.append(judge("megatron-core", installed("megatron-core"), pin("megatron-core"),
                       needed_by="--backend.actor megatron" if b.actor == "megatron" else "",
                       install=spec("megatron-core")))
    mooncake_pin = next((n for n in reqs if n.startswith("mooncake-transfer-engine")), "mooncake-transfer-engine")
    lines.append(judge("mooncake", installed("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
                       pin(mooncake_pin), needed_by=mooncake_by, install=spec(mooncake_pin), pin_name=mooncake_pin))
    te = installed("transformer-engine", "transformer_engine", "transformer-engine-torch")
    if te is None and b.actor == "megatron":
        lines.append(Line("transformer-engine", WARN, "not installed: the Megatron actor builds its local layer spec "
                          "(no fused kernels) and refuses --parallel.pp > 1",
                          "pip install --no-build-isolation transformer-engine[pytorch] (matching the CUDA of torch)"))
    else:
        lines.append(judge("transformer-engine", te, pin("transformer-engine"), needed_by="",
                           install="transformer-engine"))
    return lines
