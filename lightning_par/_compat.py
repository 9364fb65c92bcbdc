"""The one place lightning_par reaches private APIs of torch, Lightning, torchmetrics and DeepSpeed.

Each private API is a thin accessor here, commented with what it is for and the version it was checked against
(torch 2.13.0, lightning 2.6.6, torchmetrics 1.9.0, deepspeed 0.19.8). `PRIVATE_APIS` lists them with what in
lightning_par depends on each, and `check_private_apis` probes them: ``tests/test_compat.py`` turns every probe
into a test, so an upgrade that moves one fails there with the fix, not deep inside a training run.

Only torch is imported at module level: ``parallel/``, ``plans/``, ``mesh.py`` and ``config.py`` never import
Lightning, and DeepSpeed takes seconds to import, so both (and torchmetrics) are imported inside the accessors
that need them. A private torch name that is gone does not break this import (`_resolve`), so the checks can still
run and name it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel


def _resolve(module: str, name: str) -> Any:
    """``module.name``, or, when this torch has no such name, a stand-in class that raises on any call."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):

        def moved(*args: Any, **kwargs: Any) -> NoReturn:
            raise ImportError(
                f"{module}.{name} is not in torch {torch.__version__}; update lightning_par/_compat.py "
                "(tests/test_compat.py lists every private API that moved)"
            )

        return type(name, (), {"__new__": staticmethod(moved)})


# ---- torch: DTensor and DeviceMesh ------------------------------------------------------------------------------
if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
else:
    # _StridedShard, torch 2.13.0: a dim split chunk by chunk, so each tp rank holds whole heads of a fused [q|k|v].
    StridedShard = _resolve("torch.distributed.tensor.placement_types", "_StridedShard")


def dtensor_local(t: DTensor) -> Tensor:
    """The local shard of ``t`` without ``to_local()``, which is an autograd call (~10 us each)."""
    # DTensor._local_tensor, torch 2.13.0: the shard a DTensor wraps.
    return t._local_tensor


def dtensor_spec(t: DTensor) -> Any:
    """The (immutable) spec of ``t``: mesh, placements, global shape and stride, for `dtensor_from_spec`."""
    # DTensor._spec, torch 2.13.0: DTensorSpec, reused to rewrap many tensors of one layout.
    return t._spec


def dtensor_from_spec(local: Tensor, spec: Any) -> DTensor:
    """Wrap ``local`` with a spec from `dtensor_spec` (~2 us, against ~20-50 us for ``DTensor.from_local``)."""
    # DTensor(local_tensor, spec, *, requires_grad), torch 2.13.0: the constructor torch's own ops use.
    return DTensor(local, spec, requires_grad=False)


def dtensor_like(local: Tensor, like: DTensor) -> DTensor:
    """Wrap ``local`` as a DTensor of ``like``'s layout: the private constructor, or ``from_local`` if it changed."""
    # DTensor(local_tensor, spec, *, requires_grad) and DTensor._spec, torch 2.13.0; from_local is the fallback.
    try:
        return DTensor(local, like._spec, requires_grad=False)
    except TypeError:  # another constructor signature: the public, slower way
        mesh, placements = like.device_mesh, like.placements
        return DTensor.from_local(local, mesh, placements, shape=like.shape, stride=like.stride(), run_check=False)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """All axes of ``mesh`` as one axis called ``name`` (over the same ranks)."""
    # DeviceMesh._flatten, torch 2.13.0: the one way torch offers to merge mesh axes into one.
    return mesh._flatten(name)


# ---- torch: collectives ------------------------------------------------------------------------------------------
# dist.reduce_scatter_single / all_gather_single, torch 2.13.0: the flat-tensor collectives, renamed in 2.13;
# older releases only have the *_tensor names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# torch.ops._c10d_functional, torch 2.13.0: the namespace of the functional collectives DTensor redistributes with.
C10D_FUNCTIONAL = "_c10d_functional"


def c10d_functional_ops() -> Any:
    """``torch.ops._c10d_functional``: its ops are what a dispatch mode sees of DTensor's collectives."""
    return getattr(torch.ops, C10D_FUNCTIONAL)


