"""The probes of every private API `lightning_par._compat` reaches: what depends on each, and a check that it is still
where the accessor expects it. `tests/test_compat.py` turns each into a test, so an upgrade that moves one fails
with the API's name, the installed version and the fix, not deep inside a training run.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par import _compat


# ---- checks ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrivateAPI:
    """A private API reached from this module, and what in lightning_par depends on it.

    Args:
        library: the distribution it comes from (``"torch"``, ``"lightning"``, ``"torchmetrics"``, ``"deepspeed"``).
        name: its dotted name.
        used_by: what depends on it, as the end of "..., which <used_by>".
        accessors: the names in this module that reach it.
        probe: raises (ImportError, AttributeError, ...) when the installed library no longer has it as used here.
    """

    library: str
    name: str
    used_by: str
    accessors: tuple[str, ...]
    probe: Callable[[], object]


def _attr(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"no module in {path}")


def _step_post_hooks() -> None:
    """The post-hooks are an ordered dict by handle id, and the global ones a dict: both as the accessors use them."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    first = opt.register_step_post_hook(lambda *_: None)
    second = opt.register_step_post_hook(lambda *_: None)
    _compat.run_step_post_hook_first(opt, second)
    assert list(opt._optimizer_step_post_hooks) == [second.id, first.id]
    assert _compat.step_post_hooks(opt) == 2 + len(_attr("torch.optim.optimizer._global_optimizer_post_hooks"))


def _chunk_cat_layout() -> None:
    """Rank-major with ceil(rows / world) rows per chunk and zero padding, as `zero.buckets.Bucket` lays out."""
    a, b = torch.arange(15.0).view(5, 3), torch.arange(4.0)
    out = torch.empty(2, 11)
    _compat.chunk_cat([a, b], 2, out)
    want = torch.tensor([[*range(9), 0, 1], [*range(9, 15), 0, 0, 0, 2, 3]], dtype=torch.float32)
    assert torch.equal(out, want), out


def _hidden_worker_info() -> None:
    """`get_worker_info` returns the module global the accessor replaces."""
    from torch.utils.data import get_worker_info
    from torch.utils.data._utils import worker

    saved, worker._worker_info = worker._worker_info, "probe"
    try:
        assert get_worker_info() == "probe"
        with _compat.hidden_worker_info():
            assert get_worker_info() is None
        assert get_worker_info() == "probe"
    finally:
        worker._worker_info = saved


def _params(path: str, *names: str) -> Any:
    """The callable at ``path``; fails unless it takes parameters ``names``."""
    fn = _attr(path)
    have = inspect.signature(fn).parameters
    if any(n not in have for n in names):
        raise TypeError(f"it takes ({', '.join(have)}), lightning_par passes ({', '.join(names)})")
    return fn


def _builds(path: str, **kwargs: Any) -> Any:
    """The class at ``path``; fails unless it builds from ``kwargs`` (a C++ class has no signature to read: torch
    2.11's ``_StridedShard``) and keeps them as attributes of the same names."""
    cls = _attr(path)
    built = cls(**kwargs)
    if any(getattr(built, k, None) != v for k, v in kwargs.items()):
        raise TypeError(f"{path}({kwargs}) does not keep {', '.join(kwargs)} as attributes")
    return cls


def _sets(path: str, *attrs: str) -> Any:
    """Fail unless the source of the class or module at ``path`` assigns each of ``attrs`` (instance attributes
    that exist only on a built object, which a check cannot afford to build: a process group, an engine)."""
    source = inspect.getsource(_attr(path))
    missing = [a for a in attrs if not re.search(rf"\.{a}\s*(:[^=\n]*)?=(?!=)", source)]
    if missing:
        raise AttributeError(f"{path} no longer sets {', '.join(missing)}")
    return source


def _dtensor_constructor() -> None:
    # The constructor is a C++ function without a signature; torch mirrors it in a Python stub for mypy.
    source = inspect.getsource(_attr(DTensor.from_local.__module__))  # where DTensor is defined
    if "local_tensor: torch.Tensor,\n        spec: DTensorSpec,\n        *,\n        requires_grad: bool" not in source:
        raise TypeError("DTensor.__new__ no longer reads (local_tensor, spec, *, requires_grad)")


