"""`ParallelStrategy`: the Lightning glue around `lightning_par.parallel`.

It builds the mesh, calls `compose.parallelize`, reduces and logs over the right process groups, and delegates
precision and sharded checkpoints to their modules. The parallel code itself lives in `parallel/`.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_par.checkpoint.async_save import AsyncSaver
from lightning_par.config import AUTO, ACMode, ParallelConfig, split_world
from lightning_par.mesh import ParallelMesh, build_mesh
from lightning_par.parallel.compose import Parallelized, parallelize
from lightning_par.precision.parallel import ParallelPrecision
from lightning_par.strategies._checkpointing import CheckpointingMixin
from lightning_par.strategies._pipeline import PipelineSteps, PipelineStepsMixin


class _BackendDispatch:
    """``ParallelStrategy(backend="deepspeed")`` builds a `DeepSpeedParallelStrategy`.

    In a base class, not on `ParallelStrategy` itself: jsonargparse (LightningCLI) reads a class's own ``__new__``
    signature instead of ``__init__``'s, and recipes would lose every argument.
    """

    def __new__(cls, *args: Any, backend: str = "native", **kwargs: Any) -> Any:
        if backend == "deepspeed" and cls is ParallelStrategy:
            from lightning_par.strategies.deepspeed import DeepSpeedParallelStrategy

            return super().__new__(DeepSpeedParallelStrategy)
        return super().__new__(cls)


class ParallelStrategy(_BackendDispatch, CheckpointingMixin, PipelineStepsMixin, _LightningParallelStrategy):
    """One strategy for every combination of parallelism; `Trainer(strategy="zero2")` picks a preset of it.

    Args:
        pp, dp_replicate, dp_shard, ep, tp, zero_stage, offload, activation_checkpointing, ac_every,
            sequence_parallel, pp_schedule, microbatches, bucket_cap_mb, pp_split, pp_costs: see
            `lightning_par.config.ParallelConfig`.
        auto_dims: for registered names: the dimensions (``"pp"``, ``"tp"``, ``"dp"``) whose degrees are split
            from the world size at start-up by `lightning_par.config.split_world`; explicit degrees are used as
            given when this is ``None``. ``"ep"`` makes ``ep`` every data-parallel rank.
        timeout_s: collective timeout in seconds; a rank stuck in a collective past this fails instead of
            hanging.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        backend: who runs the ZeRO dimension: ``"native"`` (FSDP2 / our ZeRO 0-2 engine) or ``"deepspeed"``
            (DeepSpeed's engine; data parallelism only, see docs/deepspeed.md). ``ParallelStrategy(...,
            backend="deepspeed")`` builds a `lightning_par.strategies.deepspeed.DeepSpeedParallelStrategy`, which
            also takes ``deepspeed_config``, ``offload_device`` and ``nvme_path``.
        async_save: checkpoints saved during ``fit`` are written in the background: ``save_checkpoint`` returns
            at once; parameters and optimizer state are copied to CPU memory while the next forward and backward
            run (the next optimizer step waits for that copy), and training goes on while the copy is written. A
            checkpoint folder still appears under its name only when complete; at most one save is in flight, and
            the end of training waits for the last. Costs a CPU copy of this rank's checkpoint state, kept from the
            first save to the end of ``fit``. See docs/checkpointing.md.
        tp_plan: overrides of the inferred tensor-parallel plan: module-name patterns (``*`` for the block index)
            to styles (``colwise``, ``rowwise``, ``colwise_fused_qkv``, ``sequence_parallel``, ``replicate``);
            print the inferred plan with ``lightning-par plan``. See docs/tensor_parallel.md.
    """

    def __init__(
        self,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = AUTO,
        ep: int = 1,
        tp: int = 1,
        zero_stage: int = 0,
        offload: bool = False,
        activation_checkpointing: ACMode = None,
        ac_every: int = 2,
        sequence_parallel: Optional[bool] = None,
        pp_schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        bucket_cap_mb: float = 25.0,
        pp_split: Optional[tuple[int, ...]] = None,
        pp_costs: Optional[tuple[float, ...]] = None,
        auto_dims: Optional[tuple[str, ...]] = None,
        timeout_s: float = 600.0,
        process_group_backend: Optional[str] = None,
        async_save: bool = False,
        tp_plan: Optional[dict[str, str]] = None,
        backend: str = "native",
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if backend not in ("native", "deepspeed"):
            raise ValueError(f"backend={backend!r} is unknown; choose 'native' or 'deepspeed'")
        # Validated now, before any process exists; world-size checks follow in `setup_environment`.
        self._config = ParallelConfig(
            pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, tp=tp, zero_stage=zero_stage,
            offload=offload, activation_checkpointing=activation_checkpointing, ac_every=ac_every,
            sequence_parallel=sequence_parallel, pp_schedule=pp_schedule, microbatches=microbatches,
            bucket_cap_mb=bucket_cap_mb, pp_split=pp_split, pp_costs=pp_costs,
        )  # fmt: skip
        self._config.check_supported()
        if auto_dims:
            # A registered name's degrees come from the world size later; reject its combination now, before any
            # process starts (2 stands for "more than one").
            pp, tp = (2 if d in auto_dims else getattr(self._config, d) for d in ("pp", "tp"))
            dataclasses.replace(self._config, pp=pp, tp=tp).check_supported()
        self._tp_plan = dict(tp_plan) if tp_plan else None
        self._auto_dims = auto_dims
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds (600 is the default)")
        self._timeout = timedelta(seconds=timeout_s)
        self._process_group_backend = process_group_backend
        self._async_saver = AsyncSaver(self._timeout) if async_save else None
        self._saving_async = False  # between on_train_start and on_train_end: other saves are synchronous
        self._mesh: Optional[ParallelMesh] = None
        self._parallel: Optional[Parallelized] = None
        self._pipeline: Optional[PipelineSteps] = None
        self._accumulating = False
        self.num_nodes = 1

    # ---- layout ----------------------------------------------------------------------------------------------
    @property
    def config(self) -> ParallelConfig:
        """The configuration; resolved against the world size once processes exist."""
        return self._config

    @property
    def meshes(self) -> ParallelMesh:
        """The job's meshes: the root mesh, the flattened ``dp`` axis and the 2-D data-parallel mesh."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists only after the processes have started (setup_environment)")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The job's root mesh (axes ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``)."""
        return self.meshes.root

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (ranks that see different batches)."""
        return self.meshes.dp.size()

    @property
    def parallel_layout(self) -> dict[str, Any]:
        """The resolved layout, for logs and the logger's config."""
        return {"world_size": self.world_size, "num_nodes": self.num_nodes, **self._config.layout()}

    def precision_plugin_for(self, flag: str, device: str) -> Precision:
        """The precision plugin Lightning should use for ``Trainer(precision=flag)`` (see precision/_connector)."""
        return ParallelPrecision(str(flag), device)

    @property
    def _precision(self) -> ParallelPrecision:
        plugin = self.precision_plugin
        if not isinstance(plugin, ParallelPrecision):
            raise TypeError(
                f"{type(self).__name__} needs lightning_par's ParallelPrecision, got {type(plugin).__name__}; pass "
                "Trainer(precision=...) instead of a precision plugin"
            )
        return plugin

    # ---- processes -------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Split batches over data-parallel ranks only: tensor/pipeline ranks of one replica see the same batch.
        dp = self.meshes.dp
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def is_distributed(self) -> bool:
        """Lightning inserts a DistributedSampler only for strategies that say so (accelerator_connector)."""
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()
        config = self._config
        if self._auto_dims is not None:
            degrees = split_world(self._auto_dims, self.world_size, tp_cap=self.num_processes)
            config = dataclasses.replace(config, pp=degrees["pp"], tp=degrees["tp"], dp_shard=AUTO)
        self._config = config.resolve(self.world_size, devices_per_node=self.num_processes)
        if self._auto_dims is not None and "ep" in self._auto_dims:
            self._config = dataclasses.replace(self._config, ep=self._config.dp)
        self._mesh = build_mesh(self._config, self.root_device.type)
        c = self._config
        rank_zero_info(
            f"lightning_par layout: world {self.world_size} = pp {c.pp} x dp_replicate {c.dp_replicate} x dp_shard "
            f"{c.dp_shard} x tp {c.tp} (ep {c.ep}); zero_stage {c.zero_stage}, offload {c.offload}, activation "
            f"checkpointing {c.activation_checkpointing}"
        )

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # ---- model and optimizers --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = self._precision
        module = self.lightning_module
        assert module is not None
        if self._parallel is None:
            precision.convert_module(module)  # in place (bf16-true casts the parameters)
            module.to(self.root_device)
            low = precision.compute_dtype if precision.mixed else None
            self._parallel = parallelize(
                module,
                self.meshes,
                self._config,
                param_dtype=low,
                reduce_dtype=torch.float32 if low else None,
                tp_plan=self._tp_plan,
            )
            self._set_metric_groups(module)
            if self._parallel.pipeline is not None:
                self._pipeline = PipelineSteps(self._parallel.pipeline, self.device_mesh.get_group("pp"))
                rank_zero_info(f"lightning_par {self._parallel.pipeline.describe()}")
                precision.norm_groups = (self.device_mesh.get_group("pp"),)  # clip by the norm over all stages
        self.model = self._parallel.model
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _set_metric_groups(self, module: nn.Module) -> None:
        # torchmetrics sync over the default (world) group unless told otherwise; they must reduce over
        # data-parallel ranks only, or tensor/pipeline ranks would count the same samples twice.
        from torchmetrics import Metric

        group = self.meshes.dp.get_group()
        for m in module.modules():
            if isinstance(m, Metric):
                m.process_group = group

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        zero = self._parallel.zero if self._parallel else None
        if zero is not None:
            for opt in self.optimizers:
                zero.shard_optimizer(opt)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for the backward passes of gradient accumulation that precede a step.
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        zero = self._parallel.zero if self._parallel else None
        # Under a pipeline, ZeRO-2 reduces every step (its hooks are off), so full gradients never outlive a step.
        pipe_zero2 = self._pipeline is not None and zero is not None and zero.stage == 2
        if zero is not None and (not self._accumulating or pipe_zero2):
            zero.reduce_gradients()  # before on_before_optimizer_step and clipping see the gradients
        experts = self._parallel.experts if self._parallel else None
        if experts is not None and not self._accumulating:
            experts.reduce_gradients()

    # ---- collectives -----------------------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized() and not self._holds_no_rank(name):
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Union[Tensor, Any]:
        # `self.log(sync_dist=True)` lands here: average over data-parallel ranks, not the whole world.
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            group = self._mesh.dp.get_group()
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self._saving_async = False
        propagating = sys.exc_info()[0] is not None  # Lightning tears down inside `except` when fit failed
        try:
            if self._async_saver is not None:
                # Waits for the last save (on_train_end did not run if fit failed), then frees the staging buffers.
                self._async_saver.release()
        except Exception as err:
            if not propagating:
                raise
            warnings.warn(str(err), stacklevel=2)  # do not replace the exception that ended fit
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
