"""Megatron-style tensor and sequence parallelism applied from an inferred `TPPlan` (DTensor styles).

Tensor parallelism (Shoeybi et al., arXiv 1909.08053): in each attention and MLP of a block the input
projections are split by columns (whole heads per rank) and the output projection by rows, so a block costs one
all-reduce per region forward and one backward. Sequence parallelism (Korthikanti et al., arXiv 2205.05198):
between the regions the residual stream (norms, residual adds, dropout) is split along the sequence, and each
all-reduce becomes a reduce-scatter (end of a region) plus an all-gather (start of a region), the same volume.

What this module does to a model, per block:
- colwise / rowwise Linears become DTensor-sharded (torch's `ColwiseParallel` / `RowwiseParallel`); a fused
  ``[q | k | v]`` projection is sharded chunk by chunk (`_StridedShard`) so each rank gets whole heads of q, k and v;
  other affine projections (Hugging Face's ``Conv1D``) and fused parts of unequal widths (grouped-query ``[q | k |
  v]``) are split by `lightning_par.parallel.tp_affine`;
- each attention / MLP module (a "region") gets its hidden-state input as a replicated DTensor, so the input
  projections share one gradient reduction (Megatron's ``f`` operator) instead of one each;
- head-count attributes that the plan found (``n_heads = 8`` used in a ``view``) are set to per-rank values;
- under sequence parallelism the first block's input is split along dim 1, the last block's output gathered, and
  modules on the residual stream (norms, stray Linears) run on the local sequence shard with replicated DTensor
  parameters whose gradients are summed over tp (torch's `SequenceParallel`).
The token embedding, the output head and the final norm stay replicated: sharding them over the vocabulary needs a
vocabulary-parallel loss in the user's ``training_step``, which we do not rewrite (docs/tensor_parallel.md).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from typing_extensions import override

from lightning_par import _compat
from lightning_par.parallel.tp_affine import apply_affine
from lightning_par.plans.tp_affine import affine
from lightning_par.plans.tp_types import TPPlan, TPPlanError
from lightning_par.plans.trunk import find_trunk

_SEQ = 1  # batch-first models: (batch, sequence, hidden)
_SPLIT = ("colwise", "colwise_fused_qkv", "rowwise")


class _FusedColwise(_compat.ColwiseParallelHook):
    """Column split of a fused projection laid out as ``chunks`` equal parts (``[q | k | v]``): each rank holds its
    slice of every part, i.e. whole heads of each, as a ``_StridedShard(0, split_factor=chunks)`` DTensor."""

    def __init__(self, chunks: int) -> None:
        super().__init__(use_local_output=True)
        self.chunks = chunks

    @override
    def distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = _compat.StridedShard(0, split_factor=self.chunks)
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [placement]), param.requires_grad)
                mod.register_parameter(pname, dist_param)

        return distribute_module(
            module,
            device_mesh,
            partition,
            self.prepare_input(),
            _local_output,
        )


def _local_output(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    # Keep the strided layout: ColwiseParallel would redistribute it to a contiguous Shard(-1), moving data and
    # mixing q, k and v columns across ranks.
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


@dataclasses.dataclass(frozen=True)
class TensorParallelInfo:
    """What `apply_tensor_parallel` did.

    Args:
        tp: the tensor-parallel degree.
        sequence_parallel: whether the residual stream of the trunk is split along the sequence.
        styles: concrete module name -> style, for every module that was changed.
        regions: concrete names of the attention / MLP modules whose input is made a replicated DTensor.
    """

    tp: int
    sequence_parallel: bool
    styles: dict[str, str]
    regions: tuple[str, ...]


def sequence_parallel_blocker(plan: TPPlan, block: nn.Module) -> str | None:
    """Why sequence parallelism would not be exact for this plan's blocks, or ``None`` when it is.

    It is exact when everything between the regions is position-wise: the regions are submodules of the block
    (so their input can be gathered before any of their code runs) and the block owns no parameters directly
    (their gradients would cover only this rank's tokens).
    """
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    for key in (*plan.heads, *plan.mlps):
        if key == prefix:
            return f"the attention/MLP projections sit directly in the block ({prefix}), not in a submodule"
    if any(True for _ in block.parameters(recurse=False)):
        return f"{type(block).__name__} owns parameters directly"
    return None


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool | None = None,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
) -> TensorParallelInfo:
    """Shard the trunk blocks of ``model`` over the 1-D tensor-parallel ``mesh`` as ``plan`` says, in place.

    Args:
        model: the user's module (parameters on their device, not yet data-parallel sharded).
        mesh: the ``tp`` axis of the job's mesh.
        plan: from `lightning_par.plans.infer_tp_plan` (validated for ``mesh.size()`` with `validate_tp`).
        sequence_parallel: split the residual stream along the sequence; ``None``: wherever it is exact (see
            `sequence_parallel_blocker`), ``True``: required (an error names why it is not exact).
        blocks: (name, block) pairs to shard instead of the whole trunk: a pipeline stage's own blocks. Sequence
            parallelism is then off (a stage's boundary activations travel whole between stages).

    Raises:
        TPPlanError: a style this function cannot apply (a sharded embedding or head), naming the ``tp_plan``
            that avoids it.
    """
    tp = mesh.size()
    if blocks is None:
        trunk = find_trunk(model)
        if trunk is None or trunk.path != plan.trunk:
            raise TPPlanError("the model's trunk changed since the plan was inferred; infer the plan again")
        blocks = list(zip(trunk.names, trunk.blocks))
    else:
        if sequence_parallel:
            raise TPPlanError(
                "sequence_parallel=True is not supported inside pipeline stages (their boundary activations travel "
                "whole); pass sequence_parallel=False or None"
            )
        sequence_parallel = False
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    outer = [k for k, s in plan.styles.items() if not k.startswith(prefix + ".") and s != "replicate"]
    if outer:
        raise TPPlanError(
            f"{', '.join(outer)} would be split over the vocabulary, which needs a vocabulary-parallel loss in "
            "training_step; lightning_par keeps the embedding and head replicated: map them to 'replicate'"
        )
    rel_styles = {k[len(prefix) + 1 :]: s for k, s in plan.styles.items() if k.startswith(prefix + ".")}
    fused = {k[len(prefix) + 1 :]: w for h in plan.heads.values() for k, w in h.fused_split.items()}
    why = sequence_parallel_blocker(plan, blocks[0][1]) if blocks else None
    if sequence_parallel and why is not None:
        raise TPPlanError(f"sequence_parallel=True is not exact for this model: {why}; pass sequence_parallel=False")
    if sequence_parallel is None:
        sequence_parallel = why is None
    # Regions whose projections are split (a tp_plan may keep a whole attention or MLP replicated).
    projections = {
        **{k: h.projections for k, h in plan.heads.items()},
        **{k: m.projections for k, m in plan.mlps.items()},
    }
    split = {k for k, projs in projections.items() if any(plan.styles.get(p) in _SPLIT for p in projs)}
    regions = sorted(k[len(prefix) + 1 :] for k in split if k != prefix)
    changed: dict[str, str] = {}
    for name, block in blocks:
        styles: dict[str, Any] = {}
        for rel, style in rel_styles.items():
            if style in _SPLIT and _own_style(block.get_submodule(rel), fused.get(rel) if style != "rowwise" else None):
                # Not an nn.Linear (Conv1D), or fused parts of unequal widths: our own split (parallel/tp_affine.py).
                mod = block.get_submodule(rel)
                layout = affine(mod)
                assert layout is not None  # the plan styled it as a projection
                apply_affine(mod, mesh, style, transposed=layout.transposed, parts=fused.get(rel),
                             sequence_parallel=bool(sequence_parallel))  # fmt: skip
                changed[f"{name}.{rel}"] = style
            elif style == "colwise":
                styles[rel] = ColwiseParallel(use_local_output=True)
            elif style == "colwise_fused_qkv":
                styles[rel] = _FusedColwise(len(fused[rel]))
            elif style == "rowwise":
                out = Shard(_SEQ) if sequence_parallel else Replicate()
                styles[rel] = RowwiseParallel(output_layouts=out, use_local_output=True)
            elif style == "sequence_parallel" and sequence_parallel:
                styles[rel] = SequenceParallel(sequence_dim=_SEQ, use_local_output=True)
        if sequence_parallel:
            styles.update(_stream_modules(block, rel_styles, regions))
        parallelize_module(block, mesh, styles)  # type: ignore[arg-type]
        changed.update({f"{name}.{rel}": _style_name(s) for rel, s in styles.items()})
        for rel in regions:
            block.get_submodule(rel).register_forward_pre_hook(
                partial(_region_input, mesh, sequence_parallel, plan.hidden_size), with_kwargs=True
            )
    _set_local_head_counts([b for _, b in blocks], plan, prefix, tp)
    if sequence_parallel and blocks:
        blocks[0][1].register_forward_pre_hook(partial(_scatter_sequence, mesh), with_kwargs=True)
        blocks[-1][1].register_forward_hook(partial(_gather_sequence, mesh))
    return TensorParallelInfo(tp, sequence_parallel, changed, tuple(regions))


def _own_style(mod: nn.Module, parts: tuple[int, ...] | None) -> bool:
    return not isinstance(mod, nn.Linear) or (parts is not None and len(set(parts)) > 1)


def _style_name(style: Any) -> str:
    if isinstance(style, _FusedColwise):
        return "colwise_fused_qkv"
    names: dict[type, str] = {
        ColwiseParallel: "colwise", RowwiseParallel: "rowwise", SequenceParallel: "sequence_parallel"
    }  # fmt: skip
    return names[type(style)]


def _stream_modules(block: nn.Module, rel_styles: dict[str, str], regions: list[str]) -> dict[str, Any]:
    """Modules on the residual stream that own parameters but no style: they see only local tokens under
    sequence parallelism, so their parameters become replicated DTensors whose gradients are summed over tp."""
    extra: dict[str, Any] = {}
    for rel, mod in block.named_modules():
        inside = any(rel == r or rel.startswith(r + ".") for r in regions)
        styled = rel_styles.get(rel, "replicate") != "replicate"
        if not rel or inside or styled or not any(True for _ in mod.parameters(recurse=False)):
            continue
        styled_below = any(k.startswith(rel + ".") and v != "replicate" for k, v in rel_styles.items())
        if any(r.startswith(rel + ".") for r in regions) or styled_below:
            raise TPPlanError(
                f"{rel} owns parameters and also contains an attention/MLP; sequence parallelism cannot place "
                "them: pass sequence_parallel=False"
            )
        extra[rel] = SequenceParallel(sequence_dim=_SEQ, use_local_output=True)
    return extra


def _set_local_head_counts(blocks: Sequence[nn.Module], plan: TPPlan, prefix: str, tp: int) -> None:
    # `view(B, T, self.n_heads, head_dim)` must see this rank's heads; attributes the plan found hold global counts.
    for key, head in plan.heads.items():
        rel = key[len(prefix) + 1 :] if key != prefix else ""
        if not any(plan.styles.get(p) in ("colwise", "colwise_fused_qkv") for p in head.projections):
            continue
        for block in blocks:
            owner = block.get_submodule(rel) if rel else block
            copied: set[str] = set()
            for attr in head.local_attrs:
                obj, _, leaf = attr.rpartition(".")
                target = owner
                if obj:
                    # A count on a config object the module keeps (and other layers share): give the module its
                    # own shallow copy, so the per-rank value reaches only the code of this sharded module.
                    if obj not in copied:
                        setattr(owner, obj, copy.copy(getattr(owner, obj)))
                        copied.add(obj)
                    target = getattr(owner, obj)
                setattr(target, leaf, getattr(target, leaf) // tp)


def _first_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: int) -> tuple[str | int, torch.Tensor]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-1] == hidden:
            return i, a
    named = [k for k in ("hidden_states", "x", "hidden", "input") if k in kwargs]
    for k in [*named, *kwargs]:
        a = kwargs[k]
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-1] == hidden:
            return k, a
    raise RuntimeError(f"no (batch, sequence, {hidden}) hidden-state argument found; pass tp_plan to fix the plan")


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int, value: Any) -> Any:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1 :]), kwargs
    return args, {**kwargs, where: value}


def _region_input(mesh: DeviceMesh, sp: bool, hidden: int, mod: nn.Module, args: Any, kwargs: Any) -> Any:
    """The region's hidden input as a replicated DTensor: its column-split projections then produce partial
    input gradients that are summed as DTensors and reduced once (all-reduce; reduce-scatter under SP)."""
    where, x = _first_hidden(args, kwargs, hidden)
    if isinstance(x, DTensor):
        return None
    if sp:
        full = DTensor.from_local(x, mesh, [Shard(_SEQ)], run_check=False).redistribute(mesh, [Replicate()])
    else:
        full = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return _replace(args, kwargs, where, full)


def _scatter_sequence(mesh: DeviceMesh, mod: nn.Module, args: Any, kwargs: Any) -> Any:
    """Entering the trunk: keep this rank's slice of the sequence (no communication; all-gather in backward)."""
    where, x = next(
        ((i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)),
        next(((k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)), (None, None)),
    )
    if x is None or where is None:
        raise RuntimeError("the first block got no tensor input to split along the sequence")
    if x.shape[_SEQ] % mesh.size():
        raise ValueError(
            f"sequence length {x.shape[_SEQ]} is not divisible by tp={mesh.size()} under sequence parallelism; "
            f"use a sequence length that is a multiple of {mesh.size()} or sequence_parallel=False"
        )
    local = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(_SEQ)]).to_local()
    return _replace(args, kwargs, where, local)


def _gather_sequence(mesh: DeviceMesh, mod: nn.Module, args: Any, out: Any) -> Any:
    """Leaving the trunk: all-gather the sequence so the code after it (final norm, head, loss) runs as written."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, mesh, [Shard(_SEQ)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    if isinstance(out, torch.Tensor):
        return gather(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (gather(out[0]), *out[1:])
    raise RuntimeError("the last block returned no tensor (or tuple starting with one) to gather along the sequence")
