"""Local SGD / DiLoCo (``sync_every``) against plain data parallelism and a one-process simulation.

- ``sync_every=1`` with the outer SGD at lr 1 and no momentum averages the replicas after every step: with an inner
  optimizer linear in the gradient (SGD with momentum and weight decay) that is plain data parallelism, so losses
  and parameters must match ``zero_stage=0`` over the same ranks (1e-5 relative, fp32).
- ``sync_every=2`` with DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) and AdamW inside: the losses of every
  step (each the mean over all ranks) and the parameters after the last synchronisation must match
  `tests/_local_sgd_sim.py`, which trains the replicas one after the other in one process (1e-5 relative on
  losses; parameters 1e-5 relative and 0.01 x lr absolute, the AdamW tolerance of tests/test_zero.py).
- Composed with ZeRO inside each replica: 4 ranks as 2 replicas x 2 shards, ZeRO-1 and ZeRO-2 inside.
- A model we did not write: a Hugging Face Llama built from a config, 2 replicas, against the same simulation.
- Bad settings are refused when the strategy is built, naming the fix.
- Checkpoints: ``h2`` (2 replicas, ZeRO-0) and ``h2_zero1`` (2 replicas x 2 shards, ZeRO-1, saved in the background)
  save after every step; resumed on the same layout from inside a cycle (step 1: before the first sync, no outer
  momentum yet; step 3: after it) they must continue the uninterrupted run: the losses of every later step (the
  mean over all ranks, and replica 0's own) and the final weights, to 1e-5 relative (fp32). The layout rules: a
  sync-boundary checkpoint on 2 x 2 ranks instead of 2 x 1 continues with a warning; dp_replicate 2 -> 4, and a
  run without local SGD, are refused before training naming the fix. `lightning-par consolidate` writes the anchor.

Spawns: one 2-rank torchrun, one 4-rank torchrun, one process (the simulations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import params_close, rel

import lightning_par
from lightning_par.checkpoint import consolidate
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
    # a model we did not write: Hugging Face Llama built from a config (GQA, RMSNorm, rotary, SwiGLU)
    "h2_hf_llama": {"model": "hf_llama", "strategy": {"zero_stage": 0, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
}
FOUR: dict[str, dict[str, Any]] = {
    "h2_zero1": {"model": "gpt", "strategy": {"zero_stage": 1, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
    "h2_zero2": {"model": "gpt", "strategy": {"zero_stage": 2, "dp_replicate": 2, "sync_every": 2, **DILOCO}},
}
SIM: dict[str, dict[str, Any]] = {
    "sim_2x1": {"model": "gpt", "simulate": {"replicas": 2, "shards": 1, "every": 2, "lr": 0.7, "momentum": 0.9}},
    "sim_2x2": {"model": "gpt", "simulate": {"replicas": 2, "shards": 2, "every": 2, "lr": 0.7, "momentum": 0.9}},
    "sim_2x1_hf_llama": {"model": "hf_llama",
                         "simulate": {"replicas": 2, "shards": 1, "every": 2, "lr": 0.7, "momentum": 0.9}},
}


# Resumes: name -> (writer, step of its checkpoint, ranks, overrides of the writer's job).
RESUMES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "h2_from_1": ("h2", 1, 2, {}),
    "h2_from_3": ("h2", 3, 2, {}),
    "h2_without_local_sgd": ("h2", 3, 2, {"strategy": {"zero_stage": 0}, "expect_error": True}),
    "h2_zero1_from_1": ("h2_zero1", 1, 4, {}),
    "h2_zero1_from_3": ("h2_zero1", 3, 4, {}),
    # dp_shard 1 -> 2 (and ZeRO-0 -> ZeRO-2) from a synchronisation: allowed, with a warning.
    "h2_on_2x2": ("h2", 2, 4, {"strategy": FOUR["h2_zero2"]["strategy"], "record_warnings": True}),
    "h2_on_4_replicas": ("h2", 3, 4, {"strategy": {**TWO["h2"]["strategy"], "dp_replicate": 4}, "expect_error": True}),
}


def _ckpt(tmp: Path, writer: str, step: int) -> str:
    return str(tmp / writer / f"step={step}.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("local_sgd")
    results: dict[str, Any] = {"root": tmp}
    two, four = dict(TWO), dict(FOUR)
    for jobs, name, over in ((two, "h2", {"record_step_params": True}), (four, "h2_zero1", {})):
        jobs[name] = {**jobs[name], "ckpt_dir": str(tmp / name), "ckpt_every_n_steps": 1, **over}
    four["h2_zero1"]["strategy"] = {**four["h2_zero1"]["strategy"], "async_save": True}
    for name, (writer, step, nproc, over) in RESUMES.items():
        job = {**(two.get(writer) or four[writer]), "resume": _ckpt(tmp, writer, step), "ckpt_dir": None, **over}
        (two if nproc == 2 else four)[name] = job
    for jobs, nproc in ((two, 2), (four, 4), (SIM, 1)):
        specs = [{**BASE, **job} for job in jobs.values()]
        results.update(zip(jobs, run_jobs(tmp / f"n{nproc}", specs, nproc=nproc, timeout=400), strict=True))
    return results


@pytest.mark.slow
def test_sync_every_1_with_a_plain_outer_step_is_data_parallelism(runs):
    got, ref = runs["h1_sgd"], runs["ddp_sgd"]
    assert got["outer_syncs"] == STEPS and ref["outer_syncs"] is None
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "sim"), [("h2", "sim_2x1"), ("h2_zero1", "sim_2x2"), ("h2_zero2", "sim_2x2"),
                                           ("h2_hf_llama", "sim_2x1_hf_llama")])  # fmt: skip
def test_diloco_matches_the_one_process_simulation(runs, name, sim):
    got, ref = runs[name], runs[sim]
    assert got["outer_syncs"] == STEPS // 2
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=0.01 * LR)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("case", ["h2_from_1", "h2_from_3", "h2_zero1_from_1", "h2_zero1_from_3"])
def test_a_resume_inside_a_cycle_continues_the_uninterrupted_run(runs, case):
    writer, step, _, _ = RESUMES[case]
    got, ref = runs[case], runs[writer]
    assert got["start_step"] == step and got["resumed_from"] == f"step={step}.ckpt"
    assert got["outer_syncs"] == ref["outer_syncs"] == STEPS // 2  # the step count (cycle position) carried over
    assert rel(got["losses"], ref["losses"][step:]) < 1e-5
    assert rel(got["local_losses"], ref["local_losses"][step:]) < 1e-5  # replica 0's own weights and batches
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)  # the outer momentum shapes the last sync


@pytest.mark.slow
def test_a_resume_on_other_shards_per_replica_continues_with_a_warning(runs):
    # From a synchronisation every replica holds theta: the first loss over the same global batch is the writer's.
    got, ref = runs["h2_on_2x2"], runs["h2"]
    assert got["start_step"] == 2 and got["outer_syncs"] == STEPS // 2
    assert rel(got["losses"][:1], ref["losses"][2:3]) < 1e-5
    assert any("ranks now read other samples" in w for w in got["warnings"]), got["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("h2_on_4_replicas", "holds 2 local SGD replicas (dp_replicate=2) and this run has dp_replicate=4"),
        ("h2_without_local_sgd", "saved under local SGD (sync_every=2, dp_replicate=2)"),
    ],
)
def test_a_resume_on_other_replicas_is_refused_before_training(runs, case, message):
    got = runs[case]
    assert got["losses"] == [] and message in got["error"]
    assert "lightning-par consolidate" in got["error"]


@pytest.mark.slow
def test_consolidate_writes_the_anchor_and_replica_0s_optimizer(runs, tmp_path):
    # Saved after step 3, inside the second cycle: the anchor is the weights of the sync after step 2.
    with pytest.warns(UserWarning, match="the consolidated weights are the anchor of the last synchronisation"):
        consolidate(_ckpt(runs["root"], "h2", 3), tmp_path / "out.ckpt", safetensors=False)
    out = torch.load(tmp_path / "out.ckpt", weights_only=True)
    steps = runs["h2"]["step_params"]
    params_close({k: out["state_dict"][k] for k in steps[2]}, steps[2], rtol=0, atol=0)
    assert any(not out["state_dict"][k].equal(v) for k, v in steps[3].items())
    assert "local_sgd" not in out and len(out["optimizer_states"][0]["state"]) == len(steps[2])


def test_deepspeed_refuses_local_sgd_naming_the_native_engine():
    with pytest.raises(ValueError, match="runs on the native ZeRO 0-2 engine"):
        lightning_par.DeepSpeedParallelStrategy(zero_stage=2, dp_replicate=2, sync_every=2)
