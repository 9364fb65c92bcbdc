"""What tensor parallelism checks and reports at set-up, before the first step.

**Before the split**, block 0 (the first block of each structure) runs once on the shapes tensor parallelism gives
each rank. A plan can be right about widths and still meet code that assumes the full width: nanoGPT-style
``q, k, v = qkv.split(C, dim=2)`` with ``C = x.size(-1)``, or ``y.view(B, T, C)``, read sizes from the input, which
tp does not change, instead of from a head-count attribute tp rewrites. Under tp that fails inside forward with an
unrelated error (``not enough values to unpack``). Here a copy of block 0 gets rank 0's slices of its split
projections and the per-rank head counts and runs on the input the real block 0 receives (the plan probe's input,
in eval mode, no gradients, on the model's device: meta works); a failure is reported before training, naming the
module, the error and the ``tp_plan`` that keeps that region whole. Where the shapes agree, the values are checked
too: every rank's copy against the whole block (`lightning_par.parallel.tensor.simulate`).

**After the split**, the pre-flight runs one forward of the whole split model on the probe's input (eval mode, no
gradients) on every tp rank. Code around and between the regions can still meet a DTensor it does not expect
(Hugging Face Qwen4-Exp's hyper-connections mix the hidden state with weights of their own before the attention:
"aten.mul.Tensor got mixed torch.Tensor and DTensor"). That failure stops set-up with the module that raised it and
a fix that is always correct, instead of the first step crashing; every tp rank runs the same code on the same
input, so all of them fail alike. Then the start-up report: how much of the blocks' parameters a rank holds, and
what tp keeps whole inside the blocks and why, so that a partial plan (an attention tp cannot split, a kept-whole
MLP) is never a surprise.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par import _compat
from lightning_par.blocks._probe import _is_norm, eval_mode, probe_call, probe_target, running_modules
from lightning_par.blocks.trunk import other_trunks, trunk_at
from lightning_par.parallel.tensor.adapters import adapter_leaves
from lightning_par.parallel.tensor.full_width import as_whole, fallback_for
from lightning_par.parallel.tensor.plan import infer_tp_plan
from lightning_par.parallel.tensor.plan_types import _SHARDED, TPPlan, TPPlanError
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.parallel.tensor.simulate import ValuesDiffer, check_values, per_head_heads, rank_copy, rank_inputs


class _Reached(Exception):
    """Raised by the hook that captured block 0's input: the rest of the model need not run."""


