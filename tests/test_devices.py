"""Each rank's device and torch.distributed backend (gyre.run.device_and_backend, bind_device).

With CUDA: the rank's own GPU (LOCAL_RANK) and "cpu:gloo,cuda:nccl", so CPU tensors keep going
over gloo. Checked here on CPU: the pure decision for a CUDA-visible machine, the binding with
torch.cuda monkeypatched, and real gloo ranks on a multi-backend string ("cpu:gloo": a CPU torch
has no NCCL, so "cpu:gloo,cuda:nccl" itself only initialises on a CUDA build) through every code
path that moves CPU tensors over the topology's groups.
"""

from __future__ import annotations

import pytest
import torch

from gyre.config import ConfigError
from gyre.run import bind_device, device_and_backend
from tests.backends.helpers import check_backends_of, engine_of
from tests.distributed import run_ranks

MULTI = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("requested, local_rank, expected", [
    ("auto", 0, (torch.device("cuda", 0), MULTI)),
    ("auto", 7, (torch.device("cuda", 7), MULTI)),
    ("nccl", 3, (torch.device("cuda", 3), MULTI)),  # never plain nccl: CPU tensors cross every group
    ("gloo", 5, (torch.device("cuda", 5), "gloo")),  # the override: gloo for everything, GPU still bound
])
def test_cuda_machine_binds_local_rank_and_splits_backends(requested, local_rank, expected):
    assert device_and_backend(True, 8, local_rank, requested) == expected


@pytest.mark.parametrize("requested", ["auto", "gloo"])
def test_cpu_machine_is_gloo_on_cpu(requested):
    assert device_and_backend(False, 0, 3, requested) == (torch.device("cpu"), "gloo")


def test_refusals_name_the_flag_or_the_launcher_setting():
    with pytest.raises(ConfigError, match="--parallel.backend nccl: CUDA is not available"):
        device_and_backend(False, 0, 0, "nccl")
    with pytest.raises(ConfigError, match="LOCAL_RANK 2: only 2 CUDA devices.*--nproc-per-node"):
        device_and_backend(True, 2, 2, "auto")
    with pytest.raises(ConfigError, match="--parallel.backend 'mpi'"):
        device_and_backend(True, 2, 0, "mpi")


def test_bind_device_sets_the_local_gpu(monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert bind_device("auto") == MULTI
    assert bound == [torch.device("cuda", 2)]


def test_bind_device_on_cpu_binds_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) on a CPU machine"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bind_device("auto") == "gloo"


# ---------------------------------------------------------------------------- the device of a collective
from gyre.backends.devices import device_for_backend  # noqa: E402


@pytest.mark.parametrize("backend, cuda, expected", [
    (MULTI, torch.device("cuda", 3), torch.device("cuda", 3)),  # GPU ranks: parameters and grads over NCCL
    (MULTI, None, torch.device("cpu")),
    ("gloo", torch.device("cuda", 3), torch.device("cpu")),  # the torch transport's own group; --parallel.backend gloo
    ("cpu:gloo", torch.device("cuda", 1), torch.device("cpu")),
    ("nccl", torch.device("cuda", 2), torch.device("cuda", 2)),
])
def test_collective_tensors_ride_the_device_the_group_backend_takes(backend, cuda, expected):
    assert device_for_backend(backend, cuda) == expected


def test_a_cuda_only_group_without_a_gpu_and_an_unknown_backend_are_errors():
    with pytest.raises(RuntimeError, match="'nccl' takes CUDA tensors only"):
        device_for_backend("nccl", None)
    with pytest.raises(ValueError, match="'ucc': unknown"):
        device_for_backend("ucc", torch.device("cuda", 0))