def op_name(func: Any) -> str:
    """``namespace::name`` of an op overload seen by a dispatch mode, without the overload (``aten::mm``)."""
    # OpOverload._schema, torch 2.13.0: the op's schema; its name has no overload suffix.
    return func._schema.name


# ---- torch: nn.Module, Tensor and storage internals --------------------------------------------------------------
def tensor_version(t: Tensor) -> int:
    """``t``'s in-place version counter: it moves on every in-place change to ``t`` or a view of it."""
    # Tensor._version, torch 2.13.0: what autograd checks saved tensors with.
    return t._version


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of ``storage`` that all tensors viewing it share (``data_ptr`` is 0 for empty storages)."""
    # UntypedStorage._cdata, torch 2.13.0: the address of the C++ StorageImpl.
    return storage._cdata


if TYPE_CHECKING:
    from torch.multiprocessing.reductions import StorageWeakRef
else:
    # StorageWeakRef, torch 2.13.0 (torch.multiprocessing.reductions): a weak reference to a storage.
    StorageWeakRef = _resolve("torch.multiprocessing.reductions", "StorageWeakRef")


def module_parameters(module: nn.Module) -> dict[str, Optional[nn.Parameter]]:
    """The parameters registered directly on ``module`` by name, ``None`` entries included."""
    # Module._parameters, torch 2.13.0.
    return module._parameters


def set_child_module(parent: nn.Module, name: str, child: nn.Module) -> None:
    """Put ``child`` in ``parent``'s slot ``name`` without ``__setattr__``'s checks (keeps registration order)."""
    # Module._modules, torch 2.13.0.
    parent._modules[name] = child


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (left out of its state dict)."""
    # Module._non_persistent_buffers_set, torch 2.13.0.
    return module._non_persistent_buffers_set


# ---- torch: AMP --------------------------------------------------------------------------------------------------
def amp_unscale_and_check_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place; set ``found_inf`` to 1 on inf/nan."""
    # torch._amp_foreach_non_finite_check_and_unscale_, torch 2.13.0: GradScaler's own fused kernel.
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


class GradScalerUnscaleHook(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose per-optimizer unscale and inf/nan check is the overridable `unscale_grads`."""

    # GradScaler._unscale_grads_, torch 2.13.0: what unscale_() calls once per optimizer.
    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        return self.unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        """Unscale ``optimizer``'s gradients in place; return ``{device: found_inf}`` (torch's own by default)."""
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


# ---- torch: pytree and dispatch ----------------------------------------------------------------------------------
if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten
else:
    # torch.utils._pytree, torch 2.13.0: flatten nested batches and outputs (lists, tuples, dicts) to tensors.
    tree_flatten = _resolve("torch.utils._pytree", "tree_flatten")
    tree_unflatten = _resolve("torch.utils._pytree", "tree_unflatten")
    tree_leaves = _resolve("torch.utils._pytree", "tree_leaves")
    tree_map_only = _resolve("torch.utils._pytree", "tree_map_only")
    # TorchDispatchMode, torch 2.13.0 (torch.utils._python_dispatch): sees every op, inside checkpointed regions too.
    TorchDispatchMode = _resolve("torch.utils._python_dispatch", "TorchDispatchMode")


# ---- torch: distributed checkpoint -------------------------------------------------------------------------------
def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state with one zero-gradient, zero-learning-rate step (DCP loads into it)."""
    # torch.distributed.checkpoint.state_dict._init_optim_state, torch 2.13.0.
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# Private globals that DCP's index (.metadata) pickles, torch 2.13.0; the checkpoint reader allows them by name.
DCP_INDEX_PRIVATE_GLOBALS = (
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
)


class FileSystemReaderSliceHook(FileSystemReader):
    """DCP's `FileSystemReader` that calls `before_slice` with each item's file location before reading it."""

    # FileSystemReader._slice_file(file, sinfo), torch 2.13.0: called for each item just before its bytes are read.
    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.before_slice(sinfo)
        return super()._slice_file(file, sinfo)

    def before_slice(self, sinfo: Any) -> None:
        """Called with the item's ``_StorageInfo`` (``relative_path``, ``offset``, ``length``)."""


