"""Optimizers that are not element-wise (torch's Adafactor and Muon) under the ZeRO stages.

ZeRO-1/2 step the optimizer on row slices of each weight, where Adafactor's factored second moments and Muon's
orthogonalization would compute another update than one process, silently; they are refused before the first step,
naming the fix. ZeRO-0 steps whole weights, and ZeRO-3 keeps the parameters as DTensors (reductions span each whole
weight), so Muon matches one process under both and Adafactor under ZeRO-0 (torch 2.13's Adafactor cannot step
DTensors: an in-place op on a partial placement). Adafactor: losses 1e-5 relative, parameters 1e-5 relative / 1e-6
absolute. Muon orthogonalizes in bf16 (torch's Newton-Schulz casts the momentum to bfloat16), so the 1e-7 float
noise of a data-parallel gradient average moves bf16 roundings: losses 1e-4 relative (measured 3e-5), and the
parameters' distance from the reference within 5% of how far the reference moved; a row-sliced update is off by far
more (`test_row_slices_change_only_non_elementwise_updates`), which is why ZeRO-1/2 refuse it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.parallel.optimizers import ELEMENTWISE_OPTIMIZERS, check_elementwise

MODELS = ("gpt_adafactor", "muon_lm")


def _initial_params(model: str) -> dict[str, torch.Tensor]:
    # The weights every job starts from: the worker seeds with 0 and builds the model the same way.
    import lightning as L
    from _worker import MODELS as BUILD

    L.seed_everything(0, verbose=False)
    return {n: p.detach().clone() for n, p in BUILD[model]().named_parameters()}
REFUSED = [(m, s) for m in MODELS for s in ("zero1", "zero2")] + [("gpt_adafactor", "pipe_zero1")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("optimizers")
    jobs = {"muon_lm/zero3": {"model": "muon_lm", "strategy": "zero3"}}
    jobs |= {f"{m}/zero0": {"model": m, "strategy": {"zero_stage": 0}} for m in MODELS}
    jobs |= {f"{m}/{s}": {"model": m, "strategy": s, "expect_error": True} for m, s in REFUSED}
    refs = run_jobs(tmp / "ref", [reference_job({"model": m}) for m in MODELS], nproc=1)
    got = run_jobs(tmp, list(jobs.values()), nproc=2, timeout=300)
    return {**dict(zip(jobs, got)), **{f"{m}/ref": r for m, r in zip(MODELS, refs)}}


@pytest.mark.parametrize("case", ["muon_lm/zero3", "muon_lm/zero0", "gpt_adafactor/zero0"])
def test_whole_weight_layouts_match_one_process(runs, case):
    got, ref = runs[case], runs[f"{case.split('/')[0]}/ref"]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    if case.startswith("muon"):
        assert rel(got["losses"], ref["losses"]) < 1e-4
        init = _initial_params("muon_lm")
        moved = torch.cat([(ref["params"][n] - init[n]).flatten() for n in init])
        apart = torch.cat([(got["params"][n] - ref["params"][n]).flatten() for n in init])
        # The update's own size is the yardstick, as for the row-slice test below (measured 0.9% under ZeRO-0, 2.5%
        # under ZeRO-3, where DTensor's matmuls sum the shards' bf16 products in another order).
        assert float(apart.norm() / moved.norm()) < 0.05
    else:
        assert rel(got["losses"], ref["losses"]) < 1e-5
        params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "strategy"), REFUSED)
def test_zero1_zero2_refuse_them_before_the_first_step(runs, model, strategy):
    got = runs[f"{model}/{strategy}"]
    cls = "Adafactor" if model == "gpt_adafactor" else "Muon"
    assert got["losses"] == [], "refused before training"
    assert got["error"].startswith("ValueError: torch.optim.") and f"{cls} under zero_stage=" in got["error"]
    assert "is not known to be element-wise" in got["error"]
    assert "Use zero_stage=0 (every rank steps whole weights), or native zero_stage=3" in got["error"]
    assert f"{cls}.lightning_par_elementwise = True" in got["error"]


def _update(cls: type, full: bool) -> torch.Tensor:
    # Three steps of `cls` on one 8 x 6 weight, either whole or as two row slices (what a ZeRO-1/2 rank steps).
    torch.manual_seed(0)
    weight = torch.randn(8, 6)
    grads = [torch.randn(8, 6) for _ in range(3)]
    parts = [weight.clone().requires_grad_()] if full else [w.clone().requires_grad_() for w in weight.chunk(2)]
    opt = cls(parts, lr=0.01)
    for g in grads:
        for p, gp in zip(parts, [g] if full else list(g.chunk(2))):
            p.grad = gp.clone()
        opt.step()
    return torch.cat([p.detach() for p in parts]) - weight


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_row_slices_change_only_non_elementwise_updates(cls):
    # Every optimizer ZeRO-1/2 accepts gives the same update on row slices as on the whole weight ...
    torch.testing.assert_close(_update(cls, full=False), _update(cls, full=True), rtol=1e-6, atol=1e-7)
    # ... and the two they refuse do not (that is the silent difference the refusal prevents).
    for refused in (torch.optim.Adafactor, torch.optim.Muon):
        whole, sliced = _update(refused, full=True), _update(refused, full=False)
        assert float((sliced - whole).norm() / whole.norm()) > 0.1, refused.__name__
        with pytest.raises(ValueError, match="is not known to be element-wise"):
            check_elementwise(refused([torch.nn.Parameter(torch.zeros(2, 2))]), "zero_stage=1: row slices")
    check_elementwise(cls([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.01), "zero_stage=1: row slices")