@pytest.mark.parametrize("requested, expected_type", [("auto", "cuda"), ("nccl", "cuda"), ("gloo", "cpu")])
def test_a_cuda_visible_config_sends_weights_and_grads_over_nccl(monkeypatch, requested, expected_type):
    """The chain gyre.run → groups → collectives, with CUDA monkeypatched visible: the backend
    string bind_device picks makes every prefix-group collective use the rank's GPU (NCCL), except
    under the gloo override."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    backend = bind_device(requested)
    device = device_for_backend(backend, torch.device("cuda", 1))
    assert device.type == expected_type and (expected_type == "cpu" or device.index == 1)


def _cpu_tensors_over_multibackend_groups():
    """4 ranks, cell_size 1: init on a multi-backend string, then every code path of gyre that
    moves CPU tensors over the topology's groups."""
    import logging

    import torch.distributed as dist

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.transfer.snapshots import TorchDistTransport
    from gyre.config import ParallelConfig
    from gyre.loss.prepass import allreduce_exec_logratio_sums
    from gyre.run import smoke_check
    from gyre.topology import Topology
    from tests.backends.helpers import tiny_model

    logging.disable(logging.WARNING)
    dist.init_process_group("cpu:gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_config(ParallelConfig(cell_size=1), world, rank)
    groups = topo.create_groups()
    backends = {dist.get_backend(), dist.get_backend(groups.prefix(4)), dist.get_backend(groups.cells[rank])}
    control_is_world = groups.control is dist.group.WORLD
    smoke_check(topo, groups)  # raises on a wrong sum
    g = groups.prefix(4)
    sums = allreduce_exec_logratio_sums(torch.tensor([float(rank)], dtype=torch.float64), g)
    actor = CpuActor(tiny_model(seed=0), is_core=rank == 0)
    for p in actor.model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    actor.reduce_gradients(g)
    grads_ok = all(torch.equal(p.grad, torch.full_like(p, 10.0)) for p in actor.model.parameters())
    params = TorchDistTransport(g, src=0).share(actor.export_parameters() if rank == 0 else None)
    same = all(torch.equal(params[k], v) for k, v in CpuActor(tiny_model(seed=0), is_core=False).export_parameters().items())
    from gyre.backends.devices import collective_device

    # a gloo-only group stays on CPU even where a GPU is visible (here: pretended)
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
    on_cpu = collective_device(g) == torch.device("cpu")
    dist.barrier(group=groups.control)
    dist.destroy_process_group()
    return sorted(backends), control_is_world, float(sums[0]), grads_ok, same and on_cpu


@pytest.mark.multirank
def test_cpu_tensors_cross_groups_of_a_multibackend_default():
    """The default group and every prefix group carry the default's backend string, and the
    smoke check, the loss pre-pass all-reduce, CpuActor.reduce_gradients and TorchDistTransport
    move their CPU tensors over it (on CUDA the same string adds ',cuda:nccl' for CUDA tensors)."""
    out = run_ranks(_cpu_tensors_over_multibackend_groups, 4, init=False, timeout=180)
    assert out == [(["cpu:gloo"], True, 6.0, True, True)] * 4


# ---------------------------------------------------------------------------- setup.py: CUDA build or not
def _setup_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "setup.py"
    spec = importlib.util.spec_from_file_location("gyre_setup_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, runs no setup()
    return module


def test_setup_builds_cuda_only_with_a_cuda_torch_and_a_toolkit():
    plan = _setup_module().cuda_build_plan
    assert plan(True, "13.0", "/usr/local/cuda", {}) is None
    assert plan(True, None, "/usr/local/cuda", {}) == "torch is a CPU build"
    assert plan(True, "13.0", None, {}) == "no CUDA toolkit found (CUDA_HOME)"
    assert plan(True, "13.0", "/usr/local/cuda", {"GYRE_NO_CUDA": "1"}) == "GYRE_NO_CUDA=1"
    assert plan(False, "13.0", "/usr/local/cuda", {}) == "no CUDA sources"


def test_a_failed_cuda_build_falls_back_to_the_cpu_extension_with_a_warning():
    fallback = _setup_module().build_with_fallback
    built, warned = [], []

    def build(exts):
        if "cuda" in exts:
            raise RuntimeError("The detected CUDA version (12.8) mismatches the version that was used to compile PyTorch (13.0)")
        built.append(exts)

    assert fallback(build, ["cuda"], ["cpu"], warned.append) == ["cpu"]
    assert built == [["cpu"]] and "CUDA build of gyre._C failed" in warned[0] and "mismatches" in warned[0]
    assert fallback(build, ["cpu"], None, warned.append) == ["cpu"] and len(warned) == 1  # no failure, no warning
    with pytest.raises(RuntimeError, match="mismatches"):  # a CPU-only build that fails still fails
        fallback(build, ["cuda"], None, warned.append)


def test_setup_pins_the_gpu_stack_and_leaves_torch_to_the_machine():
    import ast
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    module = _setup_module()
    assert module.TORCH == "torch>=2.6"
    gpu = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Dict)
               and any(isinstance(k, ast.Constant) and k.value == "gpu" for k in n.keys))
    extras = ast.literal_eval(gpu)
    assert extras["gpu"] == ["sglang==0.5.23", "megatron-core==0.16.1", "mooncake-transfer-engine-non-cuda==0.3.13.post1"]
    assert "torch==" not in text.split("install_requires", 1)[1].split("]", 1)[0]


