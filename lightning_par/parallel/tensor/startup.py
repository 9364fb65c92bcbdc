"""Tensor parallelism at start-up, once the model is split: a pre-flight forward of the whole split model, and the
line of the start-up log that says what was split and what kept whole.

**The pre-flight**: one forward of the whole model on the probe's input (eval mode, no gradients), on every tp
rank, before the first step. The checks before the split run block 0 on per-rank shapes and values (`check`,
`simulate`); code around and between the regions can still meet a DTensor it does not expect (Hugging Face
Qwen4-Exp's hyper-connections mix the hidden state with weights of their own before the attention: "aten.mul.Tensor
got mixed torch.Tensor and DTensor"). Here that failure stops set-up with the module that raised it and a fix that
is always correct, instead of the first step crashing. Every tp rank runs the same code on the same input, so all
of them fail alike.

**The report**: how much of the blocks' parameters a rank holds, and what tp keeps whole inside the blocks and why,
so that a partial plan (an attention tp cannot split, a kept-whole MLP) is never a surprise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.blocks._probe import _is_norm, eval_mode, probe_call, running_modules
from lightning_par.parallel.tensor.adapters import adapter_leaves
from lightning_par.parallel.tensor.plan_types import TPPlanError


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
    nn.MultiheadAttention: "torch's packed q/k/v attention, not split",
    nn.Linear: "a projection in no column/row pair",
}


def _why(mod: nn.Module, params: list[nn.Parameter]) -> str:
    if _is_norm(mod):
        return "norm, on the sequence shard" if any(isinstance(p, DTensor) for p in params) else "norm"
    return next((why for kind, why in _WHY.items() if isinstance(mod, kind)), type(mod).__name__)


def tp_report(blocks: Sequence[tuple[str, nn.Module]], tp: int, shown: int = 6) -> str:
    """One line for the start-up log, after `apply_tensor_parallel` split ``blocks`` (this rank's: a pipeline
    stage's under ``pipe_tp``): the share of their parameters one rank holds (``1 / tp`` when all is split) and
    the modules whose parameters stay whole, by pattern, with the reason."""
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
            if any(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) for p in own):
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
    return line + (f"; kept whole: {listed}" if big else "")
