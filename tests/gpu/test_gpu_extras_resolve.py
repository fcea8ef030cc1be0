"""`pip install -e '.[gpu,test]'` (docs/gpu-sglang.md) must resolve without backtracking: no
requirement reachable from setup.py's base, `gpu` and `test` requirements may exclude a version
that sglang pins with `==` (issue 30 item 7: `openai-agents` needs openai>=3 and mini-swe-agent's
litellm openai>=2.20, while sglang 0.5.23 pins openai==2.8.0; pip then walks back through old
releases of both).

Checked offline against `gpu_extras_metadata.json`, recorded where there is network:
  * sglang 0.5.23's own Requires-Dist lines (from its wheel's METADATA; the `==` pins come from them);
  * the newest releases pip picks for setup.py's requirements (what it tries first, before any
    backtracking) and their Requires-Dist, evaluated for CPython 3.12 on linux x86_64, kept where
    they name another recorded package or a package sglang pins.
Re-record after changing the extras (the test says so when a requirement is not recorded):

    pip download --no-deps sglang==0.5.23 -d /tmp/sgwheel
    pip install --dry-run --ignore-installed --target /tmp/t --python-version 3.12 --only-binary :all: \\
        --report /tmp/closure.json -r <setup.py's base + test + gpu requirements, sglang left out, one a line>
    python tests/gpu/test_gpu_extras_resolve.py --record /tmp/sgwheel/sglang-0.5.23-*.whl /tmp/closure.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.setup_py import setup_kwargs

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("gpu_extras_metadata.json")
# The GPU box the extras are for (docs/gpu-sglang.md): markers are evaluated here.
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _applies(req: Requirement, extras: tuple[str, ...] = ("",)) -> bool:
    return req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in extras)


def sglang_pins(requires_dist: list[str]) -> dict[str, str]:
    """name → version of every `name==version` requirement (markers true on the GPU box)."""
    pins = {}
    for line in requires_dist:
        req = Requirement(line)
        spec = list(req.specifier)
        if _applies(req) and len(spec) == 1 and spec[0].operator == "==":
            pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def conflicts(roots: list[str], closure: dict, pins: dict[str, str]) -> tuple[list[str], list[str]]:
    """Walk from `roots` through the recorded closure; (requirements that exclude an sglang pin,
    each with the path that reaches it; roots the fixture cannot answer for)."""
    bad, stale, seen = [], [], set()
    todo = [(Requirement(r), "setup.py") for r in roots]
    while todo:
        req, via = todo.pop()
        name = canonicalize_name(req.name)
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            bad.append(f"{via} -> {req} excludes sglang's {name}=={pins[name]}")
        if via == "setup.py" and name != "sglang":
            rec = closure.get(name)
            if rec is None:
                stale.append(f"{req}: not recorded (re-record {FIXTURE.name})")
            elif not req.specifier.contains(rec["version"], prereleases=True):
                stale.append(f"{req}: recorded {rec['version']} is not allowed (re-record {FIXTURE.name})")
        if name in seen or name not in closure:
            continue
        seen.add(name)
        todo += [(Requirement(r), f"{via} -> {name} {closure[name]['version']}") for r in closure[name]["requires"]]
    return sorted(bad), stale


@pytest.fixture(scope="module")
def recorded():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def extras():
    kw = setup_kwargs()
    return kw["install_requires"], kw["extras_require"]


def test_the_fixture_holds_sglangs_own_openai_pin(recorded, extras):
    """The pins are read from sglang's METADATA as recorded (openai==2.8.0, torch==2.14.1, per the
    audit's reading of the same wheel), and the sglang recorded is the one `[gpu]` installs."""
    pins = sglang_pins(recorded["sglang"]["requires_dist"])
    assert pins["openai"] == "2.8.0" and pins["torch"] == "2.14.1" and pins["transformers"] == "5.19.0"
    gpu = [Requirement(r) for r in extras[1]["gpu"]]
    assert [str(r.specifier) for r in gpu if r.name == "sglang"] == [f"=={recorded['sglang']['version']}"]


def test_gpu_and_test_extras_resolve_next_to_sglangs_pins(recorded, extras):
    install_requires, ex = extras
    pins = sglang_pins(recorded["sglang"]["requires_dist"])
    bad, stale = conflicts(install_requires + ex["gpu"] + ex["test"], recorded["closure"], pins)
    assert stale == [], stale
    assert bad == [], "\n".join(bad)


def test_the_walk_finds_the_openai_conflicts_of_the_agent_clients(recorded, extras):
    """Not vacuous: the agent clients, kept out of `test` for this reason, do conflict (openai-agents
    0.24 wants openai>=3; mini-swe-agent's litellm 1.110 wants openai>=2.20)."""
    install_requires, ex = extras
    pins = sglang_pins(recorded["sglang"]["requires_dist"])
    bad, _ = conflicts(["openai-agents", "mini-swe-agent"], recorded["closure"], pins)
    assert any("openai-agents" in b and "openai<4,>=3" in b for b in bad), bad
    assert any("litellm" in b and "openai" in b for b in bad), bad
    agents = ex.get("agents", [])
    assert {canonicalize_name(Requirement(r).name) for r in agents} >= {"openai-agents", "mini-swe-agent"}, agents


# ---------------------------------------------------------------------------- recording (network)
def record(sglang_wheel: Path, report: Path) -> dict:
    import hashlib
    import zipfile

    with zipfile.ZipFile(sglang_wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    lines = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    version = next(ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Version:"))
    sglang_rd = [ln for ln in lines if "extra ==" not in ln]
    pins = sglang_pins(sglang_rd)
    rep = json.loads(report.read_text())
    items = {canonicalize_name(i["metadata"]["name"]): i for i in rep["install"]}
    closure = {}
    for name, item in sorted(items.items()):
        md, asked = item["metadata"], tuple(item.get("requested_extras") or ("",))
        keep = []
        for line in md.get("requires_dist") or []:
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if _applies(req, asked) and (dep in items or dep in pins):
                req.marker = None
                keep.append(str(req))
        closure[name] = {"version": md["version"], "requires": sorted(set(keep))}
    return {"source": {"sglang_wheel": sglang_wheel.name,
                       "sglang_wheel_sha256": hashlib.sha256(sglang_wheel.read_bytes()).hexdigest(),
                       "sglang_requires_dist": "its METADATA's Requires-Dist lines without `extra ==` markers",
                       "closure": "pip install --dry-run --ignore-installed --python-version 3.12 --only-binary :all: "
                                  "--report (setup.py's base + test + gpu requirements, sglang left out); each "
                                  "package's Requires-Dist evaluated for CPython 3.12 linux x86_64, kept where it "
                                  "names a package of the closure or one sglang pins",
                       "pip_version": rep.get("pip_version"), "target_env": TARGET_ENV},
            "sglang": {"version": version, "requires_dist": sglang_rd}, "closure": closure}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--record":
        sys.exit(f"usage: {sys.argv[0]} --record SGLANG_WHEEL PIP_REPORT_JSON")
    rec = record(Path(sys.argv[2]), Path(sys.argv[3]))
    rec["source"]["recorded"] = __import__("datetime").date.today().isoformat()
    FIXTURE.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {FIXTURE}: {len(rec['closure'])} packages, sglang {rec['sglang']['version']}")
