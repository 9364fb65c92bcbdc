"""The one place lightning_par reaches private APIs of torch, Lightning, torchmetrics and DeepSpeed: a thin accessor
each, commented with its use and the version checked (torch 2.11 + 2.13, lightning 2.6.6, torchmetrics 1.9.0, deepspeed
0.19.8). ``tests/_private_apis.py`` probes each one and ``tests/test_compat.py`` fails naming the API, the installed
version and the fix when an upgrade moves it. Lightning's and torchmetrics' accessors live in `_compat/lightning.py`
and are re-exported here. Only torch is imported at module level (the lower layers never import
Lightning, and DeepSpeed is slow to import); a private torch name that is gone does not break this import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
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

# torch's DataLoader worker state (_compat/data.py), re-exported as below.
from lightning_par._compat.data import hidden_worker_info as hidden_worker_info

# Lightning's and torchmetrics' accessors (_compat/lightning.py), re-exported: callers write `_compat.<accessor>`.
from lightning_par._compat.lightning import (
    all_gather_ddp_if_available as all_gather_ddp_if_available,
)
from lightning_par._compat.lightning import (
    attached_trainer as attached_trainer,
)
from lightning_par._compat.lightning import (
    combined_loader as combined_loader,
)
from lightning_par._compat.lightning import (
    compiled_context as compiled_context,
)
from lightning_par._compat.lightning import (
    connector_flags as connector_flags,
)
from lightning_par._compat.lightning import (
    connector_precision_choice as connector_precision_choice,
)
from lightning_par._compat.lightning import (
    default_process_group_backend as default_process_group_backend,
)
from lightning_par._compat.lightning import (
    distributed_is_initialized as distributed_is_initialized,
)
from lightning_par._compat.lightning import (
    init_deepspeed_distributed as init_deepspeed_distributed,
)
from lightning_par._compat.lightning import (
    init_dist_connection as init_dist_connection,
)
from lightning_par._compat.lightning import (
    mark_saved_at as mark_saved_at,
)
from lightning_par._compat.lightning import (
    metric_state as metric_state,
)
from lightning_par._compat.lightning import (
    reset_optimizers_and_schedulers as reset_optimizers_and_schedulers,
)
from lightning_par._compat.lightning import (
    set_connector_precision_choice as set_connector_precision_choice,
)
from lightning_par._compat.lightning import (
    set_fabric_backward_sync as set_fabric_backward_sync,
)
from lightning_par._compat.lightning import (
    set_fabric_subprocess_launcher as set_fabric_subprocess_launcher,
)
from lightning_par._compat.lightning import (
    set_metric_state as set_metric_state,
)
from lightning_par._compat.lightning import (
    set_subprocess_launcher as set_subprocess_launcher,
)
from lightning_par._compat.lightning import (
    stateful_protocol as stateful_protocol,
)
from lightning_par._compat.lightning import (
    sync_ddp_if_available as sync_ddp_if_available,
)
from lightning_par._compat.lightning import (
    unbind_callback_logging as unbind_callback_logging,
)
from lightning_par._compat.lightning import (
    unwrap_optimizer as unwrap_optimizer,
)

# What the pipeline trace and the watchdog read (_compat/runtime.py), re-exported as above.
from lightning_par._compat.runtime import (
    SCHEDULE_STEP as SCHEDULE_STEP,
)
from lightning_par._compat.runtime import (
    default_store as default_store,
)
from lightning_par._compat.runtime import (
    flight_recorder as flight_recorder,
)
from lightning_par._compat.runtime import (
    fsdp_group_name as fsdp_group_name,
)
from lightning_par._compat.runtime import (
    group_sequence_number as group_sequence_number,
)
from lightning_par._compat.runtime import (
    pipeline_order as pipeline_order,
)
from lightning_par._compat.runtime import (
    pipeline_p2p_wait as pipeline_p2p_wait,
)
from lightning_par._compat.runtime import (
    schedule_rank_actions as schedule_rank_actions,
)
from lightning_par._compat.runtime import (
    schedule_stage as schedule_stage,
)
from lightning_par._compat.runtime import (
    set_pipeline_p2p_wait as set_pipeline_p2p_wait,
)


def _resolve(module: str, name: str) -> Any:
    """``module.name``, or, when this torch has no such name, a stand-in class that raises on any call."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):

        def moved(*args: Any, **kwargs: Any) -> NoReturn:
            raise ImportError(
                f"{module}.{name} is not in torch {torch.__version__}; update lightning_par/_compat/ "
                "(tests/test_compat.py lists every private API that moved)"
            )

        return type(name, (), {"__new__": staticmethod(moved)})


# ---- torch: FSDP2 -------------------------------------------------------------------------------------------------
if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
else:
    # AllGather, torch 2.11 + 2.13: the interface of a unit's all-gather that `FSDPModule.set_custom_all_gather`
    # takes (ZeRO-3's int8 weight all-gather, lightning_par.parallel.compression.quantized).
    FSDPAllGather = _resolve("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather")