# ---------------------------------------------------------------------------- the built-in engine's device
# What CPU can check: the device choice (pure), that the factory hands it to the engine, and that
# the engine's forward creates every tensor on the weights' device. The last runs on "meta"
# (shapes, no data): a tensor made on the CPU by mistake meets a meta one and torch raises. That
# the CUDA kernels give the CPU's numbers is benchmarks/gpu_check.py's job (one GPU).
from gyre.backends.devices import engine_device  # noqa: E402


@pytest.mark.parametrize("requested, cuda, local_rank, expected", [
    ("auto", True, 3, torch.device("cuda", 3)),
    ("auto", False, 3, torch.device("cpu")),
    ("cpu", True, 3, torch.device("cpu")),
    ("cuda", True, 0, torch.device("cuda", 0)),
])
def test_engine_device_choice(requested, cuda, local_rank, expected):
    assert engine_device(requested, cuda, local_rank) == expected


def test_engine_on_cuda_without_cuda_is_refused_naming_the_field(monkeypatch):
    from gyre.backends import factory
    from gyre.config import parse_config

    with pytest.raises(ConfigError, match="--backend.device cuda: CUDA is not available"):
        engine_device("cuda", False, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--backend.device cuda: CUDA is not available"):
        check_backends_of(parse_config(["--backend.device", "cuda"]))
    check_backends_of(parse_config(["--backend.device", "auto"]))


def test_the_forward_creates_every_tensor_on_the_weights_device():
    """decoder.extend on meta weights: prefill of two requests (causal masks), then a decode
    step that grows a cache; any tensor made on CPU would raise on meeting a meta one."""
    from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
    from tests.backends.helpers import tiny_model

    model = tiny_model(seed=0)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config, device="meta")
    assert {t.device.type for t in w.tensors.values()} == {"meta"} and w.inv_freq.device.type == "meta"
    caches = [KVCache.empty(w, 2), KVCache.empty(w, 2)]
    logits = extend(w, torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), [3, 2], caches)
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, model.config.vocab_size)
    logits = extend(w, torch.tensor([6, 7]), torch.tensor([3, 2]), [1, 1], caches)  # grows cache 0 past 2
    assert logits.device.type == "meta" and caches[0].capacity >= 4
    assert {t.device.type for c in caches for t in c.k + c.v} == {"meta"}
    # and on CPU the same forward gives the HF model's logits (the device move is no copy there)
    wc = DecoderWeights.from_state_dict(model.state_dict(), model.config, device="cpu")
    ids = torch.tensor([1, 2, 3])
    got = extend(wc, ids, torch.arange(3), [3], [KVCache.empty(wc, 3)], all_logits=True)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert torch.allclose(got, ref, atol=1e-4)


def test_the_factory_builds_the_engine_on_the_chosen_device(monkeypatch):
    from gyre.backends import devices
    from gyre.config import parse_config
    from tests.backends.helpers import tiny_model

    model = tiny_model(seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA-visible rank 1 ...
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.this_engine_device("auto") == torch.device("cuda", 1)
    chosen = []

    def on_meta(requested):  # ... whose GPU is stood in for by meta
        chosen.append(requested)
        return torch.device("meta")

    monkeypatch.setattr(devices, "this_engine_device", on_meta)
    engine = engine_of(parse_config(["--backend.device", "cuda"]), model.config, model.state_dict(),
                       version=0, eos_token_ids=[1], name="e")
    assert chosen == ["cuda"] and engine.device.type == "meta" and engine._weights.device.type == "meta"


def test_the_torch_transport_refuses_a_point_to_point_group_without_gloo(monkeypatch):
    import torch.distributed as dist

    from gyre.backends.transfer.weights import TorchWeights

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="must be a gloo group"):
        TorchWeights(None, object(), owner=0)


def test_decoder_weights_move_between_devices_unchanged():
    from gyre.backends.engines.decoder import DecoderWeights
    from tests.backends.helpers import tiny_model

    model = tiny_model(seed=0)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    meta = w.to("meta")
    assert meta.device.type == "meta" and meta.inv_freq.device.type == "meta" and w.device.type == "cpu"
    back = w.to("cpu")
    assert back.tensors.keys() == w.tensors.keys() and all(torch.equal(back.tensors[k], t) for k, t in w.tensors.items())
    assert (back.num_layers, back.head_dim, back.tied) == (w.num_layers, w.head_dim, w.tied)
