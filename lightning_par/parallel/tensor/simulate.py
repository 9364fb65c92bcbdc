"""Tensor parallelism simulated in one process on block 0: each rank's copy of the block, and a check that the
ranks' copies together compute what the whole block computes.

`rank_copy` gives a copy of a block holding rank ``r``'s slices of its split projections (the rows `apply` keeps:
a column split's chunk ``r`` of each fused part, a replicated key/value head's rows, a row split's input columns),
its split norms' and per-head parameters' rows, and the per-rank head counts. `check_values` runs every rank's copy
on the real input block 0 receives and compares, at each row-split projection, the sum of the ranks' partial
outputs with the whole block's output there (each copy continues with the whole's value, as the all-reduce would
give it), and each copy's block output with the whole's. Shapes can agree while values do not: Hugging Face
CodeGen regroups its fused ``qkv_proj`` by a constant ``mp_num = 4`` that tp cannot rewrite, so each rank takes the
wrong columns for its heads and trains silently wrong. Here that becomes a refusal before training.
"""

from __future__ import annotations

import copy
import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import _compat
from lightning_par.parallel.tensor.adapters import adapter_styles, find_adapters
from lightning_par.parallel.tensor.apply import _head_params, _set_local_head_counts
from lightning_par.parallel.tensor.kv_heads import kv_parts, kv_replicas, part_rows
from lightning_par.parallel.tensor.mha import slice_for_rank
from lightning_par.parallel.tensor.plan_affine import affine
from lightning_par.parallel.tensor.plan_types import _SHARDED, TPPlan, TPPlanError

_TOLERANCE = 1e-3  # relative to the largest value; fp32 slices of a correct split agree to ~1e-6, a wrong one O(1)


def _rows(plan: TPPlan, key: str, tp: int, rank: int) -> torch.Tensor:
    """The output rows rank ``rank`` keeps of column-split projection ``key`` (`kv_heads.part_rows`)."""
    widths = plan.fused_split.get(key) or (plan.shapes[key].out_dim,)
    head = next((h for h in plan.heads.values() if key in h.projections), None)
    kv = kv_parts(head, key) if head is not None else None
    replicas = kv_replicas(head, tp) if head is not None and kv is not None else 1
    return part_rows(widths, kv or (False,) * len(widths), tp, replicas, rank)


def _slice(mod: nn.Module, style: str, rows: torch.Tensor | None, tp: int, rank: int) -> None:
    if isinstance(mod, nn.MultiheadAttention):  # torch's packed q/k/v (parallel/tensor/mha.py)
        assert rows is not None
        slice_for_rank(mod, rows.to(mod.in_proj_weight.device), tp, rank)
        return
    if isinstance(mod, nn.Embedding):  # a per-head table (T5's relative position bias): this rank's head columns
        assert rows is not None
        table = mod.weight.detach()
        mod.weight = nn.Parameter(table.index_select(1, rows.to(table.device)), requires_grad=False)
        mod.embedding_dim = table.shape[1] // tp
        return
    layout = affine(mod)
    assert layout is not None  # the plan styled it as a projection
    out_dim, in_dim = (1, 0) if layout.transposed else (0, 1)
    w: Any = cast(Any, mod.weight).detach()
    b: Any = getattr(mod, "bias", None)
    if style == "rowwise":
        per = w.shape[in_dim] // tp
        mod.weight = nn.Parameter(w.narrow(in_dim, rank * per, per), requires_grad=False)
        if b is not None and rank != 0:  # added once, after the sum over ranks
            mod.register_parameter("bias", None)
    else:
        assert rows is not None
        mod.weight = nn.Parameter(w.index_select(out_dim, rows.to(w.device)), requires_grad=False)
        if b is not None:
            mod.bias = nn.Parameter(b.detach().index_select(0, rows.to(b.device)), requires_grad=False)
    transposed = layout.transposed

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        p: Any = self
        return F.linear(x, p.weight.t() if transposed else p.weight, getattr(p, "bias", None))

    mod.forward = types.MethodType(forward, mod)  # type: ignore[method-assign]