# ---- torch: DTensor and DeviceMesh ------------------------------------------------------------------------------
if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
else:
    # _StridedShard, torch 2.11 + 2.13: a dim split chunk by chunk, so each tp rank holds whole heads of a fused
    # [q|k|v].
    StridedShard = _resolve("torch.distributed.tensor.placement_types", "_StridedShard")


def dtensor_local(t: DTensor) -> Tensor:
    """The local shard of ``t`` without ``to_local()``, which is an autograd call (~10 us each)."""
    # DTensor._local_tensor, torch 2.11 + 2.13: the shard a DTensor wraps.
    return t._local_tensor


def dtensor_spec(t: DTensor) -> Any:
    """The (immutable) spec of ``t``: mesh, placements, global shape and stride, for `dtensor_from_spec`."""
    # DTensor._spec, torch 2.11 + 2.13: DTensorSpec, reused to rewrap many tensors of one layout.
    return t._spec


def dtensor_from_spec(local: Tensor, spec: Any) -> DTensor:
    """Wrap ``local`` with a spec from `dtensor_spec` (~2 us, against ~20-50 us for ``DTensor.from_local``)."""
    # DTensor(local_tensor, spec, *, requires_grad), torch 2.11 + 2.13: the constructor torch's own ops use.
    return DTensor(local, spec, requires_grad=False)


def dtensor_like(local: Tensor, like: DTensor) -> DTensor:
    """Wrap ``local`` as a DTensor of ``like``'s layout: the private constructor, or ``from_local`` if it changed."""
    # DTensor(local_tensor, spec, *, requires_grad) and DTensor._spec, torch 2.11 + 2.13; from_local is the fallback.
    try:
        return DTensor(local, like._spec, requires_grad=False)
    except TypeError:  # another constructor signature: the public, slower way
        mesh, placements = like.device_mesh, like.placements
        return DTensor.from_local(local, mesh, placements, shape=like.shape, stride=like.stride(), run_check=False)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """All axes of ``mesh`` as one axis called ``name`` (over the same ranks)."""
    # DeviceMesh._flatten, torch 2.11 + 2.13: the one way torch offers to merge mesh axes into one.
    return mesh._flatten(name)


# ---- torch: collectives ------------------------------------------------------------------------------------------
# dist.reduce_scatter_single / all_gather_single, torch 2.11 + 2.13: the flat-tensor collectives, renamed in 2.13;
# older releases only have the *_tensor names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# torch.ops._c10d_functional, torch 2.11 + 2.13: the namespace of the functional collectives DTensor redistributes with.
C10D_FUNCTIONAL = "_c10d_functional"


def c10d_functional_ops() -> Any:
    """``torch.ops._c10d_functional``: its ops are what a dispatch mode sees of DTensor's collectives."""
    return getattr(torch.ops, C10D_FUNCTIONAL)


def op_name(func: Any) -> str:
    """``namespace::name`` of an op overload seen by a dispatch mode, without the overload (``aten::mm``); ``""``
    for a callable that is not an op overload."""
    # OpOverload._schema, torch 2.11 + 2.13: the op's schema; its name has no overload suffix.
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else ""


# ---- torch: nn.Module, Tensor and storage internals --------------------------------------------------------------
def tensor_version(t: Tensor) -> int:
    """``t``'s in-place version counter: it moves on every in-place change to ``t`` or a view of it."""
    return t._version  # Tensor._version, torch 2.11 + 2.13: what autograd checks saved tensors with


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of ``storage`` that all tensors viewing it share (``data_ptr`` is 0 for empty storages)."""
    # UntypedStorage._cdata, torch 2.11 + 2.13: the address of the C++ StorageImpl.
    return storage._cdata


if TYPE_CHECKING:
    from torch.multiprocessing.reductions import StorageWeakRef
else:
    # StorageWeakRef, torch 2.11 + 2.13 (torch.multiprocessing.reductions): a weak reference to a storage.
    StorageWeakRef = _resolve("torch.multiprocessing.reductions", "StorageWeakRef")


def module_parameters(module: nn.Module) -> dict[str, Optional[nn.Parameter]]:
    """The parameters registered directly on ``module`` by name, ``None`` entries included."""
    return module._parameters  # Module._parameters, torch 2.11 + 2.13


def set_child_module(parent: nn.Module, name: str, child: nn.Module) -> None:
    """Put ``child`` in ``parent``'s slot ``name`` without ``__setattr__``'s checks (keeps registration order)."""
    # Module._modules, torch 2.11 + 2.13.
    parent._modules[name] = child


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (left out of its state dict)."""
    # Module._non_persistent_buffers_set, torch 2.11 + 2.13.
    return module._non_persistent_buffers_set


