"""The processes, the layout and the collectives every lightning_par strategy shares.

`Processes`, a component the Trainer's and Fabric's strategies each hold: start or join the processes, resolve the
layout once they exist (`lightning_par.config.ParallelConfig.resolve`, called once) and build the mesh, split the
data over the data-parallel ranks only. `ProcessGroupStrategy`, the Trainer's base for both ZeRO backends (native
and DeepSpeed), answers Lightning's hooks with it and reduces logged values and torchmetrics over the data-parallel
ranks only. Neither knows how the model is parallelized.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_par import _compat
from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh, build_mesh
from lightning_par.streams.counted import agree_on_the_end
from lightning_par.streams.split import split_over_data_parallel


class Processes:
    """The job's processes and layout, a component of the Trainer's and Fabric's strategies: the requested then
    resolved configuration, the collective timeout and backend, the mesh, and what splits data over data-parallel
    ranks. It holds its own state; the strategy hands it what Lightning knows (cluster environment, devices,
    trainer) when it calls.

    Args:
        config: the requested layout, validated; resolved against the world size by `join`.
        timeout: collective timeout.
        backend: ``"gloo"`` / ``"nccl"``, or ``None`` for the device's default.
    """

    def __init__(self, config: ParallelConfig, timeout: timedelta, backend: Optional[str]) -> None:
        self.config, self.timeout, self.backend = config, timeout, backend
        self.mesh: Optional[ParallelMesh] = None
        # A training stream whose ranks' shards may end at different steps (`streams.counted`).
        self.agree_end = False

    @property
    def meshes(self) -> ParallelMesh:
        """The job's meshes: the root mesh, the flattened ``dp`` axis and the 2-D data-parallel mesh."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists only after the processes have started (setup_environment)")
        return self.mesh

    def join(self, environment: ClusterEnvironment, device: torch.device, devices_per_node: int) -> None:
        """Join the process group, resolve the layout and build the mesh (the strategy's ``setup_environment``)."""
        reset_seed()
        self.backend, self.config, self.mesh = join_processes(
            environment, device, self.backend, self.timeout, self.config, devices_per_node
        )

    def relayout(self, config: ParallelConfig, device_type: str) -> None:
        """Replace the resolved layout, once processes exist (``strategy="auto"`` after it chose one)."""
        self.config, self.mesh = config, build_mesh(config, device_type)

    def layout(self, world_size: int, num_nodes: int) -> dict[str, Any]:
        """The resolved layout, for logs and the logger's config."""
        return {"world_size": world_size, "num_nodes": num_nodes, **self.config.layout()}

    def sampler_kwargs(self) -> dict[str, Any]:
        """A DistributedSampler over the data-parallel ranks only: tensor, context and pipeline ranks of one replica
        see the same batch."""
        dp = self.meshes.dp
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def split_loader(self, dataloader: Any, trainer: Optional[Any]) -> None:
        """Split a loader over an iterable dataset over the data-parallel ranks only
        (`lightning_par.streams.dataset`), and under ``global_batch`` set the trainer's accumulation."""
        dp = self.meshes.dp
        epoch = (lambda: trainer.current_epoch) if trainer is not None else None
        training = trainer is not None and trainer.training
        # A training loader may be read shard by shard with the end of a pass agreed each step (`end_pass`).
        stream = split_over_data_parallel(dataloader, dp.get_local_rank(), dp.size(), epoch,
                                          dp.get_group() if training else None)  # fmt: skip
        if trainer is not None and training:
            self.agree_end = getattr(stream, "agree_on_the_end", False)
            if self.config.global_batch is not None:
                trainer.accumulate_grad_batches = accumulation_for(self.config.global_batch, dataloader, dp.size())

    def end_pass(self, trainer: Any, device: torch.device) -> None:
        """For a training stream whose ranks' shards end at different steps: end the pass on every data-parallel
        rank after the step in which the first of them read its last batch."""
        if self.agree_end and trainer is not None and trainer.training:
            progress = trainer.fit_loop.epoch_loop.batch_progress
            if agree_on_the_end(progress.is_last_batch, self.meshes.dp.get_group(), device):
                progress.is_last_batch = True


def set_world_ranks(environment: Optional[ClusterEnvironment], node_rank: int, local_rank: int, per_node: int,
                    num_nodes: int, global_rank: int) -> None:  # fmt: skip
    """Tell the cluster environment this process's rank and the world size, as Lightning's DDP strategies do."""
    if environment is not None:
        environment.set_global_rank(node_rank * per_node + local_rank)
        environment.set_world_size(num_nodes * per_node)
    rank_zero_only.rank = global_rank  # type: ignore[attr-defined]


