"""PowerSGD gradient compression (``grad_compression="powersgd"``) against a one-process simulation and the exact run.

- Past ``compression_start`` the data-parallel mean is PowerSGD's low-rank approximation, with error feedback and
  a warm-started Q: the run's losses (every step) and final weights must match `tests/_powersgd_sim.py`, which
  computes each rank's gradient in one process and averages them by the algorithm as published (1e-5 relative on
  losses and weights), under ZeRO-0 and ZeRO-1 (with several buckets, with two micro-batches a step), on our GPT
  and a Hugging Face Llama built from a config, both with SGD: AdamW divides by the gradient's own scale, so the
  fp32 noise of a near-zero approximated gradient (a rarely seen token's embedding row) becomes a step-sized
  difference (measured: 6 % of a step in 0.3 % of the embedding). The simulation itself is far from the exact run
  (checked), so matching it is not matching the exact run.
- Before ``compression_start`` the reduction is exact: a run that never reaches it matches the one-process run.
- The elements PowerSGD all-reduces per step are ``(n + m) r`` per compressed ``n x m`` gradient and ``n m`` for
  the others (`lightning_par.parallel.compression.powersgd.compressed_numel`, what the planner prices); the hook's
  own count must equal it.
- Checkpoints: each rank's error, the warm-started factors, the step count and the Q draws' generator are saved in
  its own file; a run resumed inside the compressed phase continues the uninterrupted run (1e-6 relative). A
  checkpoint without them (an exact run's) resumes with a warning that compression starts afresh.
- Bad settings are refused when the strategy is built, naming the fix.

- Under a pipeline (pp 2 x dp 2) each stage compresses its own buckets; a tied weight's copies on the two end
  stages are averaged exactly, so they stay one weight: the run matches the simulation and the copies are equal.

Spawns: one 2-rank torchrun (9 jobs), one 4-rank torchrun (2 jobs), one process (references and simulations).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import params_close, rel

import lightning_par
from lightning_par.config import ParallelConfigError
from lightning_par.parallel.compression.powersgd import compressed_numel

STEPS, START, RANK = 6, 2, 2
ATOL = 1e-7  # SGD with momentum: linear in the gradient, so fp32 noise stays noise (AdamW would scale it up)
BASE: dict[str, Any] = {"steps": STEPS, "global_batch": 8}
PSGD = {"grad_compression": "powersgd", "compression_rank": RANK, "compression_start": START}
RUNS: dict[str, dict[str, Any]] = {
    "ddp": {"model": "gpt_sgd", "strategy": {"zero_stage": 0, **PSGD}},
    "zero1": {"model": "gpt_sgd", "strategy": {"zero_stage": 1, **PSGD}},
    # buckets of 16 KB: several, each with its own error, factors and seed, reduced one after another
    "zero1_buckets": {"model": "gpt_sgd", "strategy": {"zero_stage": 1, **PSGD, "bucket_cap_mb": 1 / 64}},
    # two micro-batches per step: the gradients accumulate, then one compressed reduction
    "zero1_accum": {"model": "gpt_sgd", "strategy": {"zero_stage": 1, **PSGD}, "accumulate": 2},
    # a model we did not write: Hugging Face Llama built from a config (GQA, RMSNorm, rotary, SwiGLU)
    "zero1_llama": {"model": "hf_llama_sgd", "strategy": {"zero_stage": 1, **PSGD}},
    "not_started": {"model": "gpt_sgd", "strategy": {"zero_stage": 1, **PSGD, "compression_start": STEPS + 1}},
    "exact": {"model": "gpt_sgd", "strategy": {"zero_stage": 1}},
}
# Under a pipeline (pp 2 x dp 2): each stage compresses its own buckets with a state of its own; the tied
# embedding, a copy on each end stage, is averaged exactly (so the copies stay equal).
PIPE: dict[str, dict[str, Any]] = {
    "pipe_zero1_tied": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2, "zero_stage": 1, **PSGD}},
    "pipe_llama": {"model": "hf_llama_sgd", "strategy": {"pp": 2, "zero_stage": 0, **PSGD}},
    # hybrid sharding: ZeRO-1 inside 2 replicas of 2 ranks; the mean is over all 4 (the simulation's dp 4)
    "hybrid_zero1": {
        "model": "gpt_sgd",
        "dp": 4,
        "strategy": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 1, **PSGD},
    },
}
# Resumes: name -> (writer, step of its checkpoint), with PSGD on ZeRO-1 (the writers save after every step).
RESUMES = {"zero1_from_3": ("zero1", 3), "zero1_from_exact": ("exact", 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("powersgd")
    jobs = {name: {**BASE, **job} for name, job in RUNS.items()}
    for writer in {w for w, _ in RESUMES.values()}:
        jobs[writer].update(ckpt_dir=str(tmp / writer), ckpt_every_n_steps=1)
    for name, (writer, step) in RESUMES.items():
        jobs[name] = {**BASE, **RUNS["zero1"], "resume": str(tmp / writer / f"step={step}.ckpt"),
                      "record_warnings": True}  # fmt: skip
    got = dict(zip(jobs, run_jobs(tmp / "n2", list(jobs.values()), nproc=2, timeout=400), strict=True))
    pipe = run_jobs(tmp / "n4", [{**BASE, "dp": 2, **job} for job in PIPE.values()], nproc=4, timeout=400)
    got.update(zip(PIPE, pipe, strict=True))
    one = {"ref": {"model": "gpt_sgd"}, "ref_llama": {"model": "hf_llama_sgd"}, "ref_tied": {"model": "gpt4_tied_sgd"}}
    # The bucket layout is the run's (ZeRO-0 and 1 bucket alike).
    sims = {"ddp": "sim_gpt", "zero1_llama": "sim_llama", "zero1_accum": "sim_gpt_accum",
            "zero1_buckets": "sim_gpt_buckets", "pipe_zero1_tied": "sim_pipe_tied",
            "pipe_llama": "sim_pipe_llama", "hybrid_zero1": "sim_hybrid"}  # fmt: skip
    for name, sim_name in sims.items():
        # One state per pipeline stage (hybrid sharding's replicas hold the same buckets: one state for them).
        first = [r for r in got[name]["powersgd_ranks"] if r["dp_rank"] == 0]
        stages = list({json.dumps(r, sort_keys=True): r for r in first}.values())
        dp = (RUNS.get(name) or PIPE[name]).get("dp", 2)
        sim = {"dp": dp, "rank": RANK, "start": START, "stages": stages}
        run = RUNS.get(name) or PIPE[name]
        one[sim_name] = {"model": run["model"], "simulate_powersgd": sim, "accumulate": run.get("accumulate", 1)}
    got.update(zip(one, run_jobs(tmp / "n1", [{**BASE, **j} for j in one.values()], nproc=1, timeout=400), strict=True))
    return got


@pytest.mark.slow
@pytest.mark.parametrize(("name", "sim"), [("ddp", "sim_gpt"), ("zero1", "sim_gpt"), ("zero1_llama", "sim_llama"),
                                           ("zero1_accum", "sim_gpt_accum"), ("zero1_buckets", "sim_gpt_buckets"),
                                           ("pipe_zero1_tied", "sim_pipe_tied"),
                                           ("pipe_llama", "sim_pipe_llama"),
                                           ("hybrid_zero1", "sim_hybrid")])  # fmt: skip
def test_powersgd_matches_the_one_process_simulation(runs: dict[str, Any], name: str, sim: str) -> None:
    got, want = runs[name], runs[sim]
    if name == "zero1_buckets":
        assert len(got["zero_buckets"]) > 3
    if name.startswith("pipe"):  # two stages, each its own buckets; the tied copies' mean exact
        assert len({json.dumps(r["buckets"]) for r in got["powersgd_ranks"]}) == 2
        assert name != "pipe_zero1_tied" or all(r["exact"] for r in got["powersgd_ranks"])
    if name == "pipe_zero1_tied":  # the first stage's copy and the last's, still one weight
        assert torch.equal(got["params"]["lm_head.weight"], got["params"]["transformer.wte.weight"])
    parts = (RUNS.get(name) or PIPE[name]).get("accumulate", 1)  # the run logs each micro-batch's loss
    losses = [sum(got["losses"][i : i + parts]) / parts for i in range(0, len(got["losses"]), parts)]
    assert len(losses) == len(want["losses"]) == STEPS
    assert rel(losses, want["losses"]) < 1e-5
    params_close(got["params"], want["params"], rtol=1e-5, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize(("sim", "ref"), [("sim_gpt", "ref"), ("sim_llama", "ref_llama")])
def test_the_compressed_mean_is_not_the_exact_one(runs: dict[str, Any], sim: str, ref: str) -> None:
    # Exact for the first START steps (their losses, and the loss after them, agree), then apart: matching the
    # simulation above says more than matching the exact run would.
    approx, exact = runs[sim]["losses"], runs[ref]["losses"]
    assert rel(approx[: START + 1], exact[: START + 1]) < 1e-5
    assert rel(approx[START + 1 :], exact[START + 1 :]) > 1e-4
    with pytest.raises(AssertionError):
        params_close(runs[sim]["params"], runs[ref]["params"], rtol=1e-5, atol=ATOL)


@pytest.mark.slow
def test_before_the_start_the_reduction_is_exact(runs: dict[str, Any]) -> None:
    got, ref = runs["not_started"], runs["ref"]
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero1_llama"])
def test_the_elements_reduced_per_step_follow_the_formula(runs: dict[str, Any], name: str) -> None:
    got = runs[name]
    shapes = [got["param_shapes"][n] for bucket in got["zero_buckets"] for n in bucket]
    before, after = got["compressed_numel"]  # the hook's count over the compressed steps
    steps = STEPS - START
    assert before == steps * sum(math.prod(s) for s in shapes)
    assert after == steps * compressed_numel(shapes, RANK)
    assert after < before / 4  # what the compression is for


@pytest.mark.slow
def test_a_resume_continues_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    # Saved after step 3, two steps into compression: each rank's error and the warm-started Q come back from its
    # own file, with the step count and the generator of the Q draws.
    got, ref = runs["zero1_from_3"], runs["zero1"]
    assert got["start_step"] == 3 and got["resumed_from"] == "step=3.ckpt"
    assert rel(got["losses"], ref["losses"][3:]) < 1e-6
    params_close(got["params"], ref["params"], rtol=1e-6, atol=ATOL)
    assert not [w for w in got["warnings"] if "PowerSGD" in w]


@pytest.mark.slow
def test_a_resume_without_the_state_starts_compression_afresh_with_a_warning(runs: dict[str, Any]) -> None:
    got = runs["zero1_from_exact"]  # a checkpoint of an exact run, resumed with PowerSGD
    assert got["start_step"] == 3 and len(got["losses"]) == STEPS - 3
    assert any("PowerSGD's state" in w and "starts afresh" in w for w in got["warnings"]), got["warnings"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 2}, "use zero_stage=0 or 1"),
        ({"zero_stage": 3}, "use zero_stage=0 or 1"),
        ({"zero_stage": 1, "tp": 2}, "tp=2 is not supported with it"),
        ({"zero_stage": 1, "cp": 2}, "cp=2 is not supported with it"),
        ({"zero_stage": 1, "ep": 2}, "ep=2 is not supported with it"),
        ({"compression_rank": 0}, "compression_rank=0 must be an int >= 1"),
        ({"compression_start": 1}, "compression_start=1 must be an int >= 2"),
        ({"grad_compression": "topk"}, "use None or 'powersgd'"),
    ],
)
def test_bad_settings_are_refused_when_the_strategy_is_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ParallelConfigError, match=message):
        lightning_par.ParallelStrategy(**{"grad_compression": "powersgd", **kwargs})


@pytest.mark.parametrize("kwargs", [{"grad_compression": "powersgd"}, {"dp_replicate": 2, "sync_every": 2}])
def test_fabric_refuses_what_only_the_trainer_checkpoints(kwargs: dict[str, Any]) -> None:
    name = next(iter(k for k in kwargs if k != "dp_replicate"))
    fix = re.escape(f"use Trainer(strategy=ParallelStrategy(..., {name}=...))")
    with pytest.raises(ValueError, match=rf"{name} .* runs under the Trainer's strategies only so far; {fix}"):
        lightning_par.FabricParallelStrategy(**kwargs)


def test_the_planner_prices_the_compressed_all_reduce_and_the_kept_error() -> None:
    from lightning_par.planner.devices import device
    from lightning_par.planner.estimate import estimate
    from lightning_par.planner.layout import Layout, LayoutError
    from lightning_par.planner.model import from_hf_config
    from lightning_par.planner.params import specs_from_desc

    desc = from_hf_config(dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=2048))  # fmt: skip
    h100 = dataclasses.replace(device("H100"), gpus_per_node=1)  # 8 nodes: the data-parallel link is the slow one
    exact, compressed = (estimate(desc, Layout(dp_shard=8, micro_batch_size=8, powersgd_rank=r), h100, 64, 2048)
                         for r in (0, 4))  # fmt: skip
    specs = specs_from_desc(desc)
    numel = sum(s.numel for s in specs)
    factors = sum(compressed_numel([s.shape], 4) for s in specs if len(s.shape) == 2)
    # Each rank keeps its error (a full fp32 gradient) and the P, Q factors of every compressed matrix.
    assert compressed.gradients - exact.gradients == 4 * (numel + factors)
    # The all-reduce sends (n + m) r per matrix: at rank 4 on this Llama 0.3 % of the elements, not overlapped.
    assert compressed.time.dp_comm_exposed < exact.time.dp_comm_exposed / 2
    assert compressed.layout.strategy_kwargs()["grad_compression"] == "powersgd"
    with pytest.raises(LayoutError, match="use zero_stage=0 or 1"):
        estimate(desc, Layout(dp_shard=8, zero_stage=2, micro_batch_size=8, powersgd_rank=4), h100, 64, 2048)


@pytest.mark.parametrize("kwargs", [{"zero_stage": 1, "grad_compression": "powersgd"},
                                    {"zero_stage": 3, "zero_quantized_weights": True}])  # fmt: skip
def test_deepspeed_refuses_the_native_compressions_naming_its_own(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"run on the native engines .* or DeepSpeed's own ZeRO\+\+"):
        lightning_par.DeepSpeedParallelStrategy(**kwargs)
