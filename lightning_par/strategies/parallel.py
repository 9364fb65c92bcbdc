"""`ParallelStrategy`: the Lightning glue around `lightning_par.parallel.compose.parallelize`.

It resolves the layout and builds the mesh (`ProcessGroupStrategy`), calls `parallelize` once and then only asks
the `ParallelRun` it returned (optimizer wrapping, what follows backward, checkpoint entries, gradient-norm groups,
the pipeline step). Two components do the rest: `PipelineSteps` runs Lightning's step hooks through a pipeline
schedule, `ShardedCheckpoints` writes and reads checkpoint folders. Every hook below is a short delegation.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_par import _compat
from lightning_par.callbacks.watchdog import guard_callbacks, install
from lightning_par.checkpoint.dcp import OptimizerEntry, model_state
from lightning_par.config import AUTO, ACMode, ParallelConfig
from lightning_par.names import check_native_backend
from lightning_par.parallel.compose import parallelize
from lightning_par.parallel.experts.finder import MoELayer
from lightning_par.parallel.flops import active_param_count
from lightning_par.parallel.materialize import has_meta
from lightning_par.parallel.run import ParallelRun
from lightning_par.precision.parallel import ParallelPrecision
from lightning_par.strategies._checkpointing import ShardedCheckpoints, Where, optimizer_entries
from lightning_par.strategies._compiled import take_compiled
from lightning_par.strategies._param_window import ParamsReady
from lightning_par.strategies._pipeline import PipelineSteps
from lightning_par.strategies._processes import ProcessGroupStrategy


class ParallelStrategy(ProcessGroupStrategy):
    """One strategy for every combination of parallelism; `Trainer(strategy="zero2")` picks a preset of it.

    Args:
        pp, dp_replicate, dp_shard, ep, tp, etp, cp, cp_mode, cp_uneven, zero_stage, offload, activation_checkpointing,
            ac_every, offload_blocks, sequence_parallel, pp_schedule, microbatches, bucket_cap_mb, pp_split, pp_costs,
            compile, auto_dims, global_batch, sync_every, outer_lr, outer_momentum, grad_compression, compression_rank,
            compression_start, zero_quantized_weights, trunk, vpp, fp8: `lightning_par.config.ParallelConfig` (by name).
        timeout_s: collective timeout in seconds; a rank stuck in a collective past this fails instead of hanging.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        backend: ``"native"`` only (FSDP2, our ZeRO 0-2); DeepSpeed's: `DeepSpeedParallelStrategy` (docs/deepspeed.md).
        async_save: checkpoints saved during ``fit`` are written in the background (``save_checkpoint`` returns at
            once; the state is copied to CPU memory while the next step runs, one save in flight at most, a folder
            appears only when complete); costs a CPU copy of this rank's checkpoint state. docs/checkpointing.md.
        tp_plan: overrides of the inferred tensor-parallel plan: module-name patterns (``*`` for the block index) to
            styles (``colwise``, ``rowwise``, ...); ``lightning-par plan`` prints it. docs/tensor_parallel.md.
        pretrained: start from these weights: a Hugging Face folder or ``.safetensors`` file, ``lightning-par
            consolidate`` output or a sharded checkpoint of this suite; each rank reads only its part once the model
            is laid out, after names, shapes and files are checked (docs/large_models.md). A list: the base, then
            PEFT adapter folders that fill the model's adapters (docs/fine_tuning.md).
        checkpoint_frozen: ``False``: checkpoints leave out the parameters that do not train (a fine-tune's frozen
            base): resume with the same ``pretrained=`` (docs/fine_tuning.md, "Adapters-only checkpoints").
        check_replicas_every: every N optimizer steps, compare the parameters several ranks must hold identically
            and stop naming the first that differ (`lightning_par.callbacks.ReplicaCheck`). ``None``: off.
        watchdog: end a stuck run with a report of where each rank is, and name a lost rank
            (`lightning_par.callbacks.JobWatchdog`): ``True`` (limit from the median step), seconds, or ``False``.
    """

    def __init__(
        self,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = AUTO,
        ep: int = 1,
        tp: int = 1,
        etp: int = 1,
        cp: int = 1,
        cp_mode: str = "allgather",
        cp_uneven: bool = False,
        zero_stage: int = 0,
        offload: bool = False,
        activation_checkpointing: ACMode = None,
        ac_every: int = 2,
        offload_blocks: Optional[int] = None,
        sequence_parallel: Optional[bool] = None,
        pp_schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        bucket_cap_mb: float = 25.0,
        pp_split: Optional[tuple[int, ...]] = None,
        pp_costs: Optional[tuple[float, ...]] = None,
        compile: bool = False,
        auto_dims: Optional[tuple[str, ...]] = None,
        global_batch: Optional[int] = None,
        sync_every: Optional[int] = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        grad_compression: Optional[str] = None,
        compression_rank: int = 1,
        compression_start: int = 1000,
        zero_quantized_weights: bool = False,
        trunk: Optional[str] = None,
        vpp: Optional[int] = None,
        fp8: Union[bool, str] = False,
        timeout_s: float = 600.0,
        process_group_backend: Optional[str] = None,
        async_save: bool = False,
        tp_plan: Optional[dict[str, str]] = None,
        backend: str = "native",
        pretrained: Optional[Union[str, list[str]]] = None,
        check_replicas_every: Optional[int] = None,
        checkpoint_frozen: bool = True,
        watchdog: Union[bool, float] = True,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        check_native_backend(backend)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds (600 is the default)")
        # Validated now (static checks, unsupported combinations), before any process exists; the world-size checks
        # follow once, when the processes exist (`ProcessGroupStrategy.setup_environment`).
        # Every config field is an argument of the same name (LightningCLI sets them one by one).
        given = locals()
        config = ParallelConfig(**{f.name: given[f.name] for f in dataclasses.fields(ParallelConfig)})
        super().__init__(config, timedelta(seconds=timeout_s), process_group_backend, accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)  # fmt: skip
        self._tp_plan = dict(tp_plan) if tp_plan else None
        self._guards = guard_callbacks(check_replicas_every, sync_every, watchdog, timeout_s)
        self._pretrained = pretrained if pretrained is None or isinstance(pretrained, list) else str(pretrained)
        self._checkpoints = ShardedCheckpoints(self.processes.timeout, async_save, checkpoint_frozen, self._pretrained)
        self.global_param_count: Optional[int] = None  # set at set-up: what ParallelismMonitor counts FLOPs from
        self._run: Optional[ParallelRun] = None
        self._pipeline: Optional[PipelineSteps] = None
        self._accumulating = False

    # `trainer.fit(torch.compile(model))`: the trainer assigns the unwrapped module here, then checks whether the
    # strategy accepts compiled modules; it becomes compile=True instead (strategies/_compiled.py).
    _compile_refusal: Optional[str] = None

    @property  # type: ignore[override]
    def _lightning_module(self) -> Optional[pl.LightningModule]:
        return self.__dict__.get("_lp_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        if _compat.compiled_context(module) is not None:  # (Lightning's __init__ assigns None before _config)
            module = take_compiled(module, self.config, self._compile_refusal)
        self.__dict__["_lp_lightning_module"] = module

    def precision_plugin_for(self, flag: str, device: str) -> Precision:
        """The precision plugin for ``Trainer(precision=flag)`` (Lightning asks: strategies/_precision_choice.py)."""
        return ParallelPrecision(str(flag), device)

    @property
    def _precision(self) -> ParallelPrecision:
        plugin = self.precision_plugin
        if not isinstance(plugin, ParallelPrecision):
            raise TypeError(f"{type(self).__name__} needs lightning_par's ParallelPrecision, got "
                            f"{type(plugin).__name__}; pass Trainer(precision=...) instead of a precision plugin")
        return plugin

    @property
    def parallel_run(self) -> Optional[ParallelRun]:
        """What `lightning_par.parallel.compose.parallelize` built (the ZeRO engine, the expert parallelism, the
        pipeline runner, ...), once the strategy is set up; ``None`` before, and under the DeepSpeed backend."""
        return self._run

    @property
    def moe_layers(self) -> Optional[list[MoELayer]]:
        """This rank's MoE layers as found before their experts were sharded (``None`` before setup or without
        any); `lightning_par.callbacks.ParallelismMonitor` counts their expert load."""
        experts = self._run.experts if self._run is not None else None
        return list(experts.layers) if experts is not None and experts.layers else None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # ---- model and optimizers --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = self._precision
        module = self.lightning_module
        assert module is not None
        if self._run is None:
            # Model FLOPs come from the whole model: after `parallelize` a rank holds a stage, a slice or a shard.
            self.global_param_count = active_param_count(module)
            precision.convert_module(module)  # in place (bf16-true casts the parameters)
            if not has_meta(module):  # a meta-built model gets its storage inside `parallelize`, rank by rank
                module.to(self.root_device)
            low = precision.compute_dtype if precision.mixed else None
            self._run = parallelize(
                module, self.meshes, self.config, param_dtype=low, reduce_dtype=torch.float32 if low else None,
                tp_plan=self._tp_plan, timeout=self.processes.timeout, device=self.root_device,
                pretrained=self._pretrained,
            )  # fmt: skip
            self._set_metric_groups(module)
            precision.norm_groups = self._run.norm_groups  # clipping's global norm spans what the run says
            if self._run.pipeline is not None:
                self._pipeline = PipelineSteps(self._run.pipeline)
            for line in self._run.describe():
                rank_zero_info(f"lightning_par {line}")
        self.model = self._run.model
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            ParamsReady.install(trainer, module, self._run)  # ZeRO 1-2: the all-gather overlaps the next forward
            install(trainer, self._guards)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        _compat.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)
        if self._run is not None:
            for opt in self.optimizers:
                for line in self._run.wrap_optimizer(opt):
                    rank_zero_info(f"lightning_par {line}")

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Lightning wraps configure_model() in this context (empty_init=None: "the strategy decides") and
        # trainer.init_module(empty_init=...) too. Meta device unless empty_init=False: each rank then creates only
        # what it holds, in `setup` (docs/large_models.md).
        meta = torch.device("meta") if empty_init is not False else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

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
        if self._run is not None:
            self._run.after_backward(self._accumulating)  # before clipping and on_before_optimizer_step

    # ---- steps: through the pipeline schedule when there is one ------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._run.before_forward() if self._run is not None else nullcontext():
                return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            return self._pipeline.training_step(self.lightning_module, self.precision_plugin, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            if self._run is not None:  # ZeRO 0-1 reduce during the backward that ends an accumulation
                self._run.before_backward(self._accumulating)
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = cast(pl.LightningModule, self.lightning_module)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._pipeline.hand_gradients()  # the schedule ran the backward already: Lightning's hooks around it
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return (super().validation_step(*args, **kwargs) if self._pipeline is None
                else self._eval_step("validation_step", self.precision_plugin.val_step_context(), args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return (super().test_step(*args, **kwargs) if self._pipeline is None
                else self._eval_step("test_step", self.precision_plugin.test_step_context(), args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return (super().predict_step(*args, **kwargs) if self._pipeline is None
                else self._eval_step("predict_step", self.precision_plugin.predict_step_context(), args, kwargs))

    def _eval_step(self, hook: str, context: Any, args: tuple, kwargs: dict) -> Any:
        assert self.lightning_module is not None and self._pipeline is not None
        with context:
            return self._pipeline.eval_step(self.lightning_module, hook, *args, **kwargs)

    # ---- checkpoints (ShardedCheckpoints) ----------------------------------------------------------------------
    def _where(self) -> Where:
        trainer = _compat.attached_trainer(self.lightning_module)
        return Where(trainer, self.global_rank, self.world_size, self.root_device, self.broadcast)

    def _optimizer_entries(self) -> list[OptimizerEntry]:
        assert self.lightning_module is not None
        return optimizer_entries(self._run, self.lightning_module, self.optimizers)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # the base splits an iterable dataset first
        self._checkpoints.on_train_loader(self._where().trainer, dataloader)
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._checkpoints.on_train_start(self._where().trainer, self.root_device)

    @override
    def on_train_end(self) -> None:
        self._checkpoints.on_train_end()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        self.wait_for_params()
        return model_state(self.lightning_module, self._run.distribute_model() if self._run else None)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self._run, self._optimizer_entries(), optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} saves sharded folders itself; drop storage_options")
        assert self.lightning_module is not None
        self.wait_for_params()
        self._checkpoints.save(checkpoint, Path(filepath), self._where(), self.lightning_module,
                               self._optimizer_entries(), self._run)  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._checkpoints.load(Path(checkpoint_path), self._where(), self.lightning_module,
                                      self._optimizer_entries(), self._run)  # fmt: skip

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # `load_checkpoint` already loaded the sharded weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # `load_checkpoint` already loaded the sharded optimizer state in place

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        self._checkpoints.remove(Path(filepath), self.is_global_zero)

    @property
    def checkpoint_in_flight(self) -> Optional[Path]:
        """The checkpoint being written in the background (``async_save=True``) on this rank, or ``None``."""
        return self._checkpoints.in_flight

    def wait_for_params(self) -> None:
        """Complete the parameter all-gather that ZeRO 1-2 run after each optimizer step, overlapped with the next
        forward: call it before reading weights outside Lightning's hooks and the forward (docs/strategies.md)."""
        if self._run is not None:
            self._run.wait_params()

    def wait_for_staging(self) -> None:
        """Wait until a background save has copied the parameters and optimizer state (it runs before every optimizer
        step; call it from code that changes parameters in place outside ``optimizer.step()`` right after a save).
        Raises `CheckpointError` when a tensor changed in place before its copy was taken."""
        self._checkpoints.wait_for_staging()

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is complete under its name; raises
        `CheckpointError` when that save failed."""
        self._checkpoints.wait()

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not self._checkpoints.holds_no_rank(name):
            super().barrier(name)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        propagating = sys.exc_info()[0] is not None  # Lightning tears down inside `except` when fit failed
        try:
            # Waits for the last save (on_train_end did not run if fit failed), then frees the staging buffers.
            self._checkpoints.release()
        except Exception as err:
            if not propagating:
                raise
            warnings.warn(str(err), stacklevel=2)  # do not replace the exception that ended fit
        _compat.unbind_callback_logging(self.lightning_module)  # a callback kept after the run held the model
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