class ProcessView:
    """The properties both strategies (the Trainer's, `ProcessGroupStrategy`, and Fabric's) answer from their
    `Processes` component and Lightning's own strategy attributes; it holds no state of its own. Put it before
    Lightning's base class, whose abstract ``root_device`` it answers."""

    processes: Processes  # the host's component, made in its __init__
    if TYPE_CHECKING:  # Lightning's ParallelStrategy attributes, in both bases
        parallel_devices: Optional[list[torch.device]]
        local_rank: int
        world_size: int
        num_nodes: int

    @property
    def config(self) -> ParallelConfig:
        """The configuration; resolved against the world size once processes exist."""
        return self.processes.config

    @property
    def meshes(self) -> ParallelMesh:
        """The job's meshes: the root mesh, the flattened ``dp`` axis and the 2-D data-parallel mesh."""
        return self.processes.meshes

    @property
    def device_mesh(self) -> DeviceMesh:
        """The job's root mesh (axes ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``)."""
        return self.meshes.root

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (ranks that see different batches)."""
        return self.meshes.dp.size()

    @property
    def token_group(self) -> dist.ProcessGroup:
        """The ranks whose tokens together make one step's batch: where per-token statistics sum. Data parallel, and
        under cp the cp ranks too (each holds a chunk of its samples' tokens inside the trunk)."""
        return self.meshes.token_mesh.get_group()

    @property
    def parallel_layout(self) -> dict[str, Any]:
        """The resolved layout, for logs and the logger's config."""
        return self.processes.layout(self.world_size, self.num_nodes)

    # ---- processes -------------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.processes.sampler_kwargs()

    # ---- collectives -----------------------------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        """Every rank waits here (nothing to wait for before processes exist)."""
        if _compat.distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (the object itself before processes exist)."""
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]


class ProcessGroupStrategy(ProcessView, _LightningParallelStrategy):
    """Processes, layout, mesh and data-parallel reductions (the base of `ParallelStrategy`); the state is its
    `Processes` component's.

    Args:
        config: the requested layout, validated (`ParallelConfig`); resolved against the world size at
            `setup_environment`.
        timeout: collective timeout; a rank stuck in a collective past this fails instead of hanging.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        **kwargs: Lightning's strategy arguments (accelerator, parallel_devices, cluster_environment, ...).
    """

    def __init__(
        self, config: ParallelConfig, timeout: timedelta, process_group_backend: Optional[str], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.processes = Processes(config, timeout, process_group_backend)
        self.num_nodes = 1

    @property
    def is_distributed(self) -> bool:
        """Lightning inserts a DistributedSampler only for strategies that say so (accelerator_connector)."""
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            _compat.set_subprocess_launcher(self)

    def set_world_ranks(self) -> None:
        """Lightning's connector calls this before the launcher starts the processes."""
        set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes,
                        self.num_nodes, self.global_rank)  # fmt: skip

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self.processes.join(self.cluster_environment, self.root_device, self.num_processes)

    # ---- data ------------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Split a loader over an iterable dataset over the data-parallel ranks only (`Processes.split_loader`)."""
        module = self.lightning_module
        self.processes.split_loader(dataloader, _compat.attached_trainer(module) if module is not None else None)
        return super().process_dataloader(dataloader)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Also ends a training stream's pass on every data-parallel rank together (`Processes.end_pass`)."""
        module = self.lightning_module
        self.processes.end_pass(_compat.attached_trainer(module) if module is not None else None, self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _set_metric_groups(self, module: nn.Module) -> None:
        set_metric_groups(module, self.meshes.dp.get_group())

    # ---- collectives -----------------------------------------------------------------------------------------
    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Union[Tensor, Any]:
        # `self.log(sync_dist=True)` lands here: average over data-parallel ranks, not the whole world.
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self.processes.mesh is not None:
            group = self.processes.mesh.dp.get_group()
        return all_reduce_logged(tensor, group, reduce_op)


def all_reduce_logged(tensor: Tensor, group: Optional[Any], reduce_op: Optional[Union[str, Any]] = "mean") -> Tensor:
    """All-reduce a logged value in place, as Lightning's ``_sync_ddp`` does, less the barrier it issues first.

    The barrier orders nothing the all-reduce does not (every rank waits inside the all-reduce anyway), and costs a
    collective's latency per ``self.log(sync_dist=True)`` call and step: ~0.3 ms on 2 CPU ranks over gloo
    (docs/benchmarks_history.md, "Per-step overhead on a tiny model"), where Lightning's ``ddp`` pays it.

    Args:
        tensor: the value; returned unchanged when no process group exists or ``group`` is one rank (a layout
            with no data parallelism: pipelines, tensor parallelism alone), where a collective would cost ~50 us of
            gloo's latency for nothing.
        group: the ranks to reduce over (``None``: the world).
        reduce_op: ``"mean"`` / ``"avg"``, ``"sum"``, ``"max"``, ``"min"``, ..., or a ``ReduceOp``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) == 1:
        return tensor
    divide = False
    op: Any = reduce_op if reduce_op is not None else dist.ReduceOp.SUM
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() in ("mean", "avg") else reduce_op.lower()
        divide = name == "avg" and dist.get_backend(group) == "gloo"  # gloo has no ReduceOp.AVG
        op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=op, group=group)
    if not divide:
        return tensor
    world = dist.get_world_size(group)
    # In place, as Lightning: the caller may hold the tensor it passed.
    return tensor.div_(world) if torch.is_floating_point(tensor) else tensor.copy_(tensor / world)


def join_processes(
    environment: ClusterEnvironment,
    device: torch.device,
    backend: Optional[str],
    timeout: timedelta,
    config: ParallelConfig,
    devices_per_node: int,
) -> tuple[str, ParallelConfig, ParallelMesh]:
    """Join the default process group, resolve the layout against the world and build the mesh (Trainer and Fabric).

    Args:
        environment: Lightning's cluster environment, its ranks already set.
        device: this rank's device.
        backend: ``"gloo"`` / ``"nccl"``, or ``None`` for the device's default.
        timeout: collective timeout.
        config: the requested layout, validated.
        devices_per_node: processes per node (tensor parallelism never spans nodes).

    Returns:
        the backend, the resolved config and the job's meshes.
    """
    backend = backend or _compat.default_process_group_backend(device)
    device_id = device if device.type != "cpu" else None
    # torch's flight recorder (every collective of every group, NCCL and gloo): what the watchdog's hang report
    # reads; read when the groups are made, so set before them. TORCH_FR_BUFFER_SIZE=0 switches it off.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    _compat.init_dist_connection(environment, backend, timeout=timeout, device_id=device_id)
    leave_in_order()
    world = environment.world_size()
    config = config.resolve(world, devices_per_node=devices_per_node)
    mesh = build_mesh(config, device.type)
    rank_zero_info(f"lightning_par layout: {config.describe(world)}")
    return backend, config, mesh


_LEAVING = [False]


def leave_in_order() -> None:
    """At interpreter exit, destroy the process groups first (once per process).

    A rank that exits with its groups alive sometimes aborts in their destructors ("terminate called without an
    active exception", SIGABRT) after all its work is done, so that a launcher reports a finished job as failed:
    measured with torch 2.13 on gloo, 2 of 6 exits of a plain script whose groups were alive, none of 6 after
    ``destroy_process_group()`` (docs/launching.md, "A finished job exits cleanly"). An ``atexit`` handler runs
    before the destructors, after the training code and the handlers registered later (loggers).
    """
    if not _LEAVING[0]:
        _LEAVING[0] = True
        atexit.register(_destroy_groups)


def _destroy_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def set_metric_groups(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every torchmetrics ``Metric`` in ``module`` sync over ``group`` (the data-parallel ranks).

    torchmetrics sync over the world unless told otherwise; tensor and pipeline ranks of one replica see the same
    samples, which would then count twice.
    """
    from torchmetrics import Metric

    for m in module.modules():
        if isinstance(m, Metric):
            m.process_group = group


def accumulation_for(global_batch: int, dataloader: Any, dp: int) -> int:
    """Micro-batches per optimizer step that make ``global_batch`` samples over ``dp`` ranks with this loader.

    Raises:
        ValueError: the loader has no batch size, or the global batch is not a multiple of per-rank batch x dp.
    """
    per_rank = getattr(dataloader, "batch_size", None)
    if not per_rank:
        raise ValueError(
            f"global_batch={global_batch} needs a training DataLoader with a batch_size (this one batches itself); "
            "set the loader's batch_size, or drop global_batch and set Trainer(accumulate_grad_batches=...)"
        )
    if global_batch % (per_rank * dp):
        raise ValueError(
            f"global_batch={global_batch} is not a multiple of the per-rank batch {per_rank} x {dp} data-parallel "
            f"ranks = {per_rank * dp}; set the loader's batch_size so that batch_size x {dp} divides {global_batch}, "
            "or change global_batch"
        )
    return global_batch // (per_rank * dp)