def rank_copy(block: nn.Module, plan: TPPlan, tp: int, rank: int) -> nn.Module:
    """A copy of ``block`` (of ``plan``'s structure) holding what rank ``rank`` of ``tp`` holds, in eval mode."""
    local = copy.deepcopy(block).eval()
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    for rel, (style, base) in _split(plan, block).items():
        rows = _rows(plan, f"{prefix}.{base}", tp, rank) if style != "rowwise" else None
        _slice(local.get_submodule(rel), style, rows, tp, rank)
    # A norm split like its projection's output and the per-head parameters hold this rank's rows only.
    narrow = [f"{k}.weight" for k, s in plan.styles.items() if s == "colwise_norm" and k.startswith(prefix + ".")]
    narrow += [p for rel, names in _head_params(plan, prefix).items() for p in _names(prefix, rel, names)]
    for pattern in narrow:
        owner, _, leaf = pattern[len(prefix) + 1 :].rpartition(".")
        mod = local.get_submodule(owner)
        if isinstance(w := getattr(mod, leaf, None), torch.Tensor):
            per = w.shape[0] // tp
            setattr(mod, leaf, nn.Parameter(w.detach().narrow(0, rank * per, per), requires_grad=False))
            if isinstance(getattr(mod, "normalized_shape", None), tuple) and leaf == "weight":
                cast(Any, mod).normalized_shape = (per,)  # torch's own norms check the weight against it
    _set_local_head_counts([local], plan, prefix, tp)
    return local


def _split(plan: TPPlan, block: nn.Module) -> dict[str, tuple[str, str]]:
    """Block-relative split projection -> (its style, the projection whose split it follows): the plan's, and
    the low-rank adapters that follow their base (`adapters.adapter_styles`)."""
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    own = {k[len(prefix) + 1 :]: s for k, s in plan.styles.items() if k.startswith(prefix + ".")}
    split = {rel: (s, rel) for rel, s in own.items() if s in _SHARDED}
    return {**split, **adapter_styles(own, find_adapters(block))}


def _names(prefix: str, rel: str, names: tuple[str, ...]) -> list[str]:
    return [f"{prefix}.{rel}.{n}" if rel else f"{prefix}.{n}" for n in names]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def per_head_heads(plan: TPPlan) -> tuple[int, ...]:
    """The query head counts of the attentions with a per-head table split with their heads (`HeadInfo.head_tables`):
    the bias such a table makes reaches later blocks as an input with this rank's heads only."""
    return tuple(sorted({h.n_heads for h in plan.heads.values() if h.head_tables}))


