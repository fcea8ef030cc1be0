"""The wheels the device check carries (benchmarks/gpu_check.py): the pinned set, its committed
record (gpu_check_wheels.json) and the checks on both. The box has no network: what gyre's runtime
and the tests import beyond the box's image travels as these wheels (< 64 MiB in all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
WHEEL_CAP_MIB = 64
MANIFEST = ROOT / "benchmarks" / "gpu_check_wheels.json"  # what --fetch-wheels got: file, bytes, sha256
# Everything gyre's runtime (install_requires), the run's harness (openai), the role-timeline plot
# (matplotlib), the Megatron actor and pytest import that the box lacks or may lack. Pinned: the
# versions the CPU path is tested with here; all pure Python or cp312 manylinux wheels.
WHEELS = [
    "megatron-core==0.16.1",
    "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1", "typing-extensions==4.16.0",
    "ninja==1.13.2",
    "openai==3.57.0", "anyio==4.16.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "h11==0.16.0",
    "idna==3.20", "sniffio==1.3.1", "jiter==0.19.0", "pydantic==2.13.4", "pydantic-core==2.46.4",
    "annotated-types==0.7.0", "typing-inspection==0.4.2", "distro==1.9.0",
    "matplotlib==3.11.2", "contourpy==1.3.3", "cycler==0.12.1", "fonttools==4.68.0", "kiwisolver==1.5.1",
    "pillow==13.0.0", "pyparsing==3.3.2", "python-dateutil==2.9.0.post0", "six==1.17.0", "packaging==26.2",
    "pytest==9.0.3", "pluggy==1.6.0", "iniconfig==2.3.0", "pygments==2.20.0", "pytest-timeout==2.4.0",
]


def wheel_name(spec: str) -> str:
    """'pydantic-core==2.46.4' → 'pydantic_core' (the name a wheel file starts with)."""
    return spec.split("==")[0].replace("-", "_").lower()


def check_wheels(directory: Path, specs: list[str], cap_mib: float = WHEEL_CAP_MIB) -> tuple[list[str], dict]:
    """Problems with the carried wheel set (empty: fine) and its figures: every spec has exactly
    one matching wheel in `directory`, and their total size is under `cap_mib`."""
    problems, files = [], {}
    present = sorted(directory.glob("*.whl")) if directory.is_dir() else []
    if not directory.is_dir():
        return [f"{directory}: no such directory (run --fetch-wheels {directory} on a machine with network)"], {}
    for spec in specs:
        name, version = wheel_name(spec), spec.split("==")[1]
        match = [p for p in present if p.name.lower().startswith(f"{name}-{version}-")]
        if len(match) != 1:
            problems.append(f"{spec}: {len(match)} wheels in {directory}")
        else:
            files[spec] = match[0]
    total = sum(p.stat().st_size for p in files.values()) / MiB
    if total >= cap_mib:
        problems.append(f"the wheels total {total:.1f} MiB, over the {cap_mib} MiB a device run can carry")
    return problems, {"wheels": len(files), "total_mib": round(total, 2), "cap_mib": cap_mib}


def check_manifest(manifest: Path, specs: list[str], cap_mib: float = WHEEL_CAP_MIB) -> tuple[list[str], dict]:
    """Problems with the committed record of the fetched wheels (`MANIFEST`, written by
    --fetch-wheels): every spec recorded, total under the cap. Checkable without the wheels."""
    if not manifest.exists():
        return [f"{manifest}: missing (run --fetch-wheels)"], {}
    rec = json.loads(manifest.read_text())
    problems = [f"{spec}: not in {manifest.name} (fetch again)" for spec in specs if spec not in rec]
    total = sum(rec[s]["bytes"] for s in specs if s in rec) / MiB
    if total >= cap_mib:
        problems.append(f"the wheels total {total:.1f} MiB, over the {cap_mib} MiB a device run can carry")
    return problems, {"wheels": sum(s in rec for s in specs), "total_mib": round(total, 2), "cap_mib": cap_mib}


def fetch_wheels(directory: Path) -> int:
    """pip download every pinned wheel for CPython 3.12 (no dependencies: `WHEELS` is the closure),
    then record file, size and sha256 of each in `MANIFEST`."""
    import hashlib

    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--python-version", "3.12", "--only-binary", ":all:",
           "--no-deps", "-d", str(directory), *WHEELS]
    rc = subprocess.call(cmd)
    problems, figures = check_wheels(directory, WHEELS)
    if not problems:
        rec = {}
        for spec in WHEELS:
            f = next(p for p in directory.glob("*.whl") if p.name.lower().startswith(f"{wheel_name(spec)}-{spec.split('==')[1]}-"))
            rec[spec] = {"file": f.name, "bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        MANIFEST.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"problems": problems, **figures}))
    return rc or (1 if problems else 0)


def _older(have: str, pin: str) -> bool:
    """Is installed version `have` older than `pin`? ('4.10.0' < '4.16.0'; unparsable: no)."""
    try:
        from packaging.version import Version

        return Version(have) < Version(pin)
    except Exception:  # noqa: BLE001 — a version we cannot read is left alone
        return False
