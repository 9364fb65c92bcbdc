"""The start-up line of tensor parallelism: how much of the blocks' parameters a rank holds, and what tp keeps
whole inside the blocks and why, so that a partial plan (an attention tp cannot split, a kept-whole MLP) is never a
surprise."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.blocks._probe import _is_norm
from lightning_par.parallel.tensor.adapters import adapter_leaves

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
