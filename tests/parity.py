"""Comparisons every parity test makes against its one-process reference."""

from __future__ import annotations

from typing import Any

import torch


def rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long sequences (``b`` is the reference)."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def params_close(got: dict, ref: dict, rtol: float, atol: float) -> None:
    """Same parameter names, and every tensor within ``rtol`` / ``atol`` of the reference (names the first miss)."""
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def clipped_fit_matches(got: dict, ref: dict, param_atol: float) -> None:
    """A fit with accumulation, clipping, validation and test against its reference: clipping is active (norms far
    above the clip value) and uses the true global norm; losses, parameters and the val/test metrics agree."""
    assert min(ref["grad_norms"]) > 0.5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=param_atol)
    for split, key in (("val", "val_loss"), ("val", "val_acc"), ("test", "test_loss")):
        assert abs(got[split][key] - ref[split][key]) <= 1e-5 * abs(ref[split][key]), (split, key)


def without_tied_copies(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``got["params"]`` with the second copy of each pipeline-tied weight removed, after checking it bit-identical
    to the first (a tied weight has one copy per end stage, each under its rank's name for it)."""
    params = dict(got["params"])
    for names in got.get("tied", []):
        canonical = next(n for n in names if n in ref["params"])
        for alias in [n for n in names if n in params and n != canonical]:
            assert params.pop(alias).equal(params[canonical]), alias
    return params