# ---- torch: tensor-parallel styles -------------------------------------------------------------------------------
class ColwiseParallelHook(ColwiseParallel):
    """torch's `ColwiseParallel` whose sharding is the overridable `distribute`, with its input hook `prepare_input`."""

    # ParallelStyle._apply(module, device_mesh), torch 2.13.0: what parallelize_module calls for each style.
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self.distribute(module, device_mesh)

    def distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Shard ``module`` over ``device_mesh`` (torch's column split by default)."""
        return super()._apply(module, device_mesh)

    def prepare_input(self) -> Callable[..., Any]:
        """ColwiseParallel's input hook bound to this style's layouts: ``fn(module, inputs, mesh)``."""
        # ColwiseParallel._prepare_input_fn, torch 2.13.0: a static method that takes the two layouts first.
        return partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)  # type: ignore[arg-type]


# ---- torch: pipelining (benchmarks) ------------------------------------------------------------------------------
def pipeline_p2p_wait() -> Callable[[list[Any]], None]:
    """The function every torch pipeline schedule waits on its point-to-point transfers through."""
    # torch.distributed.pipelining.schedules._wait_batch_p2p, torch 2.13.0.
    from torch.distributed.pipelining import schedules

    return schedules._wait_batch_p2p


def set_pipeline_p2p_wait(fn: Callable[[list[Any]], None]) -> None:
    """Make every torch pipeline schedule wait on its transfers through ``fn`` (see `pipeline_p2p_wait`)."""
    from torch.distributed.pipelining import schedules

    schedules._wait_batch_p2p = fn  # type: ignore[assignment]


def pipeline_order(schedule: Any) -> dict[int, list[Any]]:
    """A torch schedule's action table ``{rank: [action or None, ...]}``, as `parallel.pipeline_timeline` replays."""
    # PipelineSchedule*.pipeline_order, torch 2.13.0: set in __init__, undocumented.
    return schedule.pipeline_order


# ---- Lightning ---------------------------------------------------------------------------------------------------
def connector_precision_choice() -> Callable[[Any], Any]:
    """The method with which Lightning's accelerator connector picks the precision plugin (see `set_...`)."""
    # _AcceleratorConnector._check_and_init_precision, lightning 2.6.6: no hook for third-party strategies there.
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return _AcceleratorConnector._check_and_init_precision


def set_connector_precision_choice(method: Callable[[Any], Any]) -> None:
    """Replace the connector's precision choice (`connector_precision_choice`) for every later Trainer."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    _AcceleratorConnector._check_and_init_precision = method  # type: ignore[method-assign, assignment]


def connector_flags(connector: Any) -> tuple[Any, Any, Any]:
    """The Trainer's precision plugin, ``accelerator`` and ``precision`` arguments, as its connector holds them."""
    # _AcceleratorConnector._precision_plugin_flag / _accelerator_flag / _precision_flag, lightning 2.6.6.
    return connector._precision_plugin_flag, connector._accelerator_flag, connector._precision_flag


def stateful_protocol() -> type:
    """Lightning's protocol of objects with ``state_dict`` / ``load_state_dict``: a loader it can resume mid-epoch."""
    # lightning.fabric.utilities.types._Stateful, lightning 2.6.6 (a runtime-checkable Protocol).
    from lightning.fabric.utilities.types import _Stateful

    return _Stateful


