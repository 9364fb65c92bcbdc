"""Microbatches: a batch split along dim 0, and the signature that keys a schedule built for one batch shape."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_par import _compat, axes
from lightning_par.parallel.pipeline.slots import PipelineError

__all__ = ["split_microbatches"]


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """Split every tensor of ``batch`` (a tensor, tuple, list or dict, nested) into ``m`` chunks along dim 0.

    Non-tensor leaves and 0-dim tensors are repeated in every microbatch.
    """
    leaves, spec = _compat.tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise PipelineError("the batch holds no tensor with a batch dimension to split into microbatches")
    if len(sizes) > 1:
        raise PipelineError(
            f"the batch's tensors differ in size along dim 0 ({sorted(sizes)}); microbatches split every tensor "
            "along dim 0, so they must share the batch size"
        )
    size = sizes.pop()
    if size % m:
        raise PipelineError(
            f"the batch size per data-parallel rank ({size}) is not divisible by microbatches={m}; choose "
            f"microbatches in {axes.choices(size)} or a batch size that is a multiple of {m} (drop_last=True avoids a "
            "short last batch)"
        )
    chunks = [t.chunk(m) if isinstance(t, Tensor) and t.dim() > 0 else [t] * m for t in leaves]
    return [_compat.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]


def _signature(batch: Any) -> tuple:
    leaves, spec = _compat.tree_flatten(batch)
    return (str(spec), tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t) for t in leaves))