def _compiler_ctx() -> None:
    # Trainer.fit hands the strategy the module from_compiled marked, before refusing it: both must still hold.
    _sets("lightning.pytorch.utilities.compile", "_compiler_ctx")
    fit = inspect.getsource(_attr("lightning.pytorch.trainer.trainer.Trainer.fit"))
    if not re.search(r"_lightning_module = model\s+_verify_strategy_supports_compile", fit):
        raise AttributeError("Trainer.fit no longer assigns strategy._lightning_module before checking compile")


def _slots(path: str, *names: str) -> None:
    if any(n not in _attr(path).__slots__ for n in names):
        raise AttributeError(f"{path}.__slots__ is {_attr(path).__slots__}")


def _fields(path: str, *names: str) -> None:
    if any(n not in _attr(path)._fields for n in names):
        raise AttributeError(f"{path} has fields {_attr(path)._fields}")


_D = "torch.distributed"
_DT = "torch.distributed.tensor"
_PS = "torch.distributed.pipelining.schedules"
_LF = "lightning.fabric.utilities.distributed"
_LS = "lightning.pytorch.strategies"
_CONNECTOR = "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector"
_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
_ENGINE = "lightning_par.parallel.deepspeed.state finds DeepSpeed's fp32 partitions (checkpoints) with"
_METRIC = "lightning_par.strategies._pipeline sends metrics from the last pipeline stage to the others with"
_TREE = "lightning_par.parallel.pipeline (stages, schedule), utils.memory, strategies._pipeline walk batches and " \
    "outputs with"

