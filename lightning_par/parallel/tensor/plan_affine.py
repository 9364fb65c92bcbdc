"""Recognise projections that are not ``nn.Linear``: any leaf module whose forward is an affine map of its input.

Hugging Face's ``Conv1D`` (GPT-2, GPT, ...) stores its weight as ``[in, out]`` and computes ``x @ W + b``; other
libraries wrap ``F.linear`` in their own class. Tensor parallelism splits such a module like a Linear once it knows
the weight's layout, which this module decides by probing the forward on a small input: it is compared against
``x @ W (+ b)`` and ``F.linear(x, W, b)``. Weights on the meta device cannot be probed numerically; the layout is
then read from an ``nf`` (output features) attribute, or the module is not treated as a projection.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.blocks._probe import _is_norm


@dataclasses.dataclass(frozen=True)
class Affine:
    """Widths and weight layout of a projection: ``transposed`` for ``[in, out]`` weights (``y = x @ W + b``)."""

    in_features: int
    out_features: int
    transposed: bool


def _params(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    own = dict(m.named_parameters(recurse=False))
    w, b = own.get("weight"), own.get("bias")
    if w is None or w.dim() != 2 or set(own) - {"weight", "bias"} or (b is not None and b.dim() != 1):
        return None
    return w, b


def affine(m: nn.Module) -> Affine | None:
    """The projection `m` is, or ``None``: a Linear, or a leaf with a 2-D ``weight`` whose forward is affine.

    Args:
        m: any module; it is run once on a (2, in) input from a private generator when it is not a Linear (no
            autograd graph, no draw from the user's RNG streams).
    """
    if isinstance(m, nn.Linear):
        return Affine(m.in_features, m.out_features, False)
    if isinstance(m, nn.Embedding) or _is_norm(m) or any(True for _ in m.children()):
        return None
    got = _params(m)
    if got is None:
        return None
    w, b = got
    rows, cols = int(w.shape[0]), int(w.shape[1])
    if w.is_meta:
        nf = getattr(m, "nf", None)  # Conv1D(nf, nx) keeps its output width; nothing else says the layout
        if isinstance(nf, int) and nf == cols and (b is None or b.shape[0] == cols):
            return Affine(rows, cols, True)
        return None
    gen = torch.Generator(device=w.device).manual_seed(0)
    with torch.no_grad():
        for transposed, width in ((True, rows), (False, cols)):
            x = torch.randn(2, width, generator=gen, device=w.device, dtype=w.dtype)
            try:
                # A bias of the other width (a router's [n_experts, hidden] weight with an [n_experts] bias) fails
                # the transposed reading.
                want = x @ w + (b if b is not None else 0) if transposed else F.linear(x, w, b)
                y = m(x)
            except Exception:  # not callable on a plain 2-D tensor: not a projection we can split
                continue
            if isinstance(y, torch.Tensor) and y.shape == want.shape and torch.allclose(y, want, rtol=1e-4, atol=1e-5):
                return Affine(rows, cols, True) if transposed else Affine(cols, rows, False)
    return None


def affine_modules(mods: dict[str, nn.Module]) -> dict[str, Affine]:
    """``name -> Affine`` for every projection among ``mods`` (Linears and affine leaves)."""
    return {n: a for n, m in mods.items() if (a := affine(m)) is not None}
