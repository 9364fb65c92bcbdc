"""`FabricParallelStrategy`: the same layouts under Lightning Fabric, glue around the core the Trainer uses.

``Fabric(strategy="tp_zero3")`` (every name but ``pipe*`` and ``deepspeed_*``) or
``Fabric(strategy=FabricParallelStrategy(tp=2, zero_stage=3))``. Processes and mesh (`_processes.join_processes`),
the layout (`lightning_par.parallel.compose.parallelize` and the `ParallelRun` it returns), the precision rules
(`lightning_par.precision.flags`) and the checkpoint folders (`_fabric_state`, the Trainer's format) are shared
with `ParallelStrategy`; this class only answers Fabric's hooks.

Pipelines are refused: a schedule runs forward and backward together, per microbatch, so it must own the step,
which a Fabric loop writes itself (``loss = model(x); fabric.backward(loss)``). Use the Trainer for ``pipe*``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator, CUDAAccelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy as _FabricParallel
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par import _compat
from lightning_par.config import ParallelConfig
from lightning_par.parallel.compose import parallelize
from lightning_par.parallel.flops import active_param_count
from lightning_par.parallel.materialize import has_meta
from lightning_par.parallel.rebind import parameter_names, rebind_optimizer
from lightning_par.parallel.run import ParallelRun
from lightning_par.precision.fabric import FabricPrecision
from lightning_par.strategies import _fabric_state
from lightning_par.strategies._processes import (
    Processes,
    ProcessView,
    all_reduce_logged,
    set_metric_groups,
    set_world_ranks,
)

PIPELINE_REFUSAL = (
    "pipelines need a step they own: a schedule runs each microbatch's forward and backward together, and a Fabric "
    "loop calls the model and fabric.backward itself. Train pipe* layouts with the Trainer "
    "(L.Trainer(strategy=...)), or use pp=1 under Fabric"
)


class FabricParallelStrategy(ProcessView, _FabricParallel):
    """Every non-pipeline layout of `lightning_par.ParallelStrategy`, for ``lightning.Fabric``.

    Args:
        timeout_s: collective timeout in seconds.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        tp_plan: overrides of the inferred tensor-parallel plan (see `lightning_par.ParallelStrategy`).
        pretrained: start from these weights (see `lightning_par.ParallelStrategy`).
        accelerator, parallel_devices, cluster_environment, precision: Fabric's strategy arguments.
        **layout: the layout, as `lightning_par.config.ParallelConfig` fields: ``tp``, ``zero_stage``, ``ep``,
            ``dp_shard``, ``offload``, ``activation_checkpointing``, ... (``pp`` must stay 1).

    Raises:
        ValueError: ``pp > 1`` (or ``pipe`` among the names' dimensions), with the reason; any invalid layout.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 600.0,
        process_group_backend: Optional[str] = None,
        tp_plan: Optional[dict[str, str]] = None,
        pretrained: Optional[Union[str, list[str]]] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        **layout: Any,
    ) -> None:
        config = ParallelConfig(**layout)
        if config.pp > 1 or "pp" in (config.auto_dims or ()):
            raise ValueError(f"FabricParallelStrategy: {PIPELINE_REFUSAL}")
        if config.global_batch is not None:
            raise ValueError("FabricParallelStrategy: global_batch sets the Trainer's gradient accumulation, which a "
                             "Fabric loop does itself; accumulate in your loop (fabric.no_backward_sync)")  # fmt: skip
        # PowerSGD's per-rank state (each rank's error) is saved by the Trainer's checkpoints only.
        for name, what in (("sync_every", "local SGD"), ("grad_compression", "PowerSGD")):
            if getattr(config, name) is not None:
                raise ValueError(f"FabricParallelStrategy: {name} ({what}) runs under the Trainer's strategies only "
                                 f"so far; use Trainer(strategy=ParallelStrategy(..., {name}=...))")  # fmt: skip
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds (600 is the default)")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)  # fmt: skip
        self.processes = Processes(config, timedelta(seconds=timeout_s), process_group_backend)
        self._tp_plan = dict(tp_plan) if tp_plan else None
        self._pretrained = pretrained if pretrained is None or isinstance(pretrained, list) else str(pretrained)
        self._run: Optional[ParallelRun] = None
        self._accumulation = _Accumulation()
        _compat.set_fabric_backward_sync(self, self._accumulation)
        self._num_nodes = 1
        self.global_param_count: Optional[int] = None  # the whole model's active parameters, set at set-up

    # ---- layout ----------------------------------------------------------------------------------------------
    @property
    def parallel_run(self) -> Optional[ParallelRun]:
        """What `parallelize` built for the set-up model; ``None`` before ``fabric.setup``."""
        return self._run

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property  # type: ignore[override]
    @override
    def precision(self) -> FabricPrecision:
        if self._precision is None:
            self._precision = FabricPrecision("32-true", self._device_type())
        assert isinstance(self._precision, FabricPrecision)
        return self._precision

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # Fabric hands over its stock plugin for the flag; the same flag means our rules (precision/flags.py). None
        # (at construction) leaves the choice to Fabric(precision=...).
        self._precision = FabricPrecision.from_fabric(precision, self._device_type()) if precision else None

    def _device_type(self) -> str:
        return "cuda" if isinstance(self._accelerator, CUDAAccelerator) else "cpu"

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            _compat.set_fabric_subprocess_launcher(self)

    # ---- processes -------------------------------------------------------------------------------------------
    def _set_world_ranks(self) -> None:
        # Fabric's connector calls this name, before the launcher starts the processes.
        set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes,
                        self.num_nodes, self.global_rank)  # fmt: skip

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self.processes.join(self.cluster_environment, self.root_device, self.num_processes)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Split a loader over an iterable dataset over the data-parallel ranks only (`Processes.split_loader`)."""
        self.processes.split_loader(dataloader, None)
        return super().process_dataloader(dataloader)

    # ---- model and optimizers --------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        # `fabric.init_module()` builds on the meta device unless empty_init=False: each rank then creates only what
        # it holds, in `setup_module` (docs/large_models.md).
        stack = ExitStack()
        if empty_init is not False:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta(module):  # a meta-built model gets its storage in `setup_module`, rank by rank
            module.to(self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        before = parameter_names(module)
        model = self.setup_module(module)
        assert self._run is not None
        for optimizer in optimizers:
            # Built over the parameters before the layout: FSDP2 / tensor parallelism replaced many of them.
            rebind_optimizer(optimizer, before, self._run.module)
            self.setup_optimizer(optimizer)
        return model, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._run is not None:
            raise ValueError(
                f"{type(self).__name__} lays out one model per Fabric; {type(module).__name__} is a second: put both "
                "in one nn.Module, or use one Fabric per model"
            )
        self.global_param_count = active_param_count(module)  # before a rank holds only a slice or a shard
        low = self.precision.compute_dtype if self.precision.mixed else None
        self._run = parallelize(
            module, self.meshes, self.config, param_dtype=low, reduce_dtype=torch.float32 if low else None,
            tp_plan=self._tp_plan, timeout=self.processes.timeout, device=self.root_device, pretrained=self._pretrained,
        )  # fmt: skip
        set_metric_groups(module, self.meshes.dp.get_group())
        for line in self._run.describe():
            rank_zero_info(f"lightning_par {line}")
        return self._run.model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._run is None:
            raise RuntimeError("set the model up first: fabric.setup_module(model), then fabric.setup_optimizers(opt)")
        for line in self._run.wrap_optimizer(optimizer):
            rank_zero_info(f"lightning_par {line}")
        return optimizer

    # ---- steps -----------------------------------------------------------------------------------------------
    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self._run is not None:  # ZeRO 0-1 reduce during the backward that ends an accumulation
            self._run.before_backward(self._accumulation.accumulating)
        super().backward(tensor, module, *args, **kwargs)
        if self._run is not None:  # reduce what the layout reduces after backward (ZeRO 0-2 buckets, experts)
            self._run.after_backward(self._accumulation.accumulating)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: lightning_par clips by the global L2 norm only; use 2.0")
        norm = self.precision.clip_norm(optimizer, float(max_norm), self._run.norm_groups if self._run else ())
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total gradient norm is {norm.item()}; pass error_if_nonfinite=False to skip this")
        return norm

    # ---- collectives: data-parallel by default, as the Trainer's `self.log(sync_dist=True)` ------------------
    @override
    def all_reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce over the data-parallel ranks (tensor-parallel ranks of one replica hold the same values), or over
        ``group``."""
        if not isinstance(tensor, Tensor):
            return tensor
        return all_reduce_logged(tensor, group if group is not None else self._dp_group(), reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from the data-parallel ranks (one value per replica), or from ``group``."""
        group = group if group is not None else self._dp_group()
        return _compat.all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    def _dp_group(self) -> Optional[dist.ProcessGroup]:
        return self.processes.mesh.dp.get_group() if self.processes.mesh is not None else None

    # ---- checkpoints: the Trainer's sharded folders ----------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: Union[str, Path],
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__} saves whole sharded folders; drop storage_options and filter")
        _fabric_state.save_state(Path(path), state, self._set_up(), self.global_rank, self.broadcast)

    @override
    def load_checkpoint(
        self,
        path: Union[str, Path],
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            return _fabric_state.load_weights(path, self._set_up(), strict) or {}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "a sharded checkpoint loads into the set-up objects: pass state={'model': model, 'optimizer': "
                "optimizer, ...} (or the model alone for its weights)"
            )
        return _fabric_state.load_state(path, state, self._set_up(), strict)

    def _set_up(self) -> ParallelRun:
        if self._run is None:
            raise RuntimeError("set the model up first (fabric.setup(model, optimizer)), then save or load")
        return self._run


class _Accumulation:
    """``fabric.no_backward_sync(model)``: the backward passes inside accumulate; the reduction follows the last."""

    def __init__(self) -> None:
        self.accumulating = False

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._while(enabled)

    @contextmanager
    def _while(self, enabled: bool) -> Generator[None, None, None]:
        previous, self.accumulating = self.accumulating, enabled
        try:
            yield
        finally:
            self.accumulating = previous
