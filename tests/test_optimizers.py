"""Optimizers that are not element-wise (torch's Adafactor and Muon) under the ZeRO stages.

ZeRO-1/2 step an element-wise optimizer on row slices of each weight; on such slices Adafactor's factored second
moments and Muon's orthogonalization would compute another update than one process, silently
(`test_row_slices_change_only_non_elementwise_updates`), so ZeRO-1/2 step them on whole parameters instead, each
owned by one rank (`lightning_par.parallel.zero.whole`). Both match one process under ZeRO-0, 1 and 2 here (with
gradient accumulation, clipping, a 2-stage pipeline (dp 1), and a checkpoint written under ZeRO-2 by 2 ranks and
resumed in one process); Muon under ZeRO-3 too (FSDP2 keeps DTensors, whose reductions span each whole weight).
torch 2.13's Adafactor cannot step DTensors (an in-place op on a partial placement), so ZeRO-3 refuses it before
the first step; LBFGS (one closure over every parameter) stays refused under ZeRO-1/2.

Tolerances. Adafactor: losses 1e-5 relative, parameters 1e-5 relative / 1e-6 absolute. Muon orthogonalizes in bf16
(torch's Newton-Schulz casts the momentum to bfloat16), so the 1e-7 float noise of a data-parallel gradient average
moves bf16 roundings: losses 1e-4 relative (measured 3e-5), and the parameters' distance from the reference within
5% of how far the reference moved; a row-sliced update is off by far more (> 10%).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.parallel.optimizers import (
    ELEMENTWISE_OPTIMIZERS,
    check_dtensor_step,
    check_elementwise,
    check_per_parameter,
    is_elementwise,
)
from lightning_par.parallel.zero.whole import assign_owners, check_not_tp_sharded


def _initial_params(model: str) -> dict[str, torch.Tensor]:
    # The weights every job starts from: the worker seeds with 0 and builds the model the same way.
    import lightning as L
    from _job_models import MODELS as BUILD

    L.seed_everything(0, verbose=False)
    return {n: p.detach().clone() for n, p in BUILD[model]().named_parameters()}


CKPT = {"epoch_steps": 1, "max_steps": 4}  # one step per epoch: a checkpoint at each epoch end (test_checkpoint.py)
# case ("model/layout") -> its 2-rank job; the one-process reference is the same job without the strategy.
CASES: dict[str, dict[str, Any]] = {
    "muon_lm/zero0": {"strategy": {"zero_stage": 0}},
    "muon_lm/zero1": {"strategy": "zero1"},
    "muon_lm/zero2": {"strategy": "zero2", "accumulate": 2},
    "muon_lm/zero3": {"strategy": "zero3"},
    "gpt_adafactor/zero0": {"strategy": {"zero_stage": 0}},
    "gpt_adafactor/zero1": {"strategy": "zero1", "accumulate": 2, "clip": 0.05},
    "gpt_adafactor/zero2": {"strategy": "zero2", **CKPT},  # also the checkpoint writer
    "gpt_adafactor/pipe_zero1": {"strategy": "pipe_zero1", "dp": 1},  # pp 2 x dp 1: the ranks share each batch
}


def _ref_job(case: str) -> dict[str, Any]:
    return reference_job({"model": case.split("/")[0], **{k: v for k, v in CASES[case].items() if k != "strategy"}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("optimizers")
    jobs = {c: {"model": c.split("/")[0], **job} for c, job in CASES.items()}
    jobs["gpt_adafactor/zero2"]["ckpt_dir"] = str(tmp / "ckpt")
    jobs["gpt_adafactor/zero3"] = {"model": "gpt_adafactor", "strategy": "zero3", "expect_error": True}
    tp_zero1 = {"tp": 2, "zero_stage": 1}  # tp 2 x dp 1: the tp-sharded weights are slices, refused
    jobs["gpt_adafactor/tp_zero1"] = {"model": "gpt_adafactor", "strategy": tp_zero1, "dp": 1, "expect_error": True}
    tp = {"tp": 2, "zero_stage": 0}  # stage 0 steps the tp DTensors themselves
    jobs["gpt_adafactor/tp"] = {"model": "gpt_adafactor", "strategy": tp, "dp": 1, "expect_error": True}
    got = dict(zip(jobs, run_jobs(tmp / "two", list(jobs.values()), nproc=2, timeout=300), strict=True))
    # One process: every case's reference (deduplicated), and the resume of the ZeRO-2 checkpoint after step 2.
    refs = {repr(sorted(_ref_job(c).items())): _ref_job(c) for c in CASES}
    ckpt = str(tmp / "ckpt" / "epoch=1.ckpt")  # a sharded folder: one process reads it under ParallelStrategy
    resume = {"model": "gpt_adafactor", **CKPT, "strategy": {"zero_stage": 0}, "resume": ckpt, "record_optim": True}
    one = run_jobs(tmp / "one", [*refs.values(), resume], nproc=1, timeout=300)
    got |= {f"{c}/ref": one[list(refs).index(repr(sorted(_ref_job(c).items())))] for c in CASES}
    return {**got, "resumed": one[-1], "ckpt": tmp / "ckpt" / "epoch=1.ckpt"}


def _close(model: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    if model == "muon_lm":
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


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_non_elementwise_optimizers_match_one_process(runs, case):
    got, ref = runs[case], runs[f"{case}/ref"]
    # One loss per batch: steps x accumulation.
    assert (
        len(got["losses"]) == len(ref["losses"]) == CASES[case].get("max_steps", 3) * CASES[case].get("accumulate", 1)
    )
    _close(case.split("/")[0], got, ref)
    if "clip" in CASES[case]:  # the clip bites, on the global norm of the owners' whole gradients
        assert min(ref["grad_norms"]) > CASES[case]["clip"]
        torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_whole_parameters_partition_the_gradients_over_the_ranks(runs):
    # Stage 2 frees every full gradient once reduced; each rank steps the whole gradients of the parameters it owns,
    # and the owners cover every parameter once.
    mem = runs["gpt_adafactor/zero2"]["mem_all"]
    total = runs["gpt_adafactor/zero2"]["total_param_bytes"]
    assert [m["model_grads_after_backward"] for m in mem] == [0, 0]
    assert sum(m["grads"] for m in mem) == total and all(0 < m["grads"] < total for m in mem)
    # ZeRO-1 under accumulation: full gradients live through the first micro-batch's backward (the most held after
    # a backward), and the second, which ends the accumulation, reduce-scatters and frees them as it goes.
    zero1 = runs["gpt_adafactor/zero1"]
    assert [m["model_grads_after_backward"] for m in zero1["mem_all"]] == [zero1["total_param_bytes"]] * 2
    # Muon's whole-parameter ZeRO-1 at 2 ranks sums the same two gradients as ZeRO-0's all-reduce: bit for bit.
    for name, value in runs["muon_lm/zero0"]["params"].items():
        assert torch.equal(runs["muon_lm/zero1"]["params"][name], value), name


@pytest.mark.slow
def test_a_whole_parameter_checkpoint_resumes_in_one_process(runs):
    from lightning_par.checkpoint import load_full_state

    full, resumed = runs["gpt_adafactor/zero2"], runs["resumed"]
    assert len(resumed["losses"]) == 2 and resumed["layout"]["world_size"] == 1
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=1e-6)
    # Every parameter's Adafactor state was saved by its owner and is the one the resumed run starts from.
    optimizer = load_full_state(runs["ckpt"])["optimizer_0"]
    # Its param_groups name every parameter, not only those of the rank whose copy of the groups was kept.
    assert sorted(n for g in optimizer["param_groups"] for n in g["params"]) == sorted(full["params"])
    saved = optimizer["state"]
    assert saved.keys() == resumed["optim_at_start"].keys() == full["params"].keys()
    for name, state in saved.items():
        assert state.keys() == resumed["optim_at_start"][name].keys()
        for k, v in state.items():
            assert torch.equal(resumed["optim_at_start"][name][k], v.float()), (name, k)
    assert all(float(st["step"]) == 2 for st in saved.values())


@pytest.mark.slow
def test_zero3_and_tensor_parallel_refuse_adafactor_before_the_first_step(runs):
    # ZeRO-3: torch's Adafactor crashed inside its first step on FSDP2's DTensors (aten.pow_ on a partial placement).
    got = runs["gpt_adafactor/zero3"]
    assert got["losses"] == [], "refused before training"
    assert got["error"].startswith("ValueError: torch.optim.")
    assert "Adafactor under zero_stage=3 (FSDP2)" in got["error"]
    assert "Use zero_stage=1 or 2 (strategy='zero1' / 'zero2', without tp)" in got["error"]
    # tp x ZeRO-1: a tensor-parallel shard is itself a slice of its weight, so no rank steps a whole one.
    got = runs["gpt_adafactor/tp_zero1"]
    assert got["losses"] == [] and got["error"].startswith("ValueError: Adafactor under zero_stage=1 with tensor")
    assert "is a tensor-parallel shard, itself a slice of its weight" in got["error"] and "Use tp=1" in got["error"]
    # tp at stage 0: the optimizer steps the DTensors, where Adafactor crashed inside its step as under ZeRO-3.
    got = runs["gpt_adafactor/tp"]
    assert got["losses"] == [] and "Adafactor under tensor parallelism: the parameters are DTensors" in got["error"]
    assert "Use tp=1, or an element-wise optimizer such as AdamW" in got["error"]


def test_owners_are_balanced_and_the_same_on_every_rank():
    load = [0, 0]
    assert assign_owners([10, 40, 30, 20], 2, load) == [0, 0, 1, 1] and load == [50, 50]  # largest first
    load = [60, 50]
    assert assign_owners([5, 5], 2, load) == [1, 0] and load == [65, 55]  # a tie goes to the rank owning least
    sizes = [7, 300, 64, 64, 1, 128, 33]
    owned = [0, 0, 0]
    owners = assign_owners(sizes, 3, owned)
    assert owners == assign_owners(sizes, 3, [0, 0, 0]) and max(owned) - min(owned) <= max(sizes[:1] + sizes)
    assert sorted(owned) == sorted(sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(3))


def test_coupled_and_dtensor_limited_optimizers_are_refused_naming_the_fix():
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match=r"LBFGS under zero_stage=2: its step couples every parameter.*zero_stage=0"):
        check_per_parameter(torch.optim.LBFGS(params), 2)
    check_per_parameter(torch.optim.Adafactor(params), 2)
    check_per_parameter(torch.optim.Muon(params), 1)
    with pytest.raises(ValueError, match=r"SparseAdam under zero_stage=1: it steps sparse gradients.*Use torch"):
        check_per_parameter(torch.optim.SparseAdam(params), 1)  # it failed inside its step on the dense gradients
    with pytest.raises(ValueError, match="cannot step"):
        check_dtensor_step(torch.optim.Adafactor(params), "zero_stage=3 (FSDP2)")
    check_dtensor_step(torch.optim.Muon(params), "zero_stage=3 (FSDP2)")
    with pytest.raises(ValueError, match=r"tensor-parallel shard.*Use tp=1"):
        check_not_tp_sharded("Muon", 1, ["blocks.0.attn.q.weight"])
    # `lightning_par_elementwise = True` keeps the user's way to opt a class into row slices; a subclass without it
    # is not trusted (it may override `step`).

    class RowAdafactor(torch.optim.Adafactor):
        lightning_par_elementwise = True

    class MyAdam(torch.optim.Adam):
        pass

    assert is_elementwise(RowAdafactor(params)) and not is_elementwise(MyAdam(params))
    assert is_elementwise(torch.optim.AdamW(params)) and not is_elementwise(torch.optim.Adafactor(params))


def _update(cls: type, full: bool) -> torch.Tensor:
    # Three steps of `cls` on one 8 x 6 weight, either whole or as two row slices (what a ZeRO-1/2 rank steps).
    torch.manual_seed(0)
    weight = torch.randn(8, 6)
    grads = [torch.randn(8, 6) for _ in range(3)]
    parts = [weight.clone().requires_grad_()] if full else [w.clone().requires_grad_() for w in weight.chunk(2)]
    opt = cls(parts, lr=0.01)
    for g in grads:
        for p, gp in zip(parts, [g] if full else list(g.chunk(2)), strict=True):
            p.grad = gp.clone()
        opt.step()
    return torch.cat([p.detach() for p in parts]) - weight


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_row_slices_change_only_non_elementwise_updates(cls):
    # Every optimizer ZeRO-1/2 accepts gives the same update on row slices as on the whole weight ...
    torch.testing.assert_close(_update(cls, full=False), _update(cls, full=True), rtol=1e-6, atol=1e-7)
    # ... and the two others do not (the silent difference that makes ZeRO-1/2 step them on whole parameters, and
    # DeepSpeed, which steps flat partitions, refuse them).
    for refused in (torch.optim.Adafactor, torch.optim.Muon):
        whole, sliced = _update(refused, full=True), _update(refused, full=False)
        assert float((sliced - whole).norm() / whole.norm()) > 0.1, refused.__name__
        with pytest.raises(ValueError, match="is not known to be element-wise"):
            check_elementwise(refused([torch.nn.Parameter(torch.zeros(2, 2))]), "DeepSpeed: flat partitions")
    check_elementwise(cls([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.01), "DeepSpeed: flat partitions")
