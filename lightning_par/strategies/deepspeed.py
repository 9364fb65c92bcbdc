"""`DeepSpeedParallelStrategy`: the ZeRO dimension run by DeepSpeed, interchangeable with the native one.

``Trainer(strategy="deepspeed_zero2")`` or ``DeepSpeedParallelStrategy(zero_stage=2)``. The rest of
`ParallelStrategy` is kept (mesh, sampler over data-parallel ranks, reductions, checkpoint folders); DeepSpeed's
engine takes over what it owns: backward (``engine.backward``), the optimizer step, the accumulation boundary,
gradient clipping and the precision (fp32 masters in its optimizer). Checkpoints are written and read in our
format (`lightning_par.parallel.deepspeed.state`), so a run moves between the two backends and
``lightning-par consolidate`` works on either. docs/deepspeed.md has the mapping and its limits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.callbacks.watchdog import install
from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.dcp import model_state
from lightning_par.checkpoint.pretrained.load import prepare_pretrained
from lightning_par.checkpoint.reader import load_tensors, read_index, read_meta
from lightning_par.parallel.compose import tied_names
from lightning_par.parallel.deepspeed import state as ds_state
from lightning_par.parallel.deepspeed.engine import (
    DeepSpeedConfigError,
    async_io_available,
    build_config,
    check_async_io,
    check_deepspeed_layout,
    deepspeed_optimizer,
    fp16_supported,
    init_comm,
    initialize_engine,
    load_user_config,
    merge_user_config,
    use_cpu_accelerator,
)
from lightning_par.parallel.deepspeed.meta_init import MetaInitReport, materialize_for_deepspeed
from lightning_par.parallel.flops import active_param_count
from lightning_par.parallel.materialize import base_seed, has_meta
from lightning_par.parallel.optimizers import check_elementwise
from lightning_par.parallel.tensor.adapters import adapter_names
from lightning_par.precision.parallel import ParallelPrecision
from lightning_par.strategies.parallel import ParallelStrategy


class DeepSpeedPrecision(ParallelPrecision):
    """Precision under the DeepSpeed backend: DeepSpeed casts the module and keeps fp32 masters; the engine runs
    backward (with its loss scaling under fp16), clipping and the step.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        device: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, precision: str, device: str = "cpu") -> None:
        super().__init__(precision, device)
        self.scaler = None  # DeepSpeed's own dynamic loss scaler under fp16

    @property
    def _low(self) -> Optional[torch.dtype]:
        return {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}.get(
            self.precision
        )

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # deepspeed.initialize casts it (bf16 / fp16 parameters, fp32 masters in the optimizer)

    @override
    def forward_context(self) -> Any:
        return nullcontext()  # the parameters are already in the compute dtype

    @override
    def convert_input(self, data: Any) -> Any:
        low = self._low
        if low is None:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, Tensor, lambda t: t.to(low) if torch.is_floating_point(t) else t)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:  # type: ignore[override]
        pass  # DeepSpeed clips in engine.step (config "gradient_clipping"), on the global norm over all shards

    @override
    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:  # type: ignore[override]
        raise DeepSpeedConfigError("DeepSpeed clips by norm only; use gradient_clip_algorithm='norm'")

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        strategy = model.trainer.strategy
        assert isinstance(strategy, DeepSpeedParallelStrategy)
        # The trainer already divided the loss by accumulate_grad_batches.
        strategy.engine.backward(tensor, scale_wrt_gas=False)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if result is None:
            raise RuntimeError(
                "training_step returned None, which skips the step; the DeepSpeed backend cannot skip one (the "
                "engine has already counted the micro-batch); return a loss, or use backend='native'"
            )
        strategy = model.trainer.strategy
        assert isinstance(strategy, DeepSpeedParallelStrategy)
        strategy.step()
        return result


