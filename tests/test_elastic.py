"""Elastic restarts: 4 ranks -> 2 -> 4 on the loss curve of the uninterrupted 4-rank run.

What an elastic restart does (docs/launching.md, "Elastic"): the job restarts on another world size, loads the
latest checkpoint (resharded), and keeps the global batch: ``ParallelStrategy(global_batch=8)`` with a per-rank batch
of 2 accumulates 1 micro-batch on 4 ranks and 2 on 2 ranks. The data position carries over in samples, and
Lightning's batch progress is counted again in the new batches, so every step after a restart trains on the
samples of the uninterrupted run's step.

Runs, for the suite's GPT and a Hugging Face Llama built from a config (ZeRO-2, AdamW, one epoch of 6 steps, a
checkpoint after every step): A, 4 ranks uninterrupted; B, 2 ranks
resuming A after step 2 and training steps 3-4; C, 4 ranks resuming B after step 4 and training steps 5-6. B is
compared by each step's global gradient norm (Lightning logs an accumulated step's loss from its last micro-batch),
C by its losses, rank 0's batches and the final weights. Tolerances as
tests/test_zero.py: losses 1e-5 relative, parameters 1e-5 relative and 0.01 x lr absolute (fp32, another summation
order).

Spawns: 4 ranks, 2 ranks, 4 ranks (they depend on each other's checkpoints).
"""

from __future__ import annotations

from typing import Any

import pytest
from launch import run_jobs
from parity import params_close, rel

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

LR = 3e-3
STRATEGY = {"zero_stage": 2, "global_batch": 8}
BASE: dict[str, Any] = {"strategy": STRATEGY, "global_batch": 8, "dp": 4, "epoch_steps": 6}
MODELS = ("gpt", "hf_llama")  # the suite's GPT, and a Hugging Face Llama built from a config


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("elastic")
    every = {"ckpt_every_n_steps": 1}
    results: dict[str, dict[str, Any]] = {}
    full, two, grown = [], [], []
    for model in MODELS:  # each model's runs: A -> B -> C, in the same three spawns
        a, b = str(tmp / model / "a"), str(tmp / model / "b")
        job = {**BASE, "model": model}
        full.append({**job, "max_steps": 6, "ckpt_dir": a, **every})
        two.append({**job, "max_steps": 4, "resume": f"{a}/step=2.ckpt", "ckpt_dir": b, **every})
        grown.append({**job, "max_steps": 6, "resume": f"{b}/step=4.ckpt"})
    # A global batch the 2 ranks cannot make from per-rank batches of 2: refused when the loader is set up.
    two.append({**BASE, "strategy": {**STRATEGY, "global_batch": 6}, "max_steps": 4, "expect_error": True})
    for stage, jobs, nproc in (("full", full, 4), ("shrunk", two, 2), ("grown", grown, 4)):
        names = [*MODELS, "bad"][: len(jobs)]  # the refused job runs in the 2-rank stage only
        for name, got in zip(names, run_jobs(tmp / stage, jobs, nproc=nproc, timeout=400), strict=True):
            results[name if name == "bad" else f"{stage}_{name}"] = got
    return results


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_continue_the_four_rank_curve_with_accumulation(runs, model):
    full, shrunk = runs[f"full_{model}"], runs[f"shrunk_{model}"]
    assert shrunk["start_step"] == 2 and shrunk["layout"]["world_size"] == 2
    # 2 steps x 2 micro-batches: the accumulation was raised to keep the global batch of 8.
    assert len(shrunk["local_losses"]) == 4
    # Each step's gradient (its global norm, before clipping) is the 4-rank step's: same samples, same weights.
    # (Lightning logs a step's train_loss from its last micro-batch only, so the logged loss is not comparable.)
    assert len(shrunk["grad_norms"]) == 2
    assert rel(shrunk["grad_norms"], full["grad_norms"][2:4]) < 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_four_ranks_again_continue_the_curve_to_the_same_weights(runs, model):
    full, grown = runs[f"full_{model}"], runs[f"grown_{model}"]
    assert grown["start_step"] == 4 and grown["layout"]["world_size"] == 4
    assert rel(grown["losses"], full["losses"][4:6]) < 1e-5
    assert grown["batch_heads"] == full["batch_heads"][4:6]  # rank 0 reads the samples it read uninterrupted
    params_close(grown["params"], full["params"], rtol=1e-5, atol=0.01 * LR)


def test_a_global_batch_that_does_not_divide_is_refused_naming_the_fix(runs):
    got = runs["bad"]
    assert got["losses"] == []
    assert "global_batch=6 is not a multiple of the per-rank batch 2 x 2 data-parallel ranks" in got["error"]


def test_backends_that_fix_accumulation_elsewhere_refuse_global_batch():
    import lightning_par
    from lightning_par.fabric import ParallelStrategy as FabricStrategy

    with pytest.raises(ValueError, match="DeepSpeed: its engine fixes the gradient accumulation"):
        lightning_par.DeepSpeedParallelStrategy(zero_stage=2, global_batch=8)
    with pytest.raises(ValueError, match="accumulate in your loop"):
        FabricStrategy(zero_stage=2, global_batch=8)