def apply_to_tensors(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    """``fn`` on every parameter and buffer of ``module``, as ``to_empty`` does (FSDP2 units re-link their shards)."""
    module._apply(fn)  # Module._apply, torch 2.11 + 2.13


# ---- torch: AMP --------------------------------------------------------------------------------------------------
def amp_unscale_and_check_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place; set ``found_inf`` to 1 on inf/nan."""
    # torch._amp_foreach_non_finite_check_and_unscale_, torch 2.11 + 2.13: GradScaler's own fused kernel.
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


class GradScalerUnscaleHook(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose per-optimizer unscale and inf/nan check is the overridable `unscale_grads`."""

    # GradScaler._unscale_grads_, torch 2.11 + 2.13: what unscale_() calls once per optimizer.
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
    # torch.utils._pytree, torch 2.11 + 2.13: flatten nested batches and outputs (lists, tuples, dicts) to tensors.
    tree_flatten = _resolve("torch.utils._pytree", "tree_flatten")
    tree_unflatten = _resolve("torch.utils._pytree", "tree_unflatten")
    tree_leaves = _resolve("torch.utils._pytree", "tree_leaves")
    tree_map_only = _resolve("torch.utils._pytree", "tree_map_only")
    # TorchDispatchMode, torch 2.11 + 2.13 (torch.utils._python_dispatch): sees every op, inside checkpointed
    # regions too.
    TorchDispatchMode = _resolve("torch.utils._python_dispatch", "TorchDispatchMode")


# ---- torch: optimizer hooks -----------------------------------------------------------------------------------
def step_post_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many hooks run after ``optimizer.step()``: its own and the global ones."""
    # Optimizer._optimizer_step_post_hooks and torch.optim.optimizer._global_optimizer_post_hooks, torch 2.11 + 2.13.
    from torch.optim.optimizer import _global_optimizer_post_hooks

    return len(optimizer._optimizer_step_post_hooks) + len(_global_optimizer_post_hooks)  # type: ignore[attr-defined]


def run_step_post_hook_first(optimizer: torch.optim.Optimizer, handle: Any) -> None:
    """Make the post-hook behind ``handle`` the first of ``optimizer``'s (an ordered dict keyed by handle id)."""
    optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)  # type: ignore[attr-defined]


# ---- torch: fused copies --------------------------------------------------------------------------------------
def foreach_copy(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, in one call (torch._foreach_copy_, torch 2.11 + 2.13; what FSDP2 uses)."""
    torch._foreach_copy_(list(dst), list(src))


def chunk_cat(tensors: Sequence[Tensor], world: int, out: Tensor) -> None:
    """Cut each tensor into ``world`` chunks along dim 0 (ceil rows each, zero-padded) and write chunk j of every
    tensor, in order, to row j of ``out`` (``world`` x the padded sizes' sum): the rank-major layout in one op
    (torch._chunk_cat, torch 2.11 + 2.13; FSDP2 packs its reduce-scatter input with it)."""
    torch._chunk_cat(list(tensors), 0, world, out=out)


# ---- torch: distributed checkpoint -------------------------------------------------------------------------------
def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state with one zero-gradient, zero-learning-rate step (DCP loads into it)."""
    # torch.distributed.checkpoint.state_dict._init_optim_state, torch 2.11 + 2.13.
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# Private globals that DCP's index (.metadata) pickles, torch 2.11 + 2.13; the checkpoint reader allows them by name.
DCP_INDEX_PRIVATE_GLOBALS = (
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
)


class FileSystemReaderSliceHook(FileSystemReader):
    """DCP's `FileSystemReader` that calls `before_slice` with each item's file location before reading it."""

    # FileSystemReader._slice_file(file, sinfo), torch 2.11 + 2.13: called for each item just before its bytes are read.
    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.before_slice(sinfo)
        return super()._slice_file(file, sinfo)

    def before_slice(self, sinfo: Any) -> None:
        """Called with the item's ``_StorageInfo`` (``relative_path``, ``offset``, ``length``)."""


# ---- torch: tensor-parallel styles -------------------------------------------------------------------------------
class ColwiseParallelHook(ColwiseParallel):
    """torch's `ColwiseParallel` whose sharding is the overridable `distribute`, with its input hook `prepare_input`."""

    # ParallelStyle._apply(module, device_mesh), torch 2.11 + 2.13: what parallelize_module calls for each style.
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self.distribute(module, device_mesh)

    def distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Shard ``module`` over ``device_mesh`` (torch's column split by default)."""
        return super()._apply(module, device_mesh)

    def prepare_input(self) -> Callable[..., Any]:
        """ColwiseParallel's input hook bound to this style's layouts: ``fn(module, inputs, mesh)``."""
        # ColwiseParallel._prepare_input_fn, torch 2.11 + 2.13: a static method that takes the two layouts first.
        return partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)  # type: ignore[arg-type]


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