def _block_input(model: nn.Module, block: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        got.append((args, kwargs))
        raise _Reached

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # no dropout: no draw from the user's RNG streams
        with torch.no_grad():
            _call_on_distinct_tokens(model)
    except _Reached:
        pass
    except Exception:  # the plan probe could not run the model either (its notes say so): nothing to check
        return None
    finally:
        handle.remove()
        for m, mode in modes.items():
            m.training = mode
    return got[0] if got else None


def _call_on_distinct_tokens(model: nn.Module) -> None:
    """The plan probe's call, except that a model without ``example_input_array`` gets tokens 0 and 1 alternating
    rather than token 0 everywhere: a model without positional information would see identical positions, its
    attention would be uniform, and a wrong combination of heads would compute the right values there."""
    if getattr(model, "example_input_array", None) is not None:
        probe_call(model)
        return
    model = probe_target(model)
    param = next(model.parameters(), None)
    try:
        model(torch.arange(8, device=param.device if param is not None else None).remainder(2).unsqueeze(0))
    except _Reached:
        raise
    except Exception:
        probe_call(model)  # token 0 everywhere, as the plan probe ran it


def check_local_shapes(model: nn.Module, plan: TPPlan, tp: int) -> TPPlan:
    """Raise before training when block 0's code (that of the first block of each structure, when blocks differ)
    does not run on the per-rank shapes of ``plan`` at ``tp``, and no region of it can run on gathered activations.

    Returns:
        ``plan``, with the attentions / MLPs whose code sizes its tensors from the full width in ``gathered``
        (`lightning_par.parallel.tensor.full_width`) and a note naming them.

    Raises:
        TPPlanError: naming the module that failed, its error, and a ``tp_plan`` keeping that region replicated.
    """
    trunk = trunk_at(model, plan.trunk)
    if tp == 1 or trunk is None:
        return plan
    star = f"{plan.trunk}.*" if plan.trunk else "*"
    gathered = list(plan.gathered)
    per_head = per_head_heads(plan)  # a bias made by a split per-head table reaches later blocks with a rank's heads
    # Blocks that differ: the first block of each structure, on that structure's plan (written with `star`).
    for prefix, sub in zip(list(plan.groups) or [star], plan.group_plans()):
        block = trunk.blocks[trunk.names.index(sub.first_block)]
        _check_region_params(sub, block, sub.first_block)
        captured = _block_input(model, block)
        if captured is not None:
            found = _check_block(sub, block, sub.first_block, tp, captured, per_head)
            found = _check_values(sub, block, tp, captured, found, per_head)
            gathered += [prefix + k[len(star) :] for k in found]
    added = [k for k in gathered if k not in plan.gathered]
    if not added:
        return plan
    note = (f"run on the full width: {', '.join(added)} (its code sizes tensors from the input's width, not from a "
            "head count: its projections are split, their outputs gathered over tp, the code between them computed "
            "whole on every rank)")  # fmt: skip
    return dataclasses.replace(plan, gathered=tuple(gathered), notes=(*plan.notes, note))


def _check_values(
    plan: TPPlan,
    block: nn.Module,
    tp: int,
    captured: tuple[tuple[Any, ...], dict[str, Any]],
    gathered: tuple[str, ...],
    per_head: tuple[int, ...],
) -> tuple[str, ...]:
    """The values, where shapes agree (`simulate.check_values`): a region whose rank copies compute other values
    than the whole one (code that regroups a split projection by a constant of its own, CodeGen's ``mp_num``) runs
    on gathered outputs where it can, which is exact whatever its code does; else the refusal stands. Returns the
    gathered regions."""
    star = f"{plan.trunk}.*" if plan.trunk else "*"
    while True:
        try:
            # A gathered region's code sees the whole projections' outputs.
            current = as_whole(dataclasses.replace(plan, gathered=gathered))
            check_values(current, block, plan.first_block, tp, captured, per_head)
            return gathered
        except ValuesDiffer as err:
            marked = dataclasses.replace(plan, gathered=gathered)
            key = fallback_for(marked, f"{star}.{err.out}", tp, block) if err.out else None
            if key is None:
                raise
            gathered = (*gathered, key)


def _check_region_params(plan: TPPlan, block: nn.Module, block_name: str) -> None:
    """Refuse a split attention or MLP holding parameters of a module the plan does not style (Apertus's xIELU
    activation, ``alpha_p`` / ``alpha_n``): each rank would train them on its own shard of the hidden units, so they
    would drift apart from one process without an error."""
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    handled = set(plan.shapes) | {p.rpartition(".")[0] for h in plan.heads.values() for p in h.head_params}
    handled |= {f"{prefix}.{n}" for n in adapter_leaves(block)}  # low-rank adapters follow their base
    infos: list[Any] = [*plan.heads.values(), *plan.mlps.values()]
    for info in infos:
        if not any(plan.styles.get(p) in _SHARDED for p in info.projections) or info.region == prefix:
            continue
        rel = info.region[len(prefix) + 1 :]
        for name, mod in block.get_submodule(rel).named_modules():
            own = [n for n, _ in mod.named_parameters(recurse=False)]
            if own and (f"{info.region}.{name}" if name else info.region) not in handled:
                keep = ", ".join(f'"{p}": "replicate"' for p in info.projections)
                where = f"{block_name}.{rel}.{name}" if name else f"{block_name}.{rel}"
                raise TPPlanError(
                    f"{where} ({type(mod).__name__}) owns parameters ({', '.join(own)}) inside "
                    f"a region tensor parallelism splits, but no tp style covers them: each rank would train them on "
                    f"its own shard only and the model would drift from one process; keep that region whole with "
                    f"tp_plan={{{keep}}}"
                )


def _check_block(
    plan: TPPlan,
    block: nn.Module,
    block_name: str,
    tp: int,
    captured: tuple[tuple[Any, ...], dict[str, Any]],
    per_head: tuple[int, ...] = (),
) -> tuple[str, ...]:
    """Run rank 0's copy of ``block``; where a region's code fails on the split shapes and can run on gathered
    activations (`full_width.fallback_for`), gather it and run again. Returns the gathered regions."""
    try:
        # Copies of the block and of its input (a cache object in it would otherwise see two runs); the unsplit
        # copy must run, or a failure below would say nothing about tp.
        whole = copy.deepcopy(block).eval()
        with torch.no_grad():
            args, kwargs = copy.deepcopy(captured)
            whole(*args, **kwargs)
    except Exception:
        return ()
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    gathered: tuple[str, ...] = ()
    while True:
        current = as_whole(dataclasses.replace(plan, gathered=gathered))
        local = rank_copy(block, current, tp, 0)
        with running_modules(local) as stack:  # on an error, the innermost running module is where it was raised
            try:
                with torch.no_grad():
                    args, kwargs = rank_inputs(copy.deepcopy(captured), per_head, tp, 0)
                    local(*args, **kwargs)
                return gathered
            except Exception as err:
                where, failed = (stack[-1] if stack else ""), err
        pattern = f"{prefix}.{where}" if where else prefix
        key = fallback_for(dataclasses.replace(plan, gathered=gathered), pattern, tp, block)
        if key is None:
            break
        gathered = (*gathered, key)
    split = {k: s for k, s in current.styles.items() if s in _SHARDED and k.startswith(prefix + ".")}
    region = [k for k in split if k.startswith(pattern + ".")] or list(split)
    hint = ", ".join(f'"{k}": "replicate"' for k in region)
    name = f"{block_name}.{where}" if where else block_name
    failing = block.get_submodule(where)
    cause = _per_head_params(failing, plan) or (
        "its code sizes a split, view or reshape from the full width (e.g. x.size(-1)) rather than from its "
        "weights or a head-count attribute"
    )
    raise TPPlanError(
        f"tp={tp}: {name} ({type(failing).__name__}) fails on the shapes each rank gets ({type(failed).__name__}: "
        f"{failed}); {cause}. Keep that region whole with tp_plan={{{hint}}}, or choose tp=1"
    ) from failed


def _per_head_params(mod: nn.Module, plan: TPPlan) -> str:
    """Parameters of the failing module itself with one entry per head that the plan leaves whole (it splits an
    attention's own per-query-head ones, GPT-OSS's ``sinks``, not others), so the local heads meet all entries."""
    counts = {h.n_heads for h in plan.heads.values()} | {h.n_kv_heads for h in plan.heads.values()}
    split = {p.rpartition(".")[2] for h in plan.heads.values() for p in h.head_params}
    own = mod.named_parameters(recurse=False)
    found = [f"{n} {list(p.shape)}" for n, p in own if p.dim() >= 1 and p.shape[0] in counts and n not in split]
    if not found:
        return ""
    return f"it owns per-head parameters ({', '.join(found)}) that tensor parallelism does not split"


def preflight(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    """Run ``model`` (already split over ``tp`` ranks) once on the probe's input; call it only where the same probe
    ran the whole model (`TPPlan.traced`), so that a failure is the split's.

    Raises:
        TPPlanError: the forward failed; names the innermost module running, the error and the fix.
    """
    if any(p.is_meta for p in model.parameters()):
        return  # built on the meta device: no values yet (the checks before the split ran on its shapes)
    with running_modules(model) as stack:
        try:
            with eval_mode(model), torch.no_grad():
                probe_call(model)
            return
        except Exception as err:
            where, failed = (stack[-1] if stack else ""), err
    kind = type(model.get_submodule(where)).__name__
    sp = " (sequence parallelism on: also try sequence_parallel=False)" if sequence_parallel else ""
    raise TPPlanError(
        f"tp={tp}: the split model's forward fails before training in {where or 'the model'} ({kind}): "
        f"{type(failed).__name__}: {failed}; its code meets a split tensor it does not expect. Train it without tensor "
        f"parallelism (tp=1){sp}"
    ) from failed


_WHY = {
    nn.MultiheadAttention: "nn.MultiheadAttention with kdim/vdim, bias_k/bias_v or add_zero_attn, not split",
    nn.Linear: "a projection in no column/row pair",
}


def _is_split(placement: Any) -> bool:
    # A fused projection's chunk-by-chunk split (_StridedShard) is no Shard subclass in torch 2.13.
    return bool(placement.is_shard()) or isinstance(placement, _compat.StridedShard)


def _why(mod: nn.Module, params: list[nn.Parameter]) -> str:
    if _is_norm(mod):
        return "norm, on the sequence shard" if any(isinstance(p, DTensor) for p in params) else "norm"
    return next((why for kind, why in _WHY.items() if isinstance(mod, kind)), type(mod).__name__)


def tp_report(blocks: Sequence[tuple[str, nn.Module]], tp: int, gathered: Sequence[str] = (), shown: int = 6) -> str:
    """One line for the start-up log, after `apply_tensor_parallel` split ``blocks`` (this rank's: a pipeline
    stage's under ``pipe_tp``): the share of their parameters one rank holds (``1 / tp`` when all is split), the
    modules whose parameters stay whole, by pattern, with the reason, and the regions run on the full width
    (``gathered``, `TPPlan.gathered`)."""
    local = total = 0
    whole: dict[str, tuple[str, int]] = {}
    adapters = {name: adapter_leaves(block) for name, block in blocks}
    for name, block in blocks:
        for rel, mod in block.named_modules():
            own = [p for _, p in mod.named_parameters(recurse=False)]
            if not own:
                continue
            total += sum(p.numel() for p in own)
            local += sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in own)
            if any(isinstance(p, DTensor) and any(_is_split(pl) for pl in p.placements) for p in own):
                continue  # split (a row split's bias stays whole with it)
            key = re.sub(r"\.\d+(?=\.|$)", ".*", f"{name}.{rel}" if rel else name, count=1)
            why = "low-rank adapter, whole while its pair is split" if rel in adapters.get(name, ()) else _why(mod, own)
            whole[key] = (why, whole.get(key, (why, 0))[1] + sum(p.numel() for p in own))
    if not total:
        return f"tensor parallel tp={tp}: the blocks hold no parameters"
    big = sorted(whole.items(), key=lambda kv: -kv[1][1])
    listed = ", ".join(f"{k} ({why})" for k, (why, _) in big[:shown]) + (
        f", +{len(big) - shown} more" if len(big) > shown else ""
    )
    line = (
        f"tensor parallel tp={tp}: each rank holds {local / total:.2f} of the blocks' parameters (1/tp = {1 / tp:.2f})"
    )
    line += f"; kept whole: {listed}" if big else ""
    if gathered:  # split weights, but the code between the projections runs whole on every rank (full_width.py)
        line += f"; run on the full width (outputs gathered): {', '.join(gathered)}"
    return line


def other_plans(
    model: nn.Module, main: TPPlan, tp: int, overrides: dict[str, str] | None = None
) -> tuple[list[TPPlan], list[str]]:
    """Plans for the model's other stacks of blocks, and a note for each kept whole: tensor parallelism over every
    stack, not the trunk alone.

    The trunk (`blocks.trunk.find_trunk`) is the stack a pipeline cuts and ZeRO-3 wraps: for Hugging Face T5 or BART
    the decoder, which holds the most parameters. The encoder is a second stack of blocks; kept whole, every tp rank
    would hold all its weights. Each other stack (`blocks.trunk.other_trunks`: >= 2 same-class blocks outside the
    trunk, 10 % of the model or more) gets a plan of its own, inferred, validated and checked on real values exactly
    as the trunk's (`infer_tp_plan(trunk=)`), and is split with it. A stack whose plan is refused stays whole, and the
    start-up log says so with the reason: the trunk's own refusals still stop the run. Under a pipeline a stack
    belongs to a stage's outer modules (an encoder to the first stage) and is split on that stage's ranks, without
    sequence parallelism (`compose._tensor_parallel`).

    Args:
        model: the whole model (before any split).
        main: the trunk's plan.
        tp: the tensor-parallel degree.
        overrides: the user's ``tp_plan``; a stack takes the patterns under its own path.
    """
    plans: list[TPPlan] = []
    notes: list[str] = []
    for stack in other_trunks(model, main.trunk):
        mine = {k: v for k, v in (overrides or {}).items() if k.startswith(stack.path + ".")}
        try:
            plan = infer_tp_plan(model, overrides=mine, trunk=stack)
            validate_tp(plan, tp)
            plans.append(check_local_shapes(model, plan, tp))
        except TPPlanError as err:
            first = str(err).splitlines()[0]
            notes.append(f"tensor parallel: {stack.path} kept whole on every rank ({first})")
    return plans, notes
