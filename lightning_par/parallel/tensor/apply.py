"""Megatron-style tensor and sequence parallelism applied from an inferred `TPPlan` (DTensor styles).

Tensor parallelism (Shoeybi et al., arXiv 1909.08053): in each attention and MLP of a block the input
projections are split by columns (whole heads per rank) and the output projection by rows, so a block costs one
all-reduce per region forward and one backward. Sequence parallelism (Korthikanti et al., arXiv 2205.05198):
between the regions the residual stream (norms, residual adds, dropout) is split along the sequence, and each
all-reduce becomes a reduce-scatter (end of a region) plus an all-gather (start of a region), the same volume.

What this module does to a model, per block:
- colwise / rowwise Linears become DTensor-sharded (torch's `ColwiseParallel` / `RowwiseParallel`); a fused
  ``[q | k | v]`` projection is sharded chunk by chunk (`_StridedShard`) so each rank gets whole heads of q, k and v;
  fused projections, other affine projections (Hugging Face's ``Conv1D``) and fused parts of unequal widths
  (grouped-query ``[q | k | v]``) are split by `lightning_par.parallel.tensor.affine`, which multiplies the local
  slice (torch 2.11's DTensor cannot redistribute a `_StridedShard` weight inside ``F.linear``);
- each attention / MLP module (a "region") gets its hidden-state input as a replicated DTensor, so the input
  projections share one gradient reduction (Megatron's ``f`` operator) instead of one each;
- q/k norms of split heads and an attention's per-head parameters (GPT-OSS's ``sinks``) follow the heads
  (`lightning_par.parallel.tensor.heads`);
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
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_par.blocks.trunk import trunk_at
from lightning_par.parallel.tensor.adapters import (
    adapter_leaves,
    adapter_styles,
    find_adapters,
    quantised_weights,
    split_dora,
    split_quantised,
    whole_adapters,
)
from lightning_par.parallel.tensor.affine import apply_affine
from lightning_par.parallel.tensor.full_width import apply_full_width, as_whole
from lightning_par.parallel.tensor.heads import (
    apply_colwise_norm,
    apply_head_norm,
    apply_head_params,
    apply_latents,
)
from lightning_par.parallel.tensor.kv_heads import kv_parts, kv_replicas, local_count, part_rows
from lightning_par.parallel.tensor.mha import apply_mha
from lightning_par.parallel.tensor.plan_affine import affine
from lightning_par.parallel.tensor.plan_types import HeadInfo, MLPInfo, TPPlan, TPPlanError
from lightning_par.parallel.tensor.sequence import (
    Gather,
    SequenceState,
    WholeInRegion,
    gather_sequence,
    pad_region_output,
    region_input,
    scatter_sequence,
)

_SEQ = 1  # batch-first models: (batch, sequence, hidden)
_SPLIT = ("colwise", "colwise_fused", "rowwise")


@dataclasses.dataclass(frozen=True)
class TensorParallelInfo:
    """What `apply_tensor_parallel` did.

    Args:
        tp: the tensor-parallel degree.
        sequence_parallel: whether the residual stream of the trunk is split along the sequence.
        styles: concrete module name -> style, for every module that was changed (and ``"head_param"`` for each
            per-head parameter split with the heads, by its name).
        regions: concrete names of the attention / MLP modules whose input is made a replicated DTensor.
        sequence: under sequence parallelism, the state its hooks share (a pipeline stage after the first is told
            the sequence's true length through it: `sequence.SequenceState`).
    """

    tp: int
    sequence_parallel: bool
    styles: dict[str, str]
    regions: tuple[str, ...]
    sequence: SequenceState | None = None


def sequence_parallel_blocker(plan: TPPlan, block: nn.Module) -> str | None:
    """Why sequence parallelism would not be exact for this plan's blocks, or ``None`` when it is.

    It is exact when everything between the regions is position-wise: the regions are submodules of the block
    (so their input can be gathered before any of their code runs) and the block owns no parameters directly
    (their gradients would cover only this rank's tokens).
    """
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    infos: list[tuple[str, HeadInfo | MLPInfo]] = [*plan.heads.items(), *plan.mlps.items()]
    for key, info in infos:
        if (info.region or key) == prefix:
            where = f"{', '.join(info.projections[:-1])} share no submodule below the block ({prefix})"
            return f"the input projections {where}, so their input cannot be gathered before their code runs"
    if any(True for _ in block.parameters(recurse=False)):
        return f"{type(block).__name__} owns parameters directly"
    if plan.tails:
        return (f"{plan.tails[0]} adds its own input back after its output projection (a residual inside the "
                "module), so that input cannot be gathered along the sequence for its projections and kept local")
    if plan.whole:
        # Kept whole, it would route only this rank's tokens with plain parameters: gradients of part of the batch.
        return f"the mixture-of-experts layer {plan.whole[0]} is kept whole on every tp rank"
    for key, head in plan.heads.items():
        if not any(plan.styles.get(p) in _SPLIT for p in head.projections):
            # Kept whole (a tp_plan), it would run on this rank's tokens only: attention mixes the sequence.
            return f"the attention {key} is replicated, and attention mixes tokens along the sequence"
    return None


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool | None = None,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
    ends: tuple[bool, bool] = (True, True),
    gathers: Callable[[str], Gather | None] | None = None,
) -> TensorParallelInfo:
    """Shard the trunk blocks of ``model`` over the 1-D tensor-parallel ``mesh`` as ``plan`` says, in place.

    Args:
        model: the user's module (parameters on their device, not yet data-parallel sharded).
        mesh: the ``tp`` axis of the job's mesh.
        plan: from `lightning_par.parallel.tensor.infer_tp_plan` (validated for ``mesh.size()`` with `validate_tp`).
        sequence_parallel: split the residual stream along the sequence; ``None``: wherever it is exact (see
            `sequence_parallel_blocker`), ``True``: required (an error names why it is not exact).
        blocks: (name, block) pairs to shard instead of the whole trunk: a pipeline stage's own blocks, or the
            blocks of another stack a stage holds (an encoder).
        ends: whether ``blocks`` start and end the trunk. Under sequence parallelism the trunk's first block
            scatters the sequence and its last gathers it; a pipeline stage's blocks between them get and hand on
            this rank's sequence shard, which is what travels between stages.
        gathers: under sequence parallelism, a region's own all-gather of its input by the region's qualified name
            (``None``: DTensor's): fp8's, which gathers the input already cast (`lightning_par.parallel.fp8`).

    Raises:
        TPPlanError: a style this function cannot apply (a sharded embedding or head), naming the ``tp_plan``
            that avoids it.
    """
    tp = mesh.size()
    if blocks is None:
        trunk = trunk_at(model, plan.trunk)
        if trunk is None or trunk.names[0] != plan.first_block:
            raise TPPlanError("the model's trunk changed since the plan was inferred; infer the plan again")
        blocks = list(zip(trunk.names, trunk.blocks))
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    outer = [k for k, s in plan.group_plans()[0].styles.items() if not k.startswith(prefix + ".") and s != "replicate"]
    if outer:
        raise TPPlanError(
            f"{', '.join(outer)} would be split over the vocabulary, which needs a vocabulary-parallel loss in "
            "training_step; lightning_par keeps the embedding and head replicated: map them to 'replicate'"
        )
    # Blocks that differ: each structure's plan (written as for a uniform trunk) on its own blocks of `blocks`.
    groups = [(sub, [(n, b) for n, b in blocks if names is None or n in names]) for sub, names in _groups(plan)]
    groups = [(sub, own) for sub, own in groups if own]
    why = next((w for sub, own in groups if (w := sequence_parallel_blocker(sub, own[0][1]))), None)
    if sequence_parallel and why is not None:
        raise TPPlanError(f"sequence_parallel=True is not exact for this model: {why}; pass sequence_parallel=False")
    if sequence_parallel is None:
        sequence_parallel = why is None
    changed: dict[str, str] = {}
    seq = SequenceState() if sequence_parallel else None
    regions: set[str] = set()
    # torch's SequenceParallel re-registers parameters as trainable: frozen ones (LoRA's base) must stay frozen.
    frozen = [(b, n) for _, b in blocks for n, p in b.named_parameters() if not p.requires_grad]
    for sub, own in groups:
        regions.update(_apply_blocks(sub, own, mesh, seq, changed, gathers))
    for block, pname in frozen:
        block.get_parameter(pname).requires_grad_(False)
    if seq is not None and blocks:
        # A later pipeline stage's first block gets the shard the stage before handed on; the pipeline tells the
        # state the sequence's true length (compose.py).
        if ends[0]:
            blocks[0][1].register_forward_pre_hook(partial(scatter_sequence, mesh, seq), with_kwargs=True)
        if ends[1]:
            blocks[-1][1].register_forward_hook(partial(gather_sequence, mesh, seq))
    return TensorParallelInfo(tp, bool(sequence_parallel), changed, tuple(sorted(regions)), seq)


def _groups(plan: TPPlan) -> list[tuple[TPPlan, set[str] | None]]:
    """Each block structure's plan and the names of its blocks (``None``: all blocks, a plan of one structure)."""
    if not plan.groups:
        return [(plan, None)]
    return [(sub, set(names)) for sub, names in zip(plan.group_plans(), plan.groups.values())]


def _apply_blocks(
    plan: TPPlan,
    blocks: Sequence[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    seq: SequenceState | None,
    changed: dict[str, str],
    gathers: Callable[[str], Gather | None] | None = None,
) -> list[str]:
    """Shard ``blocks``, all of the structure of a uniform ``plan``; return the block-relative split regions."""
    tp, sequence_parallel = mesh.size(), seq is not None
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    rel_styles = {k[len(prefix) + 1 :]: s for k, s in plan.styles.items() if k.startswith(prefix + ".")}
    fused = {k[len(prefix) + 1 :]: w for k, w in plan.fused_split.items()}
    # Regions whose projections are split (a tp_plan may keep a whole attention or MLP replicated).
    projections = {
        **{h.region or k: h.projections for k, h in plan.heads.items()},
        **{m.region or k: m.projections for k, m in plan.mlps.items()},
    }
    # A region whose code goes on after its output projection (`TPPlan.tails`) keeps its input as it is.
    split = {k for k, projs in projections.items() if any(plan.styles.get(p) in _SPLIT for p in projs)}
    split -= set(plan.tails)
    regions = sorted(k[len(prefix) + 1 :] for k in split if k != prefix)
    kv = _replicated_kv(plan, prefix, tp, mesh.get_local_rank())
    counted = as_whole(plan)  # a gathered region's code keeps the global head counts and whole per-head parameters
    latent = {k[len(prefix) + 1 :] for h in plan.heads.values() for k in h.latent}
    # Replicated modules inside a split region, reading its gathered input (`WholeInRegion`), not the stream.
    inside = [r for r, s in rel_styles.items() if s in ("replicate", "sequence_parallel") and r not in latent
              and any(r.startswith(f"{g}.") for g in regions)]  # fmt: skip
    # Low-rank adapters split with their base projections (parallel/tensor/adapters.py): the split one of each pair.
    adapters = find_adapters(blocks[0][1]) if blocks else {}
    follows = adapter_styles(rel_styles, adapters)
    leaves = adapter_leaves(blocks[0][1]) if blocks else set()
    base_of = {**{r: r for r in rel_styles}, **{r: base for r, (_, base) in follows.items()}}
    for name, block in blocks:
        styles: dict[str, Any] = {}
        for rel, style in {**rel_styles, **{r: s for r, (s, _) in follows.items()}}.items():
            base = base_of[rel]
            if style in _SPLIT and quantised_weights(block.get_submodule(rel)):  # a QLoRA base (tensor/adapters.py)
                split_quantised(f"{name}.{rel}", block.get_submodule(rel), style, mesh, sequence_parallel)
                changed[f"{name}.{rel}"] = style
                continue
            if style in _SPLIT and isinstance(mha := block.get_submodule(rel), nn.MultiheadAttention):  # tensor/mha.py
                apply_mha(mha, mesh, seq)
                changed[f"{name}.{rel}"] = style
                continue
            own = _own_style(block.get_submodule(rel), fused.get(base) if style != "rowwise" else None)
            if style in _SPLIT and (own or (base in kv and style != "rowwise")):
                # Not an nn.Linear (Conv1D), a fused projection, or key/value heads replicated over ranks
                # (parallel/tensor/kv_heads.py): our own split (parallel/tensor/affine.py).
                mod = block.get_submodule(rel)
                layout = affine(mod)
                assert layout is not None  # the plan styled it as a projection
                apply_affine(mod, mesh, style, transposed=layout.transposed, parts=fused.get(base), rows=kv.get(base),
                             sequence_parallel=sequence_parallel)  # fmt: skip
                changed[f"{name}.{rel}"] = style
            elif style == "colwise":
                styles[rel] = ColwiseParallel(use_local_output=True)
            elif style == "rowwise":
                out = Shard(_SEQ) if sequence_parallel else Replicate()
                styles[rel] = RowwiseParallel(output_layouts=out, use_local_output=True)
            elif style == "sequence_parallel" and sequence_parallel and rel not in inside:
                styles[rel] = SequenceParallel(sequence_dim=_SEQ, use_local_output=True)
            elif style in ("head_norm", "colwise_norm"):  # q/k norms of split heads (parallel/tensor/heads.py)
                norm = block.get_submodule(rel)
                (apply_head_norm if style == "head_norm" else apply_colwise_norm)(norm, mesh)
                changed[f"{name}.{rel}"] = style
        for rel, names in _head_params(counted, prefix).items():
            apply_head_params(block.get_submodule(rel) if rel else block, names, mesh)
            changed.update({f"{name}.{rel}.{n}" if rel else f"{name}.{n}": "head_param" for n in names})
        styles.update(whole_adapters(block, adapters, follows, mesh, sequence_parallel))
        if sequence_parallel:
            stream = _stream_modules(block, rel_styles, regions)
            # Adapters (DoRA's magnitudes too) follow their bases: split_dora places the magnitudes.
            styles.update({r: s for r, s in stream.items() if r not in styles and r not in leaves})
        parallelize_module(block, mesh, styles)  # type: ignore[arg-type]
        split_dora(name, block, adapters, styles, rel_styles, mesh, sequence_parallel, kv)  # magnitudes follow bases
        apply_full_width(block, plan, prefix, mesh)  # after the styles' hooks (parallel/tensor/full_width.py)
        for rel in (k[len(prefix) + 1 :] for k in plan.inplace if rel_styles.get(k[len(prefix) + 1 :]) in _SPLIT):
            # The code changes this output in place (Falcon's mlp_output += attention_output), which autograd forbids
            # on the view a DTensor style hands out: a copy of its own, for these projections only.
            block.get_submodule(rel).register_forward_hook(lambda _m, _a, out: out.clone())
        changed.update({f"{name}.{rel}": _style_name(s) for rel, s in styles.items()})
        for rel in regions:
            gather = gathers(f"{name}.{rel}") if gathers is not None and seq is not None else None
            block.get_submodule(rel).register_forward_pre_hook(
                partial(region_input, mesh, seq, plan.hidden_size, gather=gather), with_kwargs=True
            )
        for rel in inside:
            mod, whole = block.get_submodule(rel), WholeInRegion(mesh)
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(whole.before, with_kwargs=True)
                mod.register_forward_hook(whole.after)
        if seq is not None:  # after the styles' own output hooks: the padding goes on the local slice
            for rel in [
                *(r for r, s in rel_styles.items() if s == "rowwise"),
                *(r for r, (s, _) in follows.items() if s == "rowwise"),
            ]:
                block.get_submodule(rel).register_forward_hook(partial(pad_region_output, mesh, seq))
        apply_latents(block, plan, prefix, mesh)
    _set_local_head_counts([b for _, b in blocks], counted, prefix, tp)
    return regions


def _head_params(plan: TPPlan, prefix: str) -> dict[str, tuple[str, ...]]:
    """Block-relative attention module -> its per-head parameters, for the attentions whose heads are split."""
    got: dict[str, tuple[str, ...]] = {}
    for head in plan.heads.values():
        if any(plan.styles.get(p) in ("colwise", "colwise_fused") for p in head.projections):
            for pattern in head.head_params:
                rel, _, leaf = pattern[len(prefix) + 1 :].rpartition(".")
                got[rel] = (*got.get(rel, ()), leaf)
    return got


def _replicated_kv(plan: TPPlan, prefix: str, tp: int, rank: int) -> dict[str, Tensor]:
    """Block-relative projection -> the output rows this rank computes, for the projections holding key/value heads
    of attentions with fewer of them than tp ranks (`kv_heads`)."""
    rows: dict[str, Tensor] = {}
    for head in plan.heads.values():
        replicas = kv_replicas(head, tp)
        if replicas == 1 or not any(plan.styles.get(p) in ("colwise", "colwise_fused") for p in head.projections):
            continue
        for key in head.projections[:-1]:
            if (parts := kv_parts(head, key)) is not None:
                widths = head.fused_split.get(key) or (plan.shapes[key].out_dim,)
                rows[key[len(prefix) + 1 :]] = part_rows(widths, parts, tp, replicas, rank)
    return rows


def _own_style(mod: nn.Module, parts: tuple[int, ...] | None) -> bool:
    # Fused projections too: a `_StridedShard` weight inside F.linear needs torch >= 2.13's sharding propagation
    # (2.11 cannot redistribute it); `affine` multiplies the local slice, the same on every torch.
    # A per-head table (an nn.Embedding split by columns with the heads) takes torch's ColwiseParallel as it is.
    return not isinstance(mod, (nn.Linear, nn.Embedding)) or (parts is not None and len(parts) > 1)


def _style_name(style: Any) -> str:
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
        if not any(plan.styles.get(p) in ("colwise", "colwise_fused") for p in head.projections):
            continue
        for block in blocks:
            owner = block.get_submodule(rel) if rel else block
            copied: set[str] = set()
            for attr, kind in head.local_attrs.items():
                obj, _, leaf = attr.rpartition(".")
                target = owner
                if obj:
                    # A count on a config object the module keeps (and other layers share): give the module its
                    # own shallow copy, so the per-rank value reaches only the code of this sharded module.
                    if obj not in copied:
                        setattr(owner, obj, copy.copy(getattr(owner, obj)))
                        copied.add(obj)
                    target = getattr(owner, obj)
                setattr(target, leaf, local_count(kind, getattr(target, leaf), head, tp))
