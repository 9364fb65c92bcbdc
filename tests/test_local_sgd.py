"""Local SGD / DiLoCo (``sync_every``) against plain data parallelism and a one-process simulation.

- ``sync_every=1`` with the outer SGD at lr 1 and no momentum averages the replicas after every step: with an inner
  optimizer linear in the gradient (SGD with momentum and weight decay) that is plain data parallelism, so losses
  and parameters must match ``zero_stage=0`` over the same ranks (1e-5 relative, fp32).
- ``sync_every=2`` with DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) and AdamW inside: the losses of every
  step (each the mean over all ranks) and the parameters after the last synchronisation must match
  `tests/_local_sgd_sim.py`, which trains the replicas one after the other in one process (1e-5 relative on
  losses; parameters 1e-5 relative and 0.01 x lr absolute, the AdamW tolerance of tests/test_zero.py).
- Composed with ZeRO inside each replica: 4 ranks as 2 replicas x 2 shards, ZeRO-1 and ZeRO-2 inside.
- Bad settings are refused when the strategy is built, naming the fix; checkpoints (not supported yet) before the
  first step.

Spawns: one 2-rank torchrun, one 4-rank torchrun, one process (the simulations).
"""

from __future__ import annotations

from typing import Any

import pytest
from launch import run_jobs
from parity import params_close, rel

import lightning_par
from lightning_par.config import ParallelConfigError

STEPS, LR = 4, 3e-3
DILOCO = {"outer_lr": 0.7, "outer_momentum": 0.9}
BASE: dict[str, Any] = {"steps": STEPS, "global_batch": 8}
TWO: dict[str, dict[str, Any]] = {
    "ddp": {"model": "gpt", "strategy": {"zero_stage": 0}},
    "ddp_sgd": {"model": "gpt_sgd", "strategy": {"zero_stage": 0}},
    "h1_sgd": {"model": "gpt_sgd", "strategy": {"zero_stage": 0, "dp_replicate": 2, "sync_every": 1,
                                                "outer_lr": 1.0, "outer_momentum": 0.0}},
    "h2": {"model": "gpt", "strategy": {"zero_stage": 0, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
}
FOUR: dict[str, dict[str, Any]] = {
    "h2_zero1": {"model": "gpt", "strategy": {"zero_stage": 1, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
    "h2_zero2": {"model": "gpt", "strategy": {"zero_stage": 2, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
}
SIM: dict[str, dict[str, Any]] = {
    "sim_2x1": {"model": "gpt", "simulate": {"replicas": 2, "shards": 1, "every": 2, "lr": 0.7, "momentum": 0.9}},
    "sim_2x2": {"model": "gpt", "simulate": {"replicas": 2, "shards": 2, "every": 2, "lr": 0.7, "momentum": 0.9}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("local_sgd")
    results: dict[str, dict[str, Any]] = {}
    two = {**TWO, "h2_ckpt": {**TWO["h2"], "ckpt_dir": str(tmp / "ckpts"), "expect_error": True}}
    for jobs, nproc in ((two, 2), (FOUR, 4), (SIM, 1)):
        specs = [{**BASE, **job} for job in jobs.values()]
        results.update(zip(jobs, run_jobs(tmp / f"n{nproc}", specs, nproc=nproc, timeout=400)))
    return results


def test_sync_every_1_with_a_plain_outer_step_is_data_parallelism(runs):
    got, ref = runs["h1_sgd"], runs["ddp_sgd"]
    assert got["outer_syncs"] == STEPS and ref["outer_syncs"] is None
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("name", "sim"), [("h2", "sim_2x1"), ("h2_zero1", "sim_2x2"), ("h2_zero2", "sim_2x2")])
def test_diloco_matches_the_one_process_simulation(runs, name, sim):
    got, ref = runs[name], runs[sim]
    assert got["outer_syncs"] == STEPS // 2
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=0.01 * LR)


def test_the_replicas_train_apart_between_syncs(runs):
    # From the same weights, the loss before any step is the same; after one step it is not: plain data
    # parallelism stepped on the gradient averaged over both ranks, each DiLoCo replica on its own.
    ddp, apart = runs["ddp"]["losses"], runs["h2"]["losses"]
    assert rel(apart[:1], ddp[:1]) < 1e-6
    assert rel(apart[1:2], ddp[1:2]) > 1e-4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_replicate": 1, "sync_every": 4}, "set dp_replicate to the number of replicas"),
        ({"dp_replicate": 2, "pp": 2, "sync_every": 4}, "with pp=2: local SGD is not supported there"),
        ({"dp_replicate": 2, "ep": 2, "sync_every": 4}, "with ep=2: local SGD is not supported there"),
        ({"dp_replicate": 2, "zero_stage": 3, "sync_every": 4}, "use zero_stage=1 or 2 inside each replica"),
        ({"dp_replicate": 2, "sync_every": 0}, "must be an int >= 1"),
        ({"dp_replicate": 2, "sync_every": 2, "outer_momentum": 1.0}, "DiLoCo uses 0.7 and 0.9"),
    ],
)
def test_bad_settings_are_refused_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        lightning_par.ParallelStrategy(**kwargs)


def test_checkpoints_are_refused_before_the_first_step(runs):
    # Not supported yet (docs/strategies.md, "Local SGD"): refused before training, not at the first save.
    got = runs["h2_ckpt"]
    assert got["losses"] == []
    assert "a ModelCheckpoint callback with sync_every (local SGD)" in got["error"]
    assert "enable_checkpointing=False" in got["error"]


def test_deepspeed_refuses_local_sgd_naming_the_native_engine():
    with pytest.raises(ValueError, match="runs on the native ZeRO 0-2 engine"):
        lightning_par.DeepSpeedParallelStrategy(zero_stage=2, dp_replicate=2, sync_every=2)
