"""The core's side of SGLang's weight-update group (`SglangEngine.init_weights_update_group`,
then `update_weights_from_distributed`): rank 0 of a process group of its own, laid out in the
store exactly as sglang 0.5.23's `init_custom_process_group` lays out the engine ranks, so the two
sides wait on the same keys (tests/backends/engines/test_weight_group.py meets SGLang's own function)."""

from __future__ import annotations

from datetime import timedelta

import torch


class WeightBroadcaster:
    """The core's side of `SglangEngine.init_weights_update_group`: rank 0 of a process group of
    its own, laid out in the store as SGLang's `init_custom_process_group` lays out the engine
    ranks (utils/common.py:2859-2927; `connect`), then one `broadcast(src=0)` per tensor in the
    order of `names` (model_runner_components/weight_updater.py:260-298).

    The group is a ProcessGroup object of its own, never registered with torch.distributed's
    world, so it cannot collide with Gyre's groups. `__init__` hosts the rendezvous store
    (master_port 0: a free port, then `port`); `connect()` blocks until every engine rank joined
    (the engines call `init_weights_update_group` at the same time)."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *, group_name: str = "gyre_weights",
                 backend: str = "nccl", timeout_s: float = 600.0):
        import torch.distributed as dist

        if backend not in ("nccl", "gloo"):
            raise ValueError(f"WeightBroadcaster: backend must be 'nccl' or 'gloo', got {backend!r}")
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)
        self.port = self.store.port
        self.world_size, self.group_name, self.backend = world_size, group_name, backend
        self.group = None

    def connect(self) -> None:
        """Build rank 0 so both sides wait on the same keys. SGLang's side (rank_offset + tp_rank,
        weight_updater.py:124-139) wraps its tcp:// rendezvous store in PrefixStore(group_name)
        (common.py:2905) and hands it to torch's `_new_process_group_helper`, which adds
        PrefixStore(f"{group_name}/") and PrefixStore(f"{device}/") (torch 2.13 distributed_c10d.py:
        2060, 2101; device: the backend's first, cuda for nccl, cpu for gloo) and builds the
        backend with the options below (:2163-2209, 2261-2306). Not through that helper here: it
        registers the name in this process's world (a second connect, or a Gyre group so named,
        is refused) and, when Gyre's default group is bound to a device, splits the NCCL
        communicator from it, a collective of Gyre's ranks rather than this group's."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        device = next(iter(c10d.BackendConfig(c10d.Backend(self.backend)).get_device_backend_map()))
        store = dist.PrefixStore(self.group_name, self.store)
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{self.group_name}/", store))
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(store, 0, self.world_size, self.timeout)
            group.options.global_ranks_in_group, group.options.group_name = [], self.group_name
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream, opts._timeout = False, self.timeout
            opts.global_ranks_in_group, opts.group_name = [], self.group_name
            group = dist.ProcessGroupNCCL(store, 0, self.world_size, opts)
        group._set_sequence_number_for_group()
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:  # SGLang's side wraps too, with a gloo helper group
            group = c10d._create_process_group_wrapper(group, self.group_name, store, 0, self.world_size, self.timeout)
        self.group = group

    @staticmethod
    def describe(params: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
        """(names, dtypes, shapes) for `SglangEngine.update_weights_from_distributed`."""
        names = list(params)
        return names, [str(params[n].dtype).removeprefix("torch.") for n in names], [list(params[n].shape) for n in names]

    def send(self, params: dict[str, torch.Tensor]) -> None:
        """Broadcast every tensor from rank 0 (blocks until every receiver got it). One broadcast
        per tensor, so this side holds one staged tensor at a time, and the engine side may ask
        for them in any number of bucket-sized `update_weights_from_distributed` calls
        (`SglangEngine.update_weights_from_distributed`, --transfer.bucket-mb) without the two
        sides agreeing on bucket boundaries."""
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("WeightBroadcaster.send: connect() first")
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for name, tensor in params.items():
            self.group.broadcast([tensor.detach().to(device).contiguous()], opts).wait()
