"""Comparisons every parity test makes against its one-process reference."""

from __future__ import annotations

import torch


def rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long sequences (``b`` is the reference)."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def params_close(got: dict, ref: dict, rtol: float, atol: float) -> None:
    """Same parameter names, and every tensor within ``rtol`` / ``atol`` of the reference (names the first miss)."""
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