def combined_loader(trainer: Any) -> Optional[Any]:
    """The fit loop's `CombinedLoader` over the training loaders, or ``None`` before fit set it up."""
    # _FitLoop._combined_loader, lightning 2.6.6.
    return getattr(trainer.fit_loop, "_combined_loader", None)


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or ``None`` (``module.trainer`` raises when detached)."""
    # LightningModule._trainer, lightning 2.6.6.
    return getattr(module, "_trainer", None)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a `LightningOptimizer`, or ``optimizer`` itself."""
    # LightningOptimizer._optimizer, lightning 2.6.6.
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Initialize the default process group from a Lightning cluster environment; ``kwargs`` go to torch."""
    # lightning.fabric.utilities.distributed._init_dist_connection, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_process_group_backend(device: torch.device) -> str:
    """Lightning's process-group backend for ``device`` (``"nccl"`` on CUDA, ``"gloo"`` otherwise)."""
    # lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def distributed_is_initialized() -> bool:
    """Whether torch.distributed is available and its default process group initialized."""
    # lightning.fabric.utilities.distributed._distributed_is_initialized, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    return _distributed_is_initialized()


def sync_ddp_if_available(tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = None) -> Tensor:
    """All-reduce ``tensor`` over ``group`` with Lightning's ``reduce_op`` names (``"mean"``), if distributed."""
    # lightning.fabric.utilities.distributed._sync_ddp_if_available, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def set_subprocess_launcher(strategy: Any) -> None:
    """Give ``strategy`` Lightning's launcher that re-runs the script once per local rank (as DDP's does)."""
    # _SubprocessScriptLauncher and Strategy._launcher, lightning 2.6.6.
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Forget ``strategy``'s optimizers, schedulers and their Lightning wrappers, before it sets them up again."""
    # Strategy._reset_optimizers_and_schedulers, lightning 2.6.6.
    strategy._reset_optimizers_and_schedulers()


def init_deepspeed_distributed(strategy: Any) -> None:
    """Initialize DeepSpeed's process group the way Lightning's `DeepSpeedStrategy` does (benchmarks)."""
    # DeepSpeedStrategy._init_deepspeed_distributed, lightning 2.6.6.
    strategy._init_deepspeed_distributed()


# ---- torchmetrics ------------------------------------------------------------------------------------------------
def metric_state(metric: Any) -> dict[str, Any]:
    """What a `torchmetrics.Metric` has accumulated: its states, update count and last forward value."""
    # Metric._defaults / _update_count / _forward_cache, torchmetrics 1.9.0.
    return {
        "state": {k: getattr(metric, k) for k in metric._defaults},
        "update_count": metric._update_count,
        "forward_cache": metric._forward_cache,
    }


def set_metric_state(metric: Any, data: dict[str, Any]) -> None:
    """Install a `metric_state` into ``metric`` (another rank's), dropping its cached ``compute()`` result."""
    # Metric._update_count / _forward_cache / _computed, torchmetrics 1.9.0.
    for k, v in data["state"].items():
        setattr(metric, k, v)
    metric._update_count = data["update_count"]
    metric._forward_cache = data["forward_cache"]
    metric._computed = None


# ---- DeepSpeed ---------------------------------------------------------------------------------------------------
# Attributes of DeepSpeed's ZeRO 1/2, ZeRO-3 and bf16 optimizer wrappers that hold the flat fp32 partitions the inner
# optimizer steps on, deepspeed 0.19.8 (public names, undocumented).
_FP32_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def zero_fp32_partitions(optimizer: Any) -> Optional[Sequence[Tensor]]:
    """The flat fp32 partitions a DeepSpeed optimizer wrapper steps on, or ``None`` (plain fp32 ZeRO-0)."""
    for attr in _FP32_PARTITIONS:
        flats = getattr(optimizer, attr, None)
        if flats is not None:
            return flats
    return None


def is_zero3(wrapper: Any) -> bool:
    """Whether a DeepSpeed optimizer wrapper is ZeRO-3's (parameters partitioned too)."""
    # DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat, deepspeed 0.19.8.
    return getattr(wrapper, "fp32_partitioned_groups_flat", None) is not None


def zero_swaps_optimizer(wrapper: Any) -> bool:
    """Whether ZeRO-3 keeps the optimizer state on NVMe and swaps it in and out."""
    # DeepSpeedZeroOptimizer_Stage3.swap_optimizer, deepspeed 0.19.8.
    return getattr(wrapper, "swap_optimizer", False)