class DeepSpeedParallelStrategy(ParallelStrategy):
    """`ParallelStrategy` whose ZeRO dimension is DeepSpeed's (data parallelism only: tp, pp, ep are native-only).

    Args:
        deepspeed_config: a DeepSpeed config (dict or JSON file path) overlaid on the generated one; keys that
            follow from the strategy or the Trainer (stage, offload device, precision, accumulation, clipping) must
            agree with them, or setup fails listing each conflict.
        offload_device: with ``offload=True``: ``"cpu"`` (default) or ``"nvme"``.
        nvme_path: folder for NVMe offload on a fast local disk; DeepSpeed adds one sub-folder per rank. Default: a
            new ``lightning_par_nvme_*`` folder in the temp directory per process, removed when the process exits.
        **kwargs: `ParallelStrategy`'s arguments; ``backend`` may be given only as ``"deepspeed"``.
    """

    _compile_refusal = (
        "DeepSpeed's ZeRO hooks on every submodule would sit inside each compiled block; use a native strategy "
        "(strategy='zero2' / 'zero3', or ParallelStrategy(..., compile=True)), or pass the model uncompiled"
    )

    def __init__(
        self,
        *args: Any,
        deepspeed_config: Union[str, Path, Mapping[str, Any], None] = None,
        offload_device: Optional[str] = None,
        nvme_path: Union[str, Path, None] = None,
        **kwargs: Any,
    ) -> None:
        backend = kwargs.pop("backend", "deepspeed")
        if backend != "deepspeed":
            raise ValueError(f"DeepSpeedParallelStrategy is backend='deepspeed', not {backend!r}; use ParallelStrategy")
        super().__init__(*args, **kwargs)
        if self.config.global_batch is not None:
            raise ValueError(
                "global_batch with DeepSpeed: its engine fixes the gradient accumulation when it is built, before the "
                "loader exists; set Trainer(accumulate_grad_batches=...) for this world size, or use "
                "lightning_par.ParallelStrategy (native ZeRO) with global_batch"
            )
        if not self._checkpoints.frozen:
            raise ValueError(
                "checkpoint_frozen=False: DeepSpeed writes its own checkpoints, with every parameter; leave out the "
                "frozen weights under lightning_par.ParallelStrategy (the native ZeRO stages), or keep them here"
            )
        if isinstance(self._pretrained, list):
            raise ValueError(
                "pretrained=[base, adapters...]: PEFT adapter folders are read under the native strategies; pass the "
                "base alone here (the adapters keep their initial values), or use lightning_par.ParallelStrategy"
            )
        if self.config.sync_every is not None:
            raise ValueError(
                "sync_every (local SGD) runs on the native ZeRO 0-2 engine, not DeepSpeed's; use "
                "lightning_par.ParallelStrategy(zero_stage=1 or 2, dp_replicate=..., sync_every=...)"
            )
        if self.config.grad_compression is not None or self.config.zero_quantized_weights or self.config.fp8:
            raise ValueError(
                "grad_compression, zero_quantized_weights and fp8 run on the native engines (ZeRO 0-1, FSDP2), not "
                "DeepSpeed's; use lightning_par.ParallelStrategy(...) with them, or DeepSpeed's own ZeRO++ "
                "(deepspeed_config={'zero_optimization': {'zero_quantized_weights': True}})"
            )
        self._torch_linear = torch.nn.functional.linear  # before any zero.Init of this run replaces it (`teardown`)
        # A dimension DeepSpeed cannot combine with is refused here with its reason, also once it runs natively.
        check_deepspeed_layout(self.config)
        self._user_config = load_user_config(deepspeed_config)
        if offload_device is not None and not self.config.offload:
            raise DeepSpeedConfigError(f"offload_device={offload_device!r} needs offload=True with zero_stage=3")
        self._offload_device = offload_device
        self._nvme_path = nvme_path
        self._engine: Any = None
        self._client: Optional[torch.optim.Optimizer] = None  # what configure_optimizers returned
        self._batch_known = False  # the engine's micro-batch size is taken from the first training batch
        self._group_names: list[list[str]] = []
        #: What materialising a meta-built model cost this rank (``None`` for a model built eagerly).
        self.meta_init: Optional[MetaInitReport] = None

    @property
    def engine(self) -> Any:
        """The ``DeepSpeedEngine`` (after setup)."""
        if self._engine is None:
            raise RuntimeError("the DeepSpeed engine exists only after the strategy's setup")
        return self._engine

    @override
    def precision_plugin_for(self, flag: str, device: str) -> DeepSpeedPrecision:
        if str(flag) == "16-mixed":
            if device == "cpu":
                use_cpu_accelerator()
            if not fp16_supported():
                raise DeepSpeedConfigError(
                    f"precision='16-mixed' with the DeepSpeed backend: DeepSpeed's {device} accelerator does not "
                    "support fp16 here; use precision='bf16-mixed', or backend='native' (which runs fp16 with a "
                    "sharded grad scaler)"
                )
        return DeepSpeedPrecision(str(flag), device)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu":
            use_cpu_accelerator()

    # ---- model and optimizer ---------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            # ZeRO-3's zero.Init swaps torch.nn.functional.linear for its own, process-wide, and leaves it ("persists
            # unless manually reset"): every model trained later in this process would run DeepSpeed's linear.
            torch.nn.functional.linear = self._torch_linear

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._engine is None or (fitting and self._client is None):
            if self._engine is None:  # the whole model, before DeepSpeed partitions it (ParallelismMonitor's N)
                self.global_param_count = active_param_count(module)
            self._build_engine(trainer, module, fitting)
        self.model = self._engine
        self.barrier()
        if fitting:
            install(trainer, self._guards)  # the watchdog and the replica check, as under the native engine
        self.setup_precision_plugin()

    def _build_engine(self, trainer: pl.Trainer, module: pl.LightningModule, fitting: bool) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise DeepSpeedConfigError("DeepSpeed clips by norm only; use gradient_clip_algorithm='norm'")
        if self._offload_device == "nvme":
            check_async_io(async_io_available())  # on every rank: each builds the op itself
        if self._offload_device == "nvme" and self._nvme_path is None:
            # Per process, so concurrent jobs on one machine never share swap files; the engine reads them until
            # the process ends (validate/predict after fit too), so they go at exit.
            self._nvme_path = tempfile.mkdtemp(prefix="lightning_par_nvme_")
            atexit.register(shutil.rmtree, self._nvme_path, ignore_errors=True)
        ours = build_config(
            self.config, precision=str(self._precision.precision), accumulate=trainer.accumulate_grad_batches,
            clip_val=trainer.gradient_clip_val, offload_device=self._offload_device, nvme_path=self._nvme_path,
        )  # fmt: skip
        ds_config = merge_user_config(ours, self._user_config)
        plan = None
        if self._pretrained is not None:
            # Names, shapes and files checked on every rank before anything is allocated or read.
            shapes = {n: tuple(v.shape) for n, v in model_state(module).items()}
            plan = prepare_pretrained(
                str(self._pretrained), shapes, module_type=type(module).__name__, tied=tied_names(module),
                hf_model=module, adapters=adapter_names(module),  # the base fills the layers low-rank adapters wrap
            )  # fmt: skip
        if has_meta(module):
            # Built on the meta device: storage and the native backend's initial values (or the file's), before
            # the optimizer is built over the parameters (ZeRO-3: partitioned unit by unit, deepspeed/meta_init.py).
            init_comm()
            self.meta_init = materialize_for_deepspeed(
                module, self.root_device, ds_config, seed=base_seed(), pretrained=plan
            )
            rank_zero_info(f"lightning_par {self.meta_init.describe()}")
        else:
            module.to(self.root_device)
            if plan is not None:  # the whole model is on every rank until the engine partitions it
                plan.read_into(model_state(module))
        if plan is not None:
            rank_zero_info(f"lightning_par {plan.report()}")
        self._set_metric_groups(module)
        optimizer = None
        if fitting:
            # No ParallelRun exists under DeepSpeed, so this only builds the client optimizers (nothing to wrap),
            # and post_backward has nothing to reduce: the engine reduces in its own backward.
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise DeepSpeedConfigError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; the DeepSpeed engine steps "
                    "exactly one; return one optimizer or use backend='native'"
                )
            client = self.optimizers[0]
            self._client = _compat.unwrap_optimizer(client)
            stage = self.config.zero_stage
            check_elementwise(self._client, f"DeepSpeed ZeRO-{stage}: it steps the optimizer on flat fp32 partitions")
            names = {p: n for n, p in module.named_parameters()}
            self._group_names = [[names[p] for p in g["params"]] for g in self._client.param_groups]
            optimizer = deepspeed_optimizer(self._client, offloaded=self.config.offload)
        if self.config.offload and optimizer is self._client and optimizer is not None:
            ds_config["zero_force_ds_cpu_optimizer"] = False  # a non-Adam torch optimizer on the CPU partitions
        rank_zero_info(f"lightning_par DeepSpeed config: {ds_config}")
        self._engine = initialize_engine(module, optimizer, ds_config)

    def step(self) -> None:
        """One DeepSpeed optimizer step, with the client optimizer's hyper-parameters (lr schedulers act on it)."""
        engine = self.engine
        inner = ds_state.engine_parts(engine).inner
        assert self._client is not None
        if inner is not self._client:  # DeepSpeedCPUAdam under offload: copy what schedulers may have changed
            for mine, theirs in zip(inner.param_groups, self._client.param_groups):
                for key in ("lr", "betas", "eps", "weight_decay"):
                    mine[key] = theirs[key]
        engine.step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._batch_known and args:
            # The engine was built before the loader existed (with 1); its batch bookkeeping (throughput timer,
            # train_batch_size = micro x accumulation x dp) takes the real per-rank batch from the first one.
            self._batch_known = True
            micro = extract_batch_size(args[0])
            self.engine.set_train_micro_batch_size(micro)
            self.engine.tput_timer.batch_size = self.engine.train_batch_size()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning runs the micro-batches that precede a step inside block_backward_sync; tell the engine, which
        # otherwise counts micro-steps itself, so its reduction happens at the same boundary as the trainer's step.
        self.engine.set_gradient_accumulation_boundary(not self._accumulating)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def _group_options(self) -> list[dict[str, Any]]:
        assert self._client is not None
        return [{k: v for k, v in g.items() if k != "params"} for g in self._client.param_groups]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ds_state.gather_model(self.engine, self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        inner = _compat.unwrap_optimizer(optimizer)
        if inner is not self._client:
            raise ValueError("optimizer_state() got an optimizer the strategy does not manage")
        assert self.lightning_module is not None
        return ds_state.gather_optimizer(self.engine, self.lightning_module, self._group_names, self._group_options())

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        assert module is not None
        index, meta = read_index(path), read_meta(path)
        checksums.verify(path, self.global_rank, self.world_size)  # each rank a share of the files, all agree
        params = dict(module.named_parameters())
        model = {n: torch.empty(ds_state.param_shape(p), dtype=torch.float32) for n, p in params.items()}
        model.update({n: torch.empty_like(b) for n, b in module.named_buffers() if ds_state.is_persistent(module, n)})
        state: dict[str, Any] = {"state_dict": model}
        if self._client is not None:
            parts = ds_state.engine_parts(self.engine)
            ds_state.materialize_optimizer_state(parts)
            keys = ds_state.state_keys(parts)
            per_param = {
                n: {**{k: torch.empty(ds_state.param_shape(params[n])) for k in keys}, "step": torch.tensor(0.0)}
                for names in self._group_names for n in names
            }  # fmt: skip
            groups = [{**opts, "params": names} for opts, names in zip(self._group_options(), self._group_names)]
            state["optimizer_0"] = {"state": per_param, "param_groups": groups}
        # Key and shape checks first (reader.py), then DCP reads full tensors, resharding what was saved sharded.
        load_tensors(path, index, state, strict=module.strict_loading)
        ds_state.scatter_state(self.engine, module, state["state_dict"], state.get("optimizer_0"))
        if self._client is not None:
            for group, saved in zip(self._client.param_groups, state["optimizer_0"]["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
        return meta