def rank_inputs(captured: Any, heads: tuple[int, ...], tp: int, rank: int) -> Any:
    """``captured`` (a block's input in the whole model) as rank ``rank`` of ``tp`` receives it when a per-head
    table is split with the heads (`per_head_heads`): each 4-D tensor with one of ``heads`` heads on dim 1 (T5's
    position bias ``[batch, heads, query, key]``) narrowed to this rank's heads."""
    if not heads:
        return captured

    def narrow(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[1] in heads:
            per = t.shape[1] // tp
            return t.narrow(1, rank * per, per)
        return t

    return _compat.tree_map_only(torch.Tensor, narrow, captured)


def check_values(
    plan: TPPlan,
    block: nn.Module,
    block_name: str,
    tp: int,
    captured: tuple[tuple[Any, ...], dict[str, Any]],
    per_head: tuple[int, ...] = (),
) -> None:
    """Raise before training when ``tp`` ranks' copies of ``block`` (of ``plan``'s structure) do not compute what
    the whole block computes on ``captured``, its real input (fp32, eval mode, no gradients).

    Raises:
        TPPlanError: naming the first row-split projection (or the block's output) where they differ, the error,
            and a ``tp_plan`` keeping that region whole.

    ``per_head``: head counts whose per-head inputs each rank receives narrowed to its heads (`rank_inputs`).
    """
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    outs = [rel for rel, (style, _) in _split(plan, block).items() if style == "rowwise"]
    params = [*block.parameters(), *block.buffers()]
    if not outs or any(p.is_meta for p in params) or any(p.is_complex() for p in params):
        return  # nothing to sum, or no values to compare (meta-device construction)
    # A norm over a split projection's whole width (OLMoE's q_norm) reduces its statistics over tp, which a rank's
    # copy alone cannot: there the copy takes its slice of the whole block's norm output (what the reduction gives).
    norms = [k[len(prefix) + 1 :] for k, s in plan.styles.items() if s == "colwise_norm" and k.startswith(prefix + ".")]

    def fp32(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    # torch's nn.MultiheadAttention also returns attention weights over all heads: on a rank's copy they are its
    # heads' share (parallel/tensor/mha.py), summed over the ranks like a row-split output.
    mhas = [rel for rel in _split(plan, block) if isinstance(block.get_submodule(rel), nn.MultiheadAttention)]
    whole_seen: dict[str, list[torch.Tensor]] = {k: [] for k in [*outs, *mhas, *norms]}
    try:
        whole = copy.deepcopy(block).eval().float()
        hooks = [_seen(whole, k).register_forward_hook(
            lambda m, a, o, k=k: whole_seen[k].append(_first(o).detach().clone())) for k in outs]  # fmt: skip
        hooks += [whole.get_submodule(k).register_forward_hook(
            lambda m, a, o, k=k: whole_seen[k].extend(o[1:2] if o[1] is not None else ())) for k in mhas]  # fmt: skip
        hooks += [whole.get_submodule(k).register_forward_hook(
            lambda m, a, o, k=k: whole_seen[k].append(o.detach().clone())) for k in norms]  # fmt: skip
        with torch.no_grad():
            args, kwargs = _compat.tree_map_only(torch.Tensor, fp32, copy.deepcopy(captured))
            want = whole(*args, **kwargs)
        for h in hooks:
            h.remove()
    except Exception:
        return  # the block does not run whole in fp32 here (the shape check reports what tp changes)
    partial: dict[str, list[torch.Tensor]] = {k: [torch.zeros_like(o) for o in v] for k, v in whole_seen.items()}
    outputs = []
    for rank in range(tp):
        local = rank_copy(block, plan, tp, rank).float()
        for k in outs:
            local.get_submodule(k).register_forward_hook(_Reduced(partial[k], whole_seen[k], k))
        for k in mhas:
            local.get_submodule(k).register_forward_hook(_Reduced(partial[k], whole_seen[k], k, weights=True))
        for k in norms:
            local.get_submodule(k).register_forward_hook(_NormSlice(whole_seen[k], tp, rank))
        try:
            with torch.no_grad():
                mine = rank_inputs(copy.deepcopy(captured), per_head, tp, rank)
                args, kwargs = _compat.tree_map_only(torch.Tensor, fp32, mine)
                outputs.append(local(*args, **kwargs))
        except _Differs as err:
            _refuse(plan, prefix, block_name, tp, str(err), float("inf"))
        except Exception:
            return  # a failure on the local shapes: the shape check names it
    for k in [*outs, *mhas]:
        for got, ref in zip(partial[k], whole_seen[k]):
            if (error := _error(got, ref)) > _TOLERANCE:
                _refuse(plan, prefix, block_name, tp, k, error)
    flat_want = [t for t in _compat.tree_flatten(want)[0] if isinstance(t, torch.Tensor)]
    for out in outputs:
        flat = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        # Per-head outputs (eager attention weights) are the rank's own by design: only same-shaped ones compare.
        pairs = zip(flat, flat_want) if len(flat) == len(flat_want) else []
        errs = [_error(g, w) for g, w in pairs if g.shape == w.shape]
        if max(errs, default=0.0) > _TOLERANCE:
            _refuse(plan, prefix, block_name, tp, "", max(errs))


def _seen(whole: nn.Module, out: str) -> nn.Module:
    """The module of the whole block whose output is row-split projection ``out``'s: torch's
    ``nn.MultiheadAttention`` applies its ``out_proj`` weight without calling the module, so there the attention."""
    parent, _, leaf = out.rpartition(".")
    if leaf == "out_proj" and isinstance(mha := whole.get_submodule(parent), nn.MultiheadAttention):
        return mha
    return whole.get_submodule(out)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


class _Differs(Exception):
    """A row-split projection ran more often, or on other shapes, on a rank than in the whole block."""


class _Reduced:
    """Forward hook of a row-split projection in a rank's copy: adds its partial output of each call to ``sums``
    and hands on the whole block's output of that call (what the all-reduce gives every rank when the split is
    right). With ``weights``: the same for the attention weights an ``nn.MultiheadAttention`` returns second."""

    def __init__(self, sums: list[torch.Tensor], whole: list[torch.Tensor], name: str, weights: bool = False) -> None:
        self.sums, self.whole, self.name, self.calls, self.weights = sums, whole, name, 0, weights

    def __call__(self, mod: nn.Module, args: Any, out: Any) -> Any:
        if self.weights and out[1] is None:
            return None
        part = out[1] if self.weights else out
        i, self.calls = self.calls, self.calls + 1
        if i >= len(self.sums) or not isinstance(part, torch.Tensor) or part.shape != self.sums[i].shape:
            raise _Differs(self.name)
        self.sums[i] += part
        whole = self.whole[i].clone()  # the code may change it in place (Falcon: mlp_output += attn)
        return (out[0], whole) if self.weights else whole


class _NormSlice:
    """Forward hook of a ``colwise_norm`` in a rank's copy: hands on this rank's slice of the whole block's norm
    output of each call (what the mean of squares reduced over tp gives it), when the shapes say it holds a slice."""

    def __init__(self, whole: list[torch.Tensor], tp: int, rank: int) -> None:
        self.whole, self.tp, self.rank, self.calls = whole, tp, rank, 0

    def __call__(self, mod: nn.Module, args: Any, out: Any) -> Any:
        i, self.calls = self.calls, self.calls + 1
        if i >= len(self.whole) or not isinstance(out, torch.Tensor):
            return None
        whole = self.whole[i]
        per = out.shape[-1]
        if per * self.tp != whole.shape[-1] or out.shape[:-1] != whole.shape[:-1]:
            return None
        return whole.narrow(-1, self.rank * per, per).to(out.dtype)


class ValuesDiffer(TPPlanError):
    """The ranks' copies do not compute what the whole block computes; ``out``: the block-relative row-split
    projection where they first differ (empty: at the block's output)."""

    def __init__(self, message: str, out: str) -> None:
        super().__init__(message)
        self.out = out


def _refuse(plan: TPPlan, prefix: str, block_name: str, tp: int, out: str, err: float) -> None:
    key = f"{prefix}.{out}"
    infos: list[Any] = [*plan.heads.values(), *plan.mlps.values()]
    region = next((i.projections for i in infos if key in i.projections), None)
    split = region or tuple(k for k, s in plan.styles.items() if s in _SHARDED)
    hint = ", ".join(f'"{k}": "replicate"' for k in split)
    where = f"at {block_name}.{out}'s output (summed over the ranks)" if out else f"at {block_name}'s output"
    raise ValuesDiffer(
        f"tp={tp}: the ranks' slices of {block_name} do not compute what the whole block computes ({where}: "
        f"relative error {err:.2g} on block 0's real input); its code combines the split outputs in a way the "
        f"plan does not know (e.g. it regroups a fused projection by a constant of its own), so it would train "
        f"silently wrong. Keep that region whole with tp_plan={{{hint}}}, or choose tp=1",
        out,
    )