# One entry per private API; the accessors are this module's names that reach it.
PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # torch: DTensor and DeviceMesh
    PrivateAPI("torch", f"{_DT}.placement_types._StridedShard",
               "lightning_par.parallel.tensor.apply shards fused [q|k|v] projections with (checkpoint.strided, "
               "parallel.zero.replicated read it)",
               ("StridedShard",), lambda: _builds(f"{_DT}.placement_types._StridedShard", dim=0, split_factor=3)),
    PrivateAPI("torch", f"{_DT}.DTensor._local_tensor",
               "lightning_par.checkpoint.async_save and strategies._checkpointing read shards without autograd with",
               ("dtensor_local",), lambda: _slots(f"{_DT}.DTensor", "_local_tensor")),
    PrivateAPI("torch", f"{_DT}.DTensor._spec",
               "lightning_par.parallel.zero.replicated and checkpoint.async_save rewrap state and staged shards with",
               ("dtensor_spec", "dtensor_like"), lambda: _slots(f"{_DT}.DTensor", "_spec")),
    PrivateAPI("torch", f"{_DT}.DTensor(local_tensor, spec, *, requires_grad)",
               "lightning_par.parallel.zero.replicated wraps optimizer state for DCP with (checkpoint.async_save "
               "falls back to DTensor.from_local)",
               ("dtensor_from_spec", "dtensor_like"), _dtensor_constructor),
    PrivateAPI("torch", f"{_D}.device_mesh.DeviceMesh._flatten",
               "lightning_par.mesh builds the flat dp axis (loss averaging, sampler, metrics) with",
               ("flatten_mesh",), lambda: _params(f"{_D}.device_mesh.DeviceMesh._flatten", "mesh_dim_name")),
    # torch: collectives
    PrivateAPI("torch", f"{_D}.reduce_scatter_single (or reduce_scatter_tensor)",
               "lightning_par.parallel.zero.replicated reduces ZeRO-1/2 gradient buckets with",
               ("reduce_scatter_single",),
               lambda: getattr(dist, "reduce_scatter_single", None) or _attr(f"{_D}.reduce_scatter_tensor")),
    PrivateAPI("torch", f"{_D}.all_gather_single (or all_gather_into_tensor)",
               "lightning_par.parallel.zero.replicated gathers ZeRO-1/2 parameter shards with",
               ("all_gather_single",),
               lambda: getattr(dist, "all_gather_single", None) or _attr(f"{_D}.all_gather_into_tensor")),
    PrivateAPI("torch", "torch.ops._c10d_functional.reduce_scatter_tensor",
               "lightning_par.parallel.activation_checkpointing saves under 'selective_op' (and "
               "benchmarks/bench_tensor_parallel.py counts)",
               ("C10D_FUNCTIONAL", "c10d_functional_ops"),
               lambda: _compat.c10d_functional_ops().reduce_scatter_tensor.default),
    PrivateAPI("torch", "torch._ops.OpOverload._schema",
               "benchmarks/bench_tensor_parallel.py names the ops it counts with",
               ("op_name",), lambda: _compat.op_name(torch.ops.aten.mm.default)),
    # torch: nn.Module, Tensor and storage internals
    PrivateAPI("torch", "torch.Tensor._version",
               "lightning_par.checkpoint.async_save detects tensors changed during a background copy with",
               ("tensor_version",), lambda: int(_compat.tensor_version(torch.empty(1)))),
    PrivateAPI("torch", "torch.UntypedStorage._cdata",
               "lightning_par.utils.memory.LiveStorageBytes tells storages apart with",
               ("storage_id",), lambda: int(_compat.storage_id(torch.empty(1).untyped_storage()))),
    PrivateAPI("torch", "torch.multiprocessing.reductions.StorageWeakRef",
               "lightning_par.utils.memory.LiveStorageBytes sees storages die with",
               ("StorageWeakRef",), lambda: _attr("torch.multiprocessing.reductions.StorageWeakRef.expired")),
    PrivateAPI("torch", "torch.nn.Module._parameters",
               "lightning_par.parallel.pipeline.stages finds the modules outside the trunk that own parameters with",
               ("module_parameters",), lambda: dict(_compat.module_parameters(nn.Module()))),
    PrivateAPI("torch", "torch.nn.Module._modules",
               "lightning_par.parallel.pipeline.stages swaps blocks for stage stand-ins with",
               ("set_child_module",), lambda: _compat.set_child_module(nn.Module(), "x", nn.Module())),
    PrivateAPI("torch", "torch.nn.Module._non_persistent_buffers_set",
               "lightning_par.parallel.deepspeed.state leaves non-persistent buffers out of checkpoints with",
               ("non_persistent_buffers",), lambda: set(_compat.non_persistent_buffers(nn.Module()))),
    # Overridden in lightning_par/models/llama.py itself: models/ imports nothing from lightning_par (test_models.py).
    PrivateAPI("torch", "torch.nn.Module._apply",
               "lightning_par.models.Llama overrides to rebuild its rope table after .to() and to_empty(); "
               "lightning_par.parallel.materialize allocates a meta-built model's tensors with",
               ("apply_to_tensors",), lambda: _params("torch.nn.Module._apply", "fn", "recurse")),
    # torch: AMP
    PrivateAPI("torch", "torch._amp_foreach_non_finite_check_and_unscale_",
               "lightning_par.precision.parallel.ShardedGradScaler unscales gradient shards with",
               ("amp_unscale_and_check_",), lambda: _attr("torch._amp_foreach_non_finite_check_and_unscale_")),
    PrivateAPI("torch", "torch.amp.GradScaler._unscale_grads_",
               "lightning_par.precision.parallel.ShardedGradScaler overrides to skip a step on every rank when one "
               "overflows",
               ("GradScalerUnscaleHook",),
               lambda: _params("torch.amp.GradScaler._unscale_grads_", "optimizer", "inv_scale", "found_inf",
                               "allow_fp16")),
    # torch: pytree and dispatch
    *(
        PrivateAPI("torch", f"torch.utils._pytree.{fn}", _TREE, (fn,), partial(_attr, f"torch.utils._pytree.{fn}"))
        for fn in ("tree_flatten", "tree_unflatten", "tree_leaves", "tree_map_only")
    ),
    PrivateAPI("torch", "torch.utils._python_dispatch.TorchDispatchMode",
               "lightning_par.utils.memory.LiveStorageBytes and benchmarks/bench_tensor_parallel.py see every op with",
               ("TorchDispatchMode",),
               lambda: _attr("torch.utils._python_dispatch.TorchDispatchMode.__torch_dispatch__")),
    # torch: optimizer hooks
    PrivateAPI("torch", "torch.optim.{Optimizer._optimizer_step_post_hooks, optimizer._global_optimizer_post_hooks}",
               "lightning_par.parallel.zero.replicated orders and counts the post-hooks of a ZeRO-1/2 step with",
               ("step_post_hooks", "run_step_post_hook_first"), lambda: _step_post_hooks()),
    # torch: fused copies
    PrivateAPI("torch", "torch._foreach_copy_", "lightning_par.parallel.zero.buckets unpacks gathered parameters with",
               ("foreach_copy",), lambda: _compat.foreach_copy([torch.zeros(2)], [torch.ones(2)])),
    PrivateAPI("torch", "torch._chunk_cat", "lightning_par.parallel.zero.buckets packs gradients rank-major with",
               ("chunk_cat",), lambda: _chunk_cat_layout()),
    # torch: DataLoader workers
    PrivateAPI("torch", "torch.utils.data._utils.worker._worker_info",
               "lightning_par.streams.dataset reads a source as one process inside a loader worker with",
               ("hidden_worker_info",), lambda: _hidden_worker_info()),
    # torch: distributed checkpoint
    PrivateAPI("torch", f"{_D}.checkpoint.state_dict._init_optim_state",
               "lightning_par.checkpoint.dcp creates optimizer state before loading into it with",
               ("init_optim_state",), lambda: _params(f"{_D}.checkpoint.state_dict._init_optim_state", "optim")),
    PrivateAPI("torch", f"{_D}.checkpoint.FileSystemReader._slice_file",
               "lightning_par.checkpoint.reader names the data file and bytes of a failed read with",
               ("FileSystemReaderSliceHook",),
               lambda: _params(f"{_D}.checkpoint.FileSystemReader._slice_file", "file", "sinfo")),
    *(
        PrivateAPI("torch", f"{module}.{name}",
                   "lightning_par.checkpoint.reader allows in a checkpoint index (else no checkpoint loads)",
                   ("DCP_INDEX_PRIVATE_GLOBALS",), partial(_attr, f"{module}.{name}"))
        for module, name in _compat.DCP_INDEX_PRIVATE_GLOBALS
    ),
    # torch: tensor-parallel styles
    PrivateAPI("torch", f"{_DT}.parallel.ColwiseParallel._apply",
               "lightning_par.parallel.tensor.apply overrides to shard fused [q|k|v] projections",
               ("ColwiseParallelHook",),
               lambda: _params(f"{_DT}.parallel.ColwiseParallel._apply", "module", "device_mesh")),
    PrivateAPI("torch", f"{_DT}.parallel.ColwiseParallel._prepare_input_fn",
               "lightning_par.parallel.tensor.apply prepares the inputs of fused projections with",
               ("ColwiseParallelHook",),
               lambda: _params(f"{_DT}.parallel.ColwiseParallel._prepare_input_fn", "input_layouts",
                               "desired_input_layouts", "mod", "inputs", "device_mesh")),
    # torch: what the watchdog reads (lightning_par.guards)
    PrivateAPI("torch", f"{_D}.distributed_c10d._get_default_store",
               "lightning_par.guards.watchdog sends heartbeats and hang reports through the store returned by",
               ("default_store",), lambda: _params(f"{_D}.distributed_c10d._get_default_store")),
    PrivateAPI("torch", "torch._C._distributed_c10d._dump_fr_trace (torch 2.11: _dump_nccl_trace)",
               "lightning_par.guards.blocked adds the last collectives per group to a hang report with",
               ("flight_recorder",),
               lambda: getattr(_attr("torch._C._distributed_c10d"), "_dump_fr_trace", None)
               or _attr("torch._C._distributed_c10d._dump_nccl_trace")),
    PrivateAPI("torch", f"{_D}.ProcessGroup._get_sequence_number_for_group",
               "lightning_par.guards.blocked tells ranks that reached a collective from those that did not with",
               ("group_sequence_number",), lambda: _attr(f"{_D}.ProcessGroup._get_sequence_number_for_group")),
    PrivateAPI("torch", f"{_D}.fsdp._fully_shard._fsdp_api.AllGather",
               "lightning_par.parallel.compression.quantized sends ZeRO-3's weights as int8 through (with "
               "FSDPModule.set_custom_all_gather)", ("FSDPAllGather",),
               lambda: (_attr(f"{_D}.fsdp._fully_shard._fsdp_api.AllGather").allocate,
                        _attr(f"{_D}.fsdp.FSDPModule.set_custom_all_gather"))),
    PrivateAPI("torch", f"{_D}.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._module_fqn",
               "lightning_par.guards.blocked names the FSDP2 parameters a stuck all-gather is for with",
               ("fsdp_group_name",), lambda: _sets(f"{_D}.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup",
                                                    "_module_fqn")),
    PrivateAPI("torch", f"{_PS}.PipelineScheduleSingle._stage and _step_microbatches' locals",
               "lightning_par.guards.blocked reads a stuck schedule's action (stage, microbatch, transfer) from",
               ("SCHEDULE_STEP", "schedule_stage"),
               lambda: [_sets(f"{_PS}.PipelineScheduleSingle", "_stage"),
                        _params(f"{_PS}.Schedule1F1B._step_microbatches"),
                        _params(f"{_PS}._PipelineScheduleRuntime._step_microbatches"),
                        re.search(r"fwd_mb_index = 0[\s\S]*bwd_mb_index = 0",
                                  inspect.getsource(_attr(f"{_PS}.Schedule1F1B._step_microbatches"))) or
                        _params(f"{_PS}.Schedule1F1B.fwd_mb_index_missing")]),
    # torch: pipelining
    PrivateAPI("torch", f"{_PS}._wait_batch_p2p",
               "benchmarks/bench_pipeline_bubble.py times the waits on peers by wrapping",
               ("pipeline_p2p_wait", "set_pipeline_p2p_wait"), lambda: _params(f"{_PS}._wait_batch_p2p", "work")),
    PrivateAPI("torch", f"{_PS}.PipelineSchedule{{Single,Multi}}.pipeline_order",
               "benchmarks/bench_pipeline_bubble.py replays (lightning_par.analysis.pipeline_timeline) for theory",
               ("pipeline_order",),
               lambda: [_sets(f"{_PS}.PipelineSchedule{kind}", "pipeline_order") for kind in ("Single", "Multi")]),
    PrivateAPI("torch", f"{_PS}.PipelineScheduleMulti subclasses' _calculate_single_rank_operations",
               "lightning_par.planner.steptime replays (for the bubble of a layout it prices) through",
               ("schedule_rank_actions",),
               lambda: [_attr(f"{_PS}.{c}._calculate_single_rank_operations") for c in
                        ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                         "ScheduleZBVZeroBubble", "ScheduleDualPipeV")]),
    PrivateAPI("torch", f"{_PS}._Action",
               "lightning_par.analysis.pipeline_timeline reads (stage_index, computation_type, microbatch_index, "
               "sub_actions) of",
               (), lambda: _fields(f"{_PS}._Action", "stage_index", "computation_type", "microbatch_index",
                                   "sub_actions")),
    PrivateAPI("torch", f"{_PS}.Schedule1F1B._step_microbatches",
               "lightning_par.analysis.pipeline_timeline.one_f_one_b_order copies the order of (check the copy)",
               (), lambda: _attr(f"{_PS}.Schedule1F1B._step_microbatches")),
    # Lightning
    PrivateAPI("lightning", "lightning.pytorch.LightningModule._compiler_ctx (set by utilities.compile.from_compiled)",
               "lightning_par.strategies.ParallelStrategy turns trainer.fit(torch.compile(model)) into compile=True "
               "with", ("compiled_context",), _compiler_ctx),
    PrivateAPI("lightning", f"{_CONNECTOR}._check_and_init_precision",
               "lightning_par.strategies._precision_choice wraps so our strategies choose their precision plugin",
               ("connector_precision_choice", "set_connector_precision_choice"),
               lambda: _attr(f"{_CONNECTOR}._check_and_init_precision")),
    PrivateAPI("lightning", f"{_CONNECTOR}._precision_plugin_flag, _accelerator_flag, _precision_flag",
               "lightning_par.strategies._precision_choice reads the Trainer's precision arguments with",
               ("connector_flags",),
               lambda: _sets(_CONNECTOR, "_precision_plugin_flag", "_accelerator_flag", "_precision_flag")),
    PrivateAPI("lightning", "lightning.fabric.utilities.types._Stateful",
               "lightning_par.checkpoint.resume_state leaves the loaders Lightning resumes itself alone with",
               ("stateful_protocol",), lambda: _attr("lightning.fabric.utilities.types._Stateful.state_dict")),
    PrivateAPI("lightning", "lightning.pytorch.callbacks.ModelCheckpoint._last_global_step_saved",
               "lightning_par.strategies._checkpointing marks a resumed checkpoint saved with",
               ("mark_saved_at",), lambda: _sets("lightning.pytorch.callbacks.ModelCheckpoint",
                                                 "_last_global_step_saved")),
    PrivateAPI("lightning", "lightning.pytorch.loops.fit_loop._FitLoop._combined_loader",
               "lightning_par.checkpoint.resume_state finds the training loaders (data position, loader RNG) with",
               ("combined_loader",), lambda: _sets("lightning.pytorch.loops.fit_loop._FitLoop", "_combined_loader")),
    PrivateAPI("lightning", "lightning.pytorch.LightningModule._trainer",
               "lightning_par.strategies._checkpointing finds the Trainer of a possibly detached module with",
               ("attached_trainer",), lambda: _sets("lightning.pytorch.core.module.LightningModule", "_trainer")),
    PrivateAPI("lightning", "lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"
               "._attach_model_logging_functions",
               "lightning_par.strategies.parallel's teardown undoes the log / log_dict bindings of",
               ("unbind_callback_logging",),
               lambda: _attr("lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"
                             "._attach_model_logging_functions")),
    PrivateAPI("lightning", "lightning.pytorch.core.optimizer.LightningOptimizer._optimizer",
               "lightning_par.strategies unwrap the optimizers they checkpoint and hand to DeepSpeed with",
               ("unwrap_optimizer",),
               lambda: _sets("lightning.pytorch.core.optimizer.LightningOptimizer", "_optimizer")),
    PrivateAPI("lightning", f"{_LF}._init_dist_connection",
               "lightning_par.strategies.parallel initializes the process group with",
               ("init_dist_connection",),
               lambda: _params(f"{_LF}._init_dist_connection", "cluster_environment", "torch_distributed_backend")),
    PrivateAPI("lightning", f"{_LF}._get_default_process_group_backend_for_device",
               "lightning_par.strategies.parallel picks its default process-group backend with",
               ("default_process_group_backend",),
               lambda: _params(f"{_LF}._get_default_process_group_backend_for_device", "device")),
    PrivateAPI("lightning", f"{_LF}._distributed_is_initialized",
               "lightning_par.strategies.parallel guards its barrier with",
               ("distributed_is_initialized",), lambda: _params(f"{_LF}._distributed_is_initialized")),
    PrivateAPI("lightning", f"{_LF}._sync_ddp_if_available",
               "lightning_par.strategies.parallel reduces logged tensors with",
               ("sync_ddp_if_available",),
               lambda: _params(f"{_LF}._sync_ddp_if_available", "result", "group", "reduce_op")),
    PrivateAPI("lightning", f"{_LS}.launchers.subprocess_script._SubprocessScriptLauncher",
               "lightning_par.strategies.parallel starts one process per device with",
               ("set_subprocess_launcher",),
               lambda: _params(f"{_LS}.launchers.subprocess_script._SubprocessScriptLauncher", "cluster_environment",
                               "num_processes", "num_nodes")),
    PrivateAPI("lightning", f"{_LS}.Strategy._launcher and _configure_launcher",
               "lightning_par.strategies.parallel sets (in its _configure_launcher override) to launch processes",
               ("set_subprocess_launcher",),
               lambda: (_sets(f"{_LS}.strategy.Strategy", "_launcher"), _attr(f"{_LS}.Strategy._configure_launcher"))),
    PrivateAPI("lightning", "lightning.fabric.strategies.launchers.subprocess_script._SubprocessScriptLauncher",
               "lightning_par.strategies.fabric starts one process per device with",
               ("set_fabric_subprocess_launcher",),
               lambda: (_params("lightning.fabric.strategies.launchers.subprocess_script._SubprocessScriptLauncher",
                                "cluster_environment", "num_processes", "num_nodes"),
                        _sets("lightning.fabric.strategies.strategy.Strategy", "_launcher"))),
    PrivateAPI("lightning", f"{_LF}._all_gather_ddp_if_available",
               "lightning_par.strategies.fabric gathers over the data-parallel ranks with",
               ("all_gather_ddp_if_available",),
               lambda: _params(f"{_LF}._all_gather_ddp_if_available", "tensor", "group", "sync_grads")),
    PrivateAPI("lightning", "lightning.fabric.strategies.strategy.Strategy._backward_sync_control",
               "lightning_par.strategies.fabric accumulates gradients under fabric.no_backward_sync with",
               ("set_fabric_backward_sync",),
               lambda: (_sets("lightning.fabric.strategies.strategy.Strategy", "_backward_sync_control"),
                        _params("lightning.fabric.strategies.strategy._BackwardSyncControl.no_backward_sync",
                                "self", "module", "enabled"))),
    PrivateAPI("lightning", f"{_LS}.Strategy._reset_optimizers_and_schedulers",
               "lightning_par.strategies.parallel sets optimizers up again (ZeRO shards them) with",
               ("reset_optimizers_and_schedulers",), lambda: _attr(f"{_LS}.Strategy._reset_optimizers_and_schedulers")),
    PrivateAPI("lightning", f"{_LS}.DeepSpeedStrategy._init_deepspeed_distributed",
               "benchmarks/bench_deepspeed.py runs Lightning's DeepSpeed on CPU with",
               ("init_deepspeed_distributed",), lambda: _attr(f"{_LS}.DeepSpeedStrategy._init_deepspeed_distributed")),
    PrivateAPI("lightning", f"{_LS}.DeepSpeedStrategy._setup_model_and_optimizer",
               "benchmarks/bench_deepspeed.py overrides to run Lightning's DeepSpeed on CPU",
               (), lambda: _params(f"{_LS}.DeepSpeedStrategy._setup_model_and_optimizer", "model", "optimizer")),
    # torchmetrics
    *(
        PrivateAPI("torchmetrics", f"torchmetrics.Metric.{attr}", _METRIC, ("metric_state", "set_metric_state"),
                   partial(_sets, "torchmetrics.metric.Metric", attr))
        for attr in ("_defaults", "_update_count", "_forward_cache", "_computed")
    ),
    # DeepSpeed
    PrivateAPI("deepspeed", f"{_ZERO12}.single_partition_of_fp32_groups", _ENGINE,
               ("zero_fp32_partitions",), lambda: _sets(_ZERO12, "single_partition_of_fp32_groups")),
    PrivateAPI("deepspeed", f"{_ZERO3}.fp32_partitioned_groups_flat", _ENGINE,
               ("zero_fp32_partitions", "is_zero3"), lambda: _sets(_ZERO3, "fp32_partitioned_groups_flat")),
    PrivateAPI("deepspeed", f"{_BF16}.fp32_groups_flat_partition", _ENGINE,
               ("zero_fp32_partitions",), lambda: _sets(_BF16, "fp32_groups_flat_partition")),
    PrivateAPI("deepspeed", f"{_ZERO3}.sub_group_to_group_id", _ENGINE,
               ("zero_sub_group_to_group_id",), lambda: _sets(_ZERO3, "sub_group_to_group_id")),
    PrivateAPI("deepspeed", f"{_ZERO3}.swap_optimizer",
               "lightning_par.parallel.deepspeed.state refuses NVMe-offloaded state, which it cannot load, with",
               ("zero_swaps_optimizer",), lambda: _sets(_ZERO3, "swap_optimizer")),
    PrivateAPI("deepspeed", "{DeepSpeedZeroOptimizer,BF16_Optimizer}._lazy_init_hp_params_optimizer_state and "
               "._hp_optimizer_states_linked",
               "lightning_par.parallel.deepspeed.state relinks every param group's optimizer state (else the second "
               "group's reads empty) with",
               ("zero_relink_optimizer_state",),
               lambda: [(_attr(f"{c}._lazy_init_hp_params_optimizer_state"), _sets(c, "_hp_optimizer_states_linked"))
                        for c in (_ZERO12, _BF16)]),
    PrivateAPI("deepspeed", "deepspeed.runtime.zero.partition_parameters (Parameter.ds_shape)",
               "lightning_par.parallel.deepspeed.state and strategies.deepspeed size ZeRO-3 parameters with",
               ("zero3_shape",), lambda: _sets("deepspeed.runtime.zero.partition_parameters", "ds_shape")),
)  # fmt: skip


def _version(library: str) -> str:
    try:
        return f"{library} {importlib.metadata.version(library)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{library} (not installed)"


def check(api: PrivateAPI) -> Optional[str]:
    """Probe one private API.

    Returns:
        ``None`` when it is where lightning_par expects it, else a message naming it, the installed version, what
        depends on it and the fix.
    """
    try:
        api.probe()
    except Exception as err:
        return (
            f"{_version(api.library)} moved {api.name}, which {api.used_by}; update lightning_par/_compat/ "
            f"({type(err).__name__}: {err})"
        )
    return None


def check_private_apis() -> list[str]:
    """One message (see `check`) per private API in `PRIVATE_APIS` that the installed libraries no longer have."""
    return [msg for api in PRIVATE_APIS if (msg := check(api)) is not None]
