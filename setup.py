"""Gyre: elastic online RL for long-horizon LLM agents.

Install (CPU):   pip install torch==2.13.0 && pip install --no-build-isolation -e .
Extras:          .[test] for the test suite, .[gpu] for SGLang / Megatron-core / Mooncake,
                 .[tracking] for TensorBoard and Weights & Biases (--tracking.*).

The C++ extension `gyre._C` (gyre/csrc/*.cpp, plus gyre/csrc/cuda/*.cu where a CUDA torch is
present) is built when torch is importable at build time. `--no-build-isolation` matters: with
isolation pip would build against a fresh torch from the index, which is a multi-GB CUDA wheel.
If the build is unavailable, gyre.loss falls back to the pure-torch reference with a warning.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


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
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    kwargs = dict(extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])
    if use_cuda:
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++20", "-DGYRE_WITH_CUDA"]
        kwargs["define_macros"] = [("GYRE_WITH_CUDA", "1")]
        ext = cpp_extension.CUDAExtension("gyre._C", sources + cuda_sources, **kwargs)
    else:
        ext = cpp_extension.CppExtension("gyre._C", sources, **kwargs)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_modules()

# The CPU install path pins torch to the wheel these machines carry (shared/DEPS-NOTES.md):
# a bare `torch` requirement would pull a CUDA build of several GB.
TORCH = "torch==2.13.0"

setup(
    name="gyre",
    version="0.1.0",
    description="Elastic online RL for extra-long-horizon LLM agents (QwenGyre)",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["gyre", "gyre.*"]),
    package_data={"gyre": ["csrc/*.cpp", "csrc/*.h", "csrc/cuda/*.cu", "assets/*", "assets/**/*"]},
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
            "pytest>=8",
            "pytest-timeout",
            "hypothesis>=6",
            "anthropic>=0.40",
            "mini-swe-agent",
            # Mooncake over TCP (the snapshot transport test; it also needs Debian's libibverbs1
            # and `unshare --net`, and skips with the reason where either is missing).
            "mooncake-transfer-engine-non-cuda",
            # The tracking tests read TensorBoard's event files and wandb's offline run back.
            "tensorboard",
            "wandb",
            # One tool-using Agent run against /v1/responses (tests/proxy/test_responses.py).
            "openai-agents",
        ],
        # Experiment trackers beside metrics.jsonl: --tracking.tensorboard, --tracking.wandb.
        "tracking": ["tensorboard", "wandb"],
        # GPU backends. Installed on GPU machines only; never imported by the CPU path.
        "gpu": [
            "sglang",
            "megatron-core",
            "mooncake-transfer-engine",
        ],
        # The mini-swe-agent example's harness (examples/mini_swe_agent).
        "mini-swe-agent": ["mini-swe-agent"],
        # Mooncake over TCP on machines without CUDA (same `mooncake` module).
        "mooncake-cpu": ["mooncake-transfer-engine-non-cuda"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["gyre-sim=gyre.sim.__main__:main"]},
)
