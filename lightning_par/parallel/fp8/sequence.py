"""fp8's all-gather of sequence-parallel region inputs: the hidden state cast before the gather, one byte a value.

Under tensor parallelism with sequence parallelism each split region (attention, MLP) all-gathers its input along
the sequence (`lightning_par.parallel.tensor.sequence.region_input`). Where every reader of that input is an fp8
projection, the cast each projection would make after the gather can be made once before it, with the scale of the
whole tensor (its amax all-reduced over tp), and the gather then moves fp8 bytes: torchao's design
(``PrepareFloat8ModuleInput`` / ``Float8ColwiseParallel``, torchao.float8.float8_tensor_parallel). The projections
multiply the same fp8 values with the same scale either way, so the result does not change (bitwise,
tests/test_fp8.py); the backward reduce-scatters the input gradient in the training precision, as before. torchao's
own gather all-gathers float8 tensors, which gloo cannot; this one gathers their bytes (as `gather` does for ZeRO-3).

Which regions: one probe forward before tp (`gather_ready`) watches each split region's input. A region whose
input any torch call reads outside the region's fp8 projections (a norm, an adapter, a projection kept in the
training precision, a reshape before the projection), other than for its shape, keeps the training-precision
gather, so a Float8 tensor never reaches code that cannot take it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.blocks._probe import watched_probe
from lightning_par.parallel.fp8.convert import folded
from lightning_par.parallel.tensor.plan_types import HeadInfo, MLPInfo, TPPlan
from lightning_par.parallel.tensor.sequence import Gather, first_hidden

__all__ = ["fp8_gathers", "gather_note", "gather_ready"]

_SEQ = 1
_SHAPE_ONLY = ("__get__", "size", "dim", "numel")  # reads of a tensor's metadata, not its values


class _Fp8SequenceGather(torch.autograd.Function):
    """This rank's sequence shard -> the whole sequence in fp8, replicated; backward: the input gradient's partial
    sums reduce-scattered over tp, in the input's precision."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Any, mesh: DeviceMesh, length: int) -> Any:  # type: ignore[override]
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        ctx.mesh, ctx.dtype, ctx.rows = mesh, x.dtype, x.shape[_SEQ]
        hp = x.to(torch.get_autocast_dtype("cuda")) if torch.is_autocast_enabled() else x  # as Float8Linear does
        f8 = hp_tensor_to_float8_dynamic(
            hp, layer.config.cast_config_input.target_dtype, layer.linear_mm_config, reduce_amax=True,
            gemm_input_role=GemmInputRole.INPUT, device_mesh=mesh,
            round_scales_to_power_of_2=layer.config.round_scales_to_power_of_2,
        )  # fmt: skip
        data = f8._data.contiguous().view(torch.uint8)  # gloo has no float8 dtypes; NCCL takes the bytes alike
        n = mesh.size()
        out = torch.empty(n * data.numel(), dtype=torch.uint8, device=data.device)
        dist.all_gather_into_tensor(out, data.reshape(-1), group=mesh.get_group())
        full = torch.cat(list(out.view(n, *data.shape)), dim=_SEQ).narrow(_SEQ, 0, length)  # the stream's padding off
        whole = Float8TrainingTensor(full.view(f8._data.dtype), f8._scale, f8._orig_dtype, f8._linear_mm_config,
                                     f8._gemm_input_role)  # fmt: skip
        return DTensor.from_local(whole, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        mesh: DeviceMesh = ctx.mesh
        n = mesh.size()
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.to(ctx.dtype)  # as the default path: the autocast cast's backward, then the reduction
        padded = ctx.rows * n
        if local.shape[_SEQ] < padded:
            pad = local.new_zeros((*local.shape[:_SEQ], padded - local.shape[_SEQ], *local.shape[_SEQ + 1 :]))
            local = torch.cat([local, pad], _SEQ)
        if isinstance(grad, DTensor) and not grad.placements[0].is_partial():  # already summed: this rank's rows
            return local.chunk(n, _SEQ)[mesh.get_local_rank()].contiguous(), None, None, None
        out = torch.empty_like(local.chunk(n, _SEQ)[0])
        dist.reduce_scatter(out, [c.contiguous() for c in local.chunk(n, _SEQ)], group=mesh.get_group())
        return out, None, None, None


def _gather_with(layer: nn.Module) -> Gather:
    # Outside torch.compile's graph (a compiled block breaks around it): traced with the block, the run drifted from
    # the eager one (3.6e-3 of the loss in 3 steps; the cause not pinned down); outside it, bitwise the eager run.
    @torch.compiler.disable
    def gather(x: torch.Tensor, mesh: DeviceMesh, length: int) -> Any:
        return _Fp8SequenceGather.apply(x, layer, mesh, length)

    return gather


def fp8_gathers(model: nn.Module, ready: dict[str, str]) -> Callable[[str], Optional[Gather]]:
    """For `apply_tensor_parallel`'s ``gathers``: a region named in ``ready`` (`gather_ready`) gathers in fp8 with
    the casting settings of its fp8 projection (every one of them has the same)."""
    return lambda region: _gather_with(model.get_submodule(ready[region])) if region in ready else None


class _Readers(TorchFunctionMode):
    """Marks a region whose input a torch call reads outside the region's fp8 projections."""

    def __init__(self, inputs: dict[int, str], running: dict[str, int], bad: set[str]) -> None:
        super().__init__()
        self.inputs, self.running, self.bad = inputs, running, bad

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") not in _SHAPE_ONLY:
            for leaf in _compat.tree_leaves((args, kwargs or {})):
                region = self.inputs.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if region is not None and not self.running.get(region):
                    self.bad.add(region)
        return func(*args, **(kwargs or {}))


def gather_ready(model: nn.Module, plans: list[TPPlan], layers: set[str]) -> dict[str, str]:
    """Region name -> one of its fp8 projections, for each split trunk region whose input only its fp8 column-split
    projections read (module docstring), from one probe forward; empty when the probe cannot run the model."""
    plan = plans[0] if plans else None
    if plan is None or not plan.trunk:
        return {}
    prefix = f"{plan.trunk}.*."
    regions: dict[str, list[str]] = {}  # block-relative region -> its column-split projections
    infos: list[HeadInfo | MLPInfo] = [*plan.heads.values(), *plan.mlps.values()]
    for key, info in zip([*plan.heads, *plan.mlps], infos):
        split = [p[len(prefix) :] for p in info.projections if plan.styles.get(p) == "colwise"]
        regions.setdefault((info.region or key)[len(prefix) :], []).extend(split)
    trunk = model.get_submodule(plan.trunk)
    candidates: dict[str, list[str]] = {}  # region name -> its projections' names, all in fp8
    for block, _ in trunk.named_children():
        for region, projections in regions.items():
            names = [f"{plan.trunk}.{block}.{p}" for p in projections]
            if names and all(n in layers for n in names):
                candidates[f"{plan.trunk}.{block}.{region}"] = names
    if not candidates:
        return {}
    inputs: dict[int, str] = {}
    held: list[Any] = []  # the inputs, kept alive so that their ids stay theirs
    running: dict[str, int] = {}
    bad: set[str] = set()
    handles = []

    def capture(region: str) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            try:
                _, x = first_hidden(args, kwargs, plan.hidden_size)
            except RuntimeError:
                bad.add(region)
                return
            inputs[id(x)] = region
            held.append(x)

        return hook

    def enter(region: str) -> Any:
        return lambda mod, args: running.__setitem__(region, running.get(region, 0) + 1)

    def leave(region: str) -> Any:
        return lambda mod, args, out: running.__setitem__(region, running[region] - 1)

    for region, names in candidates.items():
        handles.append(model.get_submodule(region).register_forward_pre_hook(capture(region), with_kwargs=True))
        for n in names:
            layer = model.get_submodule(n)
            handles += [layer.register_forward_pre_hook(enter(region)), layer.register_forward_hook(leave(region))]
    if not watched_probe(model, _Readers(inputs, running, bad), handles):
        return {}
    seen = set(inputs.values())
    return {region: names[0] for region, names in candidates.items() if region in seen and region not in bad}


def gather_note(ready: dict[str, str]) -> list[str]:
    """The start-up line naming the regions whose input sequence parallelism gathers in fp8."""
    return [f"fp8: sequence parallelism all-gathers in fp8 the input of {folded(list(ready))}"] if ready else []