def zero_sub_group_to_group_id(wrapper: Any) -> Optional[Sequence[int]]:
    """ZeRO-3's param group index of each flat partition (it splits groups into sub-groups), or ``None``."""
    # DeepSpeedZeroOptimizer_Stage3.sub_group_to_group_id, deepspeed 0.19.8.
    return getattr(wrapper, "sub_group_to_group_id", None)


def zero_relink_optimizer_state(wrapper: Any) -> None:
    """Relink each parameter to its slice of the optimizer state (ZeRO 1/2 and bf16; a no-op elsewhere)."""
    # _lazy_init_hp_params_optimizer_state and _hp_optimizer_states_linked of DeepSpeedZeroOptimizer and
    # BF16_Optimizer, deepspeed 0.19.8: linked once, after the first step; the flag makes it link again.
    relink = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if relink is not None and wrapper is not None:
        wrapper._hp_optimizer_states_linked = False
        relink()


def zero3_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's full shape: ZeRO-3 parameters are empty placeholders that keep it in ``ds_shape``."""
    # Parameter.ds_shape (set by deepspeed.runtime.zero.partition_parameters), deepspeed 0.19.8.
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


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


def _params(path: str, *names: str) -> Any:
    """The callable at ``path``; fails unless it takes parameters ``names``."""
    fn = _attr(path)
    have = inspect.signature(fn).parameters
    if any(n not in have for n in names):
        raise TypeError(f"it takes ({', '.join(have)}), lightning_par passes ({', '.join(names)})")
    return fn


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
_ENGINE = "lightning_par.parallel.deepspeed_state finds DeepSpeed's fp32 partitions (checkpoints) with"
_METRIC = "lightning_par.strategies._pipeline sends metrics from the last pipeline stage to the others with"
_TREE = "lightning_par.parallel.pipeline(_schedule), utils.memory, strategies._pipeline walk batches and outputs with"

