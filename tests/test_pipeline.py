"""Pipeline parallelism on 2 ranks (``pipe``: pp 2) and 4 ranks (``pipe_zero1`` / ``pipe_zero2``: pp 2 x dp 2)
against the same training in one process (same seed, same global batches).

Each spawn runs many jobs (a spawn costs seconds). Tolerances as in tests/test_zero.py: fp32 losses and gradient
norms 1e-5 relative (measured ~2e-7: microbatching only changes the summation order); parameters after SGD to
1e-5 relative, after AdamW to 1% of the learning rate (test_zero.py says why); low precision losses 2e-2.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel, wrong_share  # same names: every parameter came back from some stage

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

LR = 3e-3
# Low precision, against the one-process run in the same precision (SGD: updates linear in the gradients). Bounds set
# between measured runs (tools/mutate.py --measure, 2026-12-04; docs/testing.md, "Tolerances"): correct runs at
# most loss 1.3e-4 / wrong share 0.0039 (bf16-true); with one microbatch of each step skipped at least 9.9e-3 /
# 0.144. Margins: 7.9x / 7.8x above the correct, 9.9x / 4.8x below the broken.
LOW_LOSS = 1e-3
LOW_WRONG = 0.03
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")

# 2 ranks, pp 2 (dp 1): every schedule torch has, both reference models, user models with Sequential / ModuleDict
# trunks, accumulation + clipping, every precision, activation checkpointing.
JOBS_2: dict[str, dict[str, Any]] = {
    **{f"gpt_{s}": {"model": "gpt4", "strategy": {"pp": 2, "pp_schedule": s}} for s in SCHEDULES},
    "llama_pipe": {"model": "llama4", "strategy": "pipe", "validate": True, "test": True, "predict": True,
                   "memory_logger": True},
    "llama_zbv": {"model": "llama4", "strategy": {"pp": 2, "pp_schedule": "zbv"}, "validate": True},
    # Lightning's sanity check runs validation through the pipeline before the first training step.
    "gpt_validate": {"model": "gpt4", "strategy": "pipe", "validate": True, "memory_logger": True,
                     "num_sanity_val_steps": 2},
    "seq_trunk": {"model": "seq_trunk", "strategy": {"pp": 2}, "validate": True, "memory_logger": True},
    "dict_trunk": {"model": "dict_trunk", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "validate": True},
    "sgd_accum_clip": {"model": "gpt4_sgd", "strategy": {"pp": 2}, "accumulate": 2, "clip": 0.05},
    "sgd_accum_clip_zb": {"model": "gpt4_sgd", "strategy": {"pp": 2, "pp_schedule": "interleaved_zb"},
                          "accumulate": 2, "clip": 0.05},
    "sgd_bf16_mixed": {"model": "gpt4_sgd", "strategy": {"pp": 2}, "precision": "bf16-mixed"},
    "sgd_16_mixed": {"model": "gpt4_sgd", "strategy": {"pp": 2}, "precision": "16-mixed"},
    "sgd_bf16_true": {"model": "gpt4_sgd", "strategy": {"pp": 2}, "precision": "bf16-true"},
    "sgd_ac_full_zbv": {"model": "gpt4_sgd", "strategy": {"pp": 2, "activation_checkpointing": "full",
                                                          "pp_schedule": "zbv"}},
    "sgd_ac_selective_op": {"model": "gpt4_sgd", "strategy": {"pp": 2, "activation_checkpointing": "selective_op",
                                                              "pp_schedule": "interleaved_1f1b"}},
    "sgd_ac_selective": {"model": "gpt4_sgd", "strategy": {"pp": 2, "activation_checkpointing": "selective"}},
    # More stages per rank than the looped interleaved schedules' 2 (vpp; 8 blocks: 6 or 8 stages over 2 ranks).
    "sgd_interleaved_vpp4": {"model": "gpt8_sgd", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b", "vpp": 4}},
    "sgd_looped_bfs_vpp3": {"model": "gpt8_sgd", "strategy": {"pp": 2, "pp_schedule": "looped_bfs", "vpp": 3}},
    "sgd_interleaved_zb_vpp3_accum": {"model": "gpt8_sgd", "strategy": {"pp": 2, "pp_schedule": "interleaved_zb",
                                                                        "vpp": 3}, "accumulate": 2},
}  # fmt: skip

# 4 ranks, pp 2 x dp 2.
JOBS_4: dict[str, dict[str, Any]] = {
    "gpt_zero1": {"model": "gpt4", "strategy": "pipe_zero1", "validate": True, "memory_logger": True},
    "llama_zero1": {"model": "llama4", "strategy": "pipe_zero1"},
    "sgd_zero2_accum_clip": {"model": "gpt4_sgd", "strategy": "pipe_zero2", "accumulate": 2, "clip": 0.05},
    "dict_zero1_zbv": {"model": "dict_trunk", "strategy": {"pp": 2, "zero_stage": 1, "pp_schedule": "zbv"}},
    "gpt_zero3": {"model": "gpt4", "strategy": "pipe_zero3", "validate": True},
    "sgd_zero3_gpipe_accum_clip": {"model": "gpt4_sgd", "strategy": {"pp": 2, "zero_stage": 3, "pp_schedule": "gpipe"},
                                   "accumulate": 2, "clip": 0.05},
    "sgd_zero2_zb_accum": {"model": "gpt4_sgd", "strategy": {"pp": 2, "zero_stage": 2, "pp_schedule": "interleaved_zb"},
                           "accumulate": 2},
}  # fmt: skip


def _reference(job: dict[str, Any]) -> dict[str, Any]:
    return reference_job({k: v for k, v in job.items() if k != "strategy"})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    tmp = tmp_path_factory.mktemp("pipeline")
    jobs = {**JOBS_2, **JOBS_4}
    refs = run_jobs(tmp, [_reference(j) for j in jobs.values()], nproc=1, timeout=600)
    got2 = run_jobs(tmp, [{**j, "dp": 1} for j in JOBS_2.values()], nproc=2, timeout=600)
    got4 = run_jobs(tmp, [{**j, "dp": 2} for j in JOBS_4.values()], nproc=4, timeout=600)
    return dict(zip(jobs, zip([*got2, *got4], refs, strict=True), strict=True))


FP32 = [k for k in {**JOBS_2, **JOBS_4} if "bf16" not in k and "16_mixed" not in k]


@pytest.mark.parametrize("name", FP32)
def test_fp32_matches_one_process(results, name):
    got, ref = results[name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5  # the norm over all stages (clipping uses it)
    sgd = "sgd" in name or "trunk" in name
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7 if sgd else 0.01 * LR)
    if "clip" in name:
        assert min(ref["grad_norms"]) > 0.5  # clipping at 0.05 is active


@pytest.mark.parametrize("name", [k for k in JOBS_2 if "bf16" in k or "16_mixed" in k])
def test_low_precision_matches_one_process(results, name):
    got, ref = results[name]
    assert all(math.isfinite(x) for x in got["losses"])
    assert rel(got["losses"], ref["losses"]) < LOW_LOSS
    assert wrong_share(got["params"], ref["params"], ref["init_state"]) < LOW_WRONG


@pytest.mark.parametrize("name", [k for k, j in {**JOBS_2, **JOBS_4}.items() if j.get("validate")])
def test_validation_runs_through_the_pipeline(results, name):
    got, ref = results[name]
    assert got["val"].keys() == ref["val"].keys()
    for key, value in ref["val"].items():  # val_acc is a torchmetrics Metric updated on the last stage only
        assert got["val"][key] == pytest.approx(value, rel=1e-5), key
    if "test" in ref:
        assert got["test"]["test_loss"] == pytest.approx(ref["test"]["test_loss"], rel=1e-5)
    if "predict" in ref:
        # dp 1: every rank predicts every sample; the last stage's predictions reach global rank 0.
        got_rows, ref_rows = torch.cat(got["predict"]), torch.cat(ref["predict"])
        assert got_rows.shape == ref_rows.shape and len(got_rows) >= 8
        assert (got_rows == ref_rows).float().mean() > 0.99  # argmax ids; a near-tie may flip on 1e-7 differences


@pytest.mark.parametrize("name", [k for k, j in {**JOBS_2, **JOBS_4}.items() if j.get("memory_logger")])
def test_logger_on_rank_0_sees_the_last_stages_loss(results, name):
    got, ref = results[name]
    logged = [m["train_loss"] for m in got["logged"] if "train_loss" in m]
    # Global rank 0 runs the first stage; the last stage (the last rank of pp group 0) computed the loss.
    last = 1
    assert len(logged) == len(ref["losses"])
    assert logged == pytest.approx(got["losses"], rel=0)  # the logger and callback_metrics agree
    if name in JOBS_2:
        assert logged == pytest.approx(got["local_losses_all"][last], rel=1e-6)  # the last stage's own loss
    assert rel(logged, ref["losses"]) < 1e-5  # and that is the one-process loss (over dp ranks: their mean)
    if name == "seq_trunk":
        # A sum-reduced value logged per microbatch adds up to the batch's: 8 samples x 32 tokens.
        tokens = [m["tokens"] for m in got["logged"] if "tokens" in m]
        assert tokens and all(t == 8 * 32 for t in tokens)


def test_each_rank_holds_only_its_stage(results):
    got, ref = results["gpt_1f1b"]
    shapes = ref["param_shapes"]
    nbytes = {n: math.prod(s) * 4 for n, s in shapes.items()}
    total = sum(nbytes.values())
    # Balanced by parameter count (embedding lookups cost nothing, the head does): blocks 0-1 + embeddings on
    # rank 0, blocks 2-3 + final norm + head on rank 1.
    first = sum(b for n, b in nbytes.items() if n.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0.",
                                                               "transformer.h.1.")))  # fmt: skip
    per_rank = [m["params"] for m in got["mem_all"]]
    assert per_rank == [first, total - first]
    trunk = sum(b for n, b in nbytes.items() if ".h." in n)
    embed = nbytes["transformer.wte.weight"] + nbytes["transformer.wpe.weight"]
    head = total - trunk - embed
    assert per_rank[0] == trunk // 2 + embed and per_rank[1] == trunk // 2 + head  # 1/pp of the trunk + ends
    # Interleaved and V schedules: 2 stages per rank, still a partition of all parameters.
    for name in ("gpt_interleaved_1f1b", "gpt_zbv"):
        assert sum(m["params"] for m in results[name][0]["mem_all"]) == total


def test_pipe_zero1_shards_optimizer_state_within_each_stage(results):
    got, ref = results["gpt_zero1"]
    mem = got["mem_all"]  # ranks (pp, dp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    assert mem[0]["params"] == mem[1]["params"] and mem[2]["params"] == mem[3]["params"]
    total = sum(math.prod(s) * 4 for s in ref["param_shapes"].values())
    assert mem[0]["params"] + mem[2]["params"] == total
    for stage_ranks in ((0, 1), (2, 3)):
        params = mem[stage_ranks[0]]["params"]
        optim = [mem[r]["optim"] for r in stage_ranks]
        assert sum(optim) == 2 * params and max(optim) < 0.6 * 2 * params  # Adam's 2 states, halved over dp


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # One step per epoch and resume from the checkpoint after step 2 (see test_zero.py's _resume_jobs for why).
    tmp = tmp_path_factory.mktemp("pipeline_ckpt")
    pipe, zero1 = str(tmp / "pipe"), str(tmp / "zero1")
    base = {"model": "gpt4", "epoch_steps": 1, "max_steps": 4}
    jobs = [
        {**base, "strategy": "pipe", "dp": 1, "ckpt_dir": pipe},  # uninterrupted, saving each epoch
        {**base, "strategy": "pipe", "dp": 1, "resume": f"{pipe}/epoch=1.ckpt"},
        {**base, "strategy": "zero1", "dp": 2, "resume": f"{pipe}/epoch=1.ckpt"},  # pipeline -> data parallel
        {**base, "strategy": "zero1", "dp": 2, "ckpt_dir": zero1},
        {**base, "strategy": {"pp": 2, "pp_schedule": "zbv"}, "dp": 1, "resume": f"{zero1}/epoch=1.ckpt"},
    ]
    return run_jobs(tmp, jobs, nproc=2, timeout=600)


def test_checkpoints_resume_across_pipeline_and_data_parallel_layouts(checkpoint_runs):
    full, resumed, as_zero1, zero1_full, zero1_as_pipe = checkpoint_runs
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == len(as_zero1["losses"]) == 2
    for run, ref in ((resumed, full), (as_zero1, full), (zero1_as_pipe, zero1_full)):
        assert rel(run["losses"], ref["losses"][2:]) < 1e-5
        params_close(run["params"], ref["params"], rtol=1e-5, atol=0.01 * LR)


def test_pipe_zero3_shards_parameters_within_each_stage(results):
    got, ref = results["gpt_zero3"]
    total = sum(math.prod(s) * 4 for s in ref["param_shapes"].values())
    per_rank = [m["params"] for m in got["mem_all"]]  # local shards of this rank's stage (ranks as above)
    assert sum(per_rank) == total  # the 4 ranks' shards partition the model exactly
    assert max(per_rank) < 0.35 * total  # ~1/4 each: 1/pp by stage, then 1/dp by FSDP2
