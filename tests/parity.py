"""Comparisons every parity test makes against its one-process reference.

``LP_MEASURE=FILE`` appends every value `rel` and `wrong_share` compute to FILE (one JSON line each, with the test
that asked): how the tolerances beside the low-precision checks were measured, against the same checks run under
tools/mutate.py's deliberately broken builds (docs/testing.md, "Tolerances").
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def _measured(what: str, value: float) -> float:
    path = os.environ.get("LP_MEASURE")
    if path:
        row = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what, "value": value}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        # Measuring a broken run (tools/mutate.py --measure): every comparison of a test is recorded, not only the
        # values up to its first failing assert. Never set outside a measurement: every bound passes.
        if os.environ.get("LP_MEASURE_ALL") == "1":
            return 0.0
    return value


def rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long, non-empty sequences (``b`` is the reference): a run that
    logged fewer steps fails here instead of passing on its prefix."""
    assert len(a) == len(b) > 0, f"curves of {len(a)} and {len(b)} points"
    return _measured("rel", max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)))


def wrong_share(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> float:
    """How much of the reference's training a run got wrong: ``‖got − ref‖ / ‖ref − init‖`` over every parameter
    (one global L2 norm, fp64). A run that never updated scores 1.0 whatever its precision, so a bound below 1 can
    fail; element-wise bounds on low-precision AdamW runs could not (Adam moves every element by about lr per step,
    and a bf16 gradient's noise decides the sign of the near-zero ones).

    Args:
        got: the run's parameters; ``ref``: the reference's after the same steps; ``init``: both runs' initial
            values (the reference's ``init_state``, recorded with ``record_init``).
    """
    assert ref and got.keys() == ref.keys() and ref.keys() <= init.keys(), sorted(ref.keys() - init.keys())[:5]
    wrong = sum(float((got[k].double() - ref[k].double()).pow(2).sum()) for k in ref)
    moved = sum(float((ref[k].double() - init[k].double()).pow(2).sum()) for k in ref)
    assert moved > 0, "the reference did not train"
    return _measured("wrong_share", (wrong / moved) ** 0.5)


def params_close(got: dict, ref: dict, rtol: float, atol: float) -> None:
    """Same parameter names (at least one), and every tensor within ``rtol`` / ``atol`` of the reference (names the
    first miss), where ``atol`` is at least ``rtol`` times the tensor's largest value.

    That floor makes ``rtol`` relative to the tensor, not to each element: a split matmul sums its partial products
    in another order, and the fp32 noise that leaves a weight after a few steps scales with the tensor's values, so
    an element near zero would otherwise be held to a bound far below that noise (Hugging Face Llama under tp 4 on
    an AMD EPYC machine: one element of a down_proj, 5e-3 in a tensor whose largest value is 0.075, off by 2.2e-7,
    3e-6 of the tensor's scale, against the 1.5e-7 the per-element bound allowed). A broken run is far outside it:
    the same Llama one step short misses by at least 3.6e-2 of the scale in every weight tensor, trained on half
    the batch by 0.16 (measured 2026-12-05).
    """
    assert ref and got.keys() == ref.keys(), (sorted(got)[:5], sorted(ref)[:5])
    for k in ref:
        floor = rtol * float(ref[k].abs().max()) if ref[k].numel() and ref[k].is_floating_point() else 0.0
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=max(atol, floor), msg=lambda m, k=k: f"{k}: {m}")


def fp32_parity(got: dict, ref: dict, steps: int) -> None:
    """An fp32 run against its one-process reference, the suite's bounds: ``steps`` losses on both sides, losses
    and gradient norms within 1e-5 relative, every parameter within 1e-5 relative / 1e-7 absolute (`params_close`)."""
    assert len(got["losses"]) == len(ref["losses"]) == steps
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


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