# One entry per private API; the accessors are this module's names that reach it.
PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # torch: DTensor and DeviceMesh
    PrivateAPI("torch", f"{_DT}.placement_types._StridedShard",
               "lightning_par.parallel.tensor_parallel shards fused [q|k|v] projections with (checkpoint.strided, "
               "parallel.zero_replicated read it)",
               ("StridedShard",), lambda: _params(f"{_DT}.placement_types._StridedShard", "dim", "split_factor")),
    PrivateAPI("torch", f"{_DT}.DTensor._local_tensor",
               "lightning_par.checkpoint.async_save and strategies._checkpointing read shards without autograd with",
               ("dtensor_local",), lambda: _slots(f"{_DT}.DTensor", "_local_tensor")),
    PrivateAPI("torch", f"{_DT}.DTensor._spec",
               "lightning_par.parallel.zero_replicated and checkpoint.async_save rewrap state and staged shards with",
               ("dtensor_spec", "dtensor_like"), lambda: _slots(f"{_DT}.DTensor", "_spec")),
    PrivateAPI("torch", f"{_DT}.DTensor(local_tensor, spec, *, requires_grad)",
               "lightning_par.parallel.zero_replicated wraps optimizer state for DCP with (checkpoint.async_save "
               "falls back to DTensor.from_local)",
               ("dtensor_from_spec", "dtensor_like"), _dtensor_constructor),
    PrivateAPI("torch", f"{_D}.device_mesh.DeviceMesh._flatten",
               "lightning_par.mesh builds the flat dp axis (loss averaging, sampler, metrics) with",
               ("flatten_mesh",), lambda: _params(f"{_D}.device_mesh.DeviceMesh._flatten", "mesh_dim_name")),
    # torch: collectives
    PrivateAPI("torch", f"{_D}.reduce_scatter_single (or reduce_scatter_tensor)",
               "lightning_par.parallel.zero_replicated reduces ZeRO-1/2 gradient buckets with",
               ("reduce_scatter_single",),
               lambda: getattr(dist, "reduce_scatter_single", None) or _attr(f"{_D}.reduce_scatter_tensor")),
    PrivateAPI("torch", f"{_D}.all_gather_single (or all_gather_into_tensor)",
               "lightning_par.parallel.zero_replicated gathers ZeRO-1/2 parameter shards with",
               ("all_gather_single",),
               lambda: getattr(dist, "all_gather_single", None) or _attr(f"{_D}.all_gather_into_tensor")),
    PrivateAPI("torch", "torch.ops._c10d_functional.reduce_scatter_tensor",
               "lightning_par.parallel.activation_checkpointing saves under 'selective_op' (and "
               "benchmarks/bench_tensor_parallel.py counts)",
               ("C10D_FUNCTIONAL", "c10d_functional_ops"), lambda: c10d_functional_ops().reduce_scatter_tensor.default),
    PrivateAPI("torch", "torch._ops.OpOverload._schema",
               "benchmarks/bench_tensor_parallel.py names the ops it counts with",
               ("op_name",), lambda: op_name(torch.ops.aten.mm.default)),
    # torch: nn.Module, Tensor and storage internals
    PrivateAPI("torch", "torch.Tensor._version",
               "lightning_par.checkpoint.async_save detects tensors changed during a background copy with",
               ("tensor_version",), lambda: int(tensor_version(torch.empty(1)))),
    PrivateAPI("torch", "torch.UntypedStorage._cdata",
               "lightning_par.utils.memory.LiveStorageBytes tells storages apart with",
               ("storage_id",), lambda: int(storage_id(torch.empty(1).untyped_storage()))),
    PrivateAPI("torch", "torch.multiprocessing.reductions.StorageWeakRef",
               "lightning_par.utils.memory.LiveStorageBytes sees storages die with",
               ("StorageWeakRef",), lambda: _attr("torch.multiprocessing.reductions.StorageWeakRef.expired")),
    PrivateAPI("torch", "torch.nn.Module._parameters",
               "lightning_par.parallel.pipeline finds the modules outside the trunk that own parameters with",
               ("module_parameters",), lambda: dict(module_parameters(nn.Module()))),
    PrivateAPI("torch", "torch.nn.Module._modules",
               "lightning_par.parallel.pipeline swaps blocks for stage stand-ins with",
               ("set_child_module",), lambda: set_child_module(nn.Module(), "x", nn.Module())),
    PrivateAPI("torch", "torch.nn.Module._non_persistent_buffers_set",
               "lightning_par.parallel.deepspeed_state leaves non-persistent buffers out of checkpoints with",
               ("non_persistent_buffers",), lambda: set(non_persistent_buffers(nn.Module()))),
    # Overridden in lightning_par/models/llama.py itself: models/ imports nothing from lightning_par (test_models.py).
    PrivateAPI("torch", "torch.nn.Module._apply",
               "lightning_par.models.Llama overrides to rebuild its rope table after .to() and to_empty()",
               (), lambda: _params("torch.nn.Module._apply", "fn", "recurse")),
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
        for module, name in DCP_INDEX_PRIVATE_GLOBALS
    ),
    # torch: tensor-parallel styles
    PrivateAPI("torch", f"{_DT}.parallel.ColwiseParallel._apply",
               "lightning_par.parallel.tensor_parallel overrides to shard fused [q|k|v] projections",
               ("ColwiseParallelHook",),
               lambda: _params(f"{_DT}.parallel.ColwiseParallel._apply", "module", "device_mesh")),
    PrivateAPI("torch", f"{_DT}.parallel.ColwiseParallel._prepare_input_fn",
               "lightning_par.parallel.tensor_parallel prepares the inputs of fused projections with",
               ("ColwiseParallelHook",),
               lambda: _params(f"{_DT}.parallel.ColwiseParallel._prepare_input_fn", "input_layouts",
                               "desired_input_layouts", "mod", "inputs", "device_mesh")),
    # torch: pipelining
    PrivateAPI("torch", f"{_PS}._wait_batch_p2p",
               "benchmarks/bench_pipeline_bubble.py times the waits on peers by wrapping",
               ("pipeline_p2p_wait", "set_pipeline_p2p_wait"), lambda: _params(f"{_PS}._wait_batch_p2p", "work")),
    PrivateAPI("torch", f"{_PS}.PipelineSchedule{{Single,Multi}}.pipeline_order",
               "benchmarks/bench_pipeline_bubble.py replays (lightning_par.parallel.pipeline_timeline) for theory",
               ("pipeline_order",),
               lambda: [_sets(f"{_PS}.PipelineSchedule{kind}", "pipeline_order") for kind in ("Single", "Multi")]),
    PrivateAPI("torch", f"{_PS}._Action",
               "lightning_par.parallel.pipeline_timeline reads (stage_index, computation_type, microbatch_index, "
               "sub_actions) of",
               (), lambda: _fields(f"{_PS}._Action", "stage_index", "computation_type", "microbatch_index",
                                   "sub_actions")),
    PrivateAPI("torch", f"{_PS}.Schedule1F1B._step_microbatches",
               "lightning_par.parallel.pipeline_timeline.one_f_one_b_order copies the order of (check the copy)",
               (), lambda: _attr(f"{_PS}.Schedule1F1B._step_microbatches")),
    # Lightning
    PrivateAPI("lightning", f"{_CONNECTOR}._check_and_init_precision",
               "lightning_par.precision._connector wraps so our strategies choose their precision plugin",
               ("connector_precision_choice", "set_connector_precision_choice"),
               lambda: _attr(f"{_CONNECTOR}._check_and_init_precision")),
    PrivateAPI("lightning", f"{_CONNECTOR}._precision_plugin_flag, _accelerator_flag, _precision_flag",
               "lightning_par.precision._connector reads the Trainer's precision arguments with",
               ("connector_flags",),
               lambda: _sets(_CONNECTOR, "_precision_plugin_flag", "_accelerator_flag", "_precision_flag")),
    PrivateAPI("lightning", "lightning.fabric.utilities.types._Stateful",
               "lightning_par.checkpoint.resume_state leaves the loaders Lightning resumes itself alone with",
               ("stateful_protocol",), lambda: _attr("lightning.fabric.utilities.types._Stateful.state_dict")),
    PrivateAPI("lightning", "lightning.pytorch.loops.fit_loop._FitLoop._combined_loader",
               "lightning_par.checkpoint.resume_state finds the training loaders (data position, loader RNG) with",
               ("combined_loader",), lambda: _sets("lightning.pytorch.loops.fit_loop._FitLoop", "_combined_loader")),
    PrivateAPI("lightning", "lightning.pytorch.LightningModule._trainer",
               "lightning_par.strategies._checkpointing finds the Trainer of a possibly detached module with",
               ("attached_trainer",), lambda: _sets("lightning.pytorch.core.module.LightningModule", "_trainer")),
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
               "lightning_par.parallel.deepspeed_state refuses NVMe-offloaded state, which it cannot load, with",
               ("zero_swaps_optimizer",), lambda: _sets(_ZERO3, "swap_optimizer")),
    PrivateAPI("deepspeed", "{DeepSpeedZeroOptimizer,BF16_Optimizer}._lazy_init_hp_params_optimizer_state and "
               "._hp_optimizer_states_linked",
               "lightning_par.parallel.deepspeed_state relinks every param group's optimizer state (else the second "
               "group's reads empty) with",
               ("zero_relink_optimizer_state",),
               lambda: [(_attr(f"{c}._lazy_init_hp_params_optimizer_state"), _sets(c, "_hp_optimizer_states_linked"))
                        for c in (_ZERO12, _BF16)]),
    PrivateAPI("deepspeed", "deepspeed.runtime.zero.partition_parameters (Parameter.ds_shape)",
               "lightning_par.parallel.deepspeed_state and strategies.deepspeed size ZeRO-3 parameters with",
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
            f"{_version(api.library)} moved {api.name}, which {api.used_by}; update lightning_par/_compat.py "
            f"({type(err).__name__}: {err})"
        )
    return None


def check_private_apis() -> list[str]:
    """One message (see `check`) per private API in `PRIVATE_APIS` that the installed libraries no longer have."""
    return [msg for api in PRIVATE_APIS if (msg := check(api)) is not None]
