"""Expert parallelism inside pipeline stages (``pipe_moe*``): each stage's MoE layers exchange tokens with
all-to-all over the ep ranks of that stage, per microbatch, and ``lightning_par.nn.MoE``'s aux / z-losses travel
down the pipeline with the hidden state (lightning_par/parallel/pipeline/sides.py) so that ``moe_loss(model)`` on
the last stage sums every layer's.

Capacity and load-balancing statistics are per microbatch over every data-parallel rank's tokens of that
microbatch, as one process accumulating m batches of B/m (the reference of tests/test_pipeline_aux.py): rank r's
microbatch i holds global samples i * dp + r, so microbatch i of the dp ranks together is batch i of B/m. fp32
losses, gradient norms and parameters after training to 1e-5 relative (SGD: 1e-7 absolute); measured: losses
<= 1.3e-7 relative, gradient norms <= 1.6e-7. Checked by hand that these fail when the mechanism breaks (on the
MoE-GPT job): with the carried losses not set on the layers (moe_loss then reads stale values) the losses differ by
8.5e-5 relative and 1350 embedding entries fail; with the token group left per rank under a pipeline (statistics
and capacity over one rank's tokens) by 3.5e-4, gradient norms by 1.7e-3. Hugging Face Mixtral under pipe_cp_moe
(router logits gathered over dp x cp, then carried): measured losses 6.4e-8 relative, gradient norms 9.2e-8; with
the logits gathered over dp only, losses 3.6e-5 and gradient norms 6.7e-4 off, every parameter tensor failing.

``etp=2`` inside the stages (pipe_tp_moe_etp_zero1, clipped): losses 3.0e-8 relative, gradient norms 6.6e-8,
parameters 7.5e-9 absolute. Broken by hand: expert gradients also summed over tp (the etp=1 rule) moves the losses
by 5.7e-5 relative, the norms by 8.2e-3 (w2 2900x the tolerance); expert slices marked sharded over ep only (the
norm misses the other tp slice) by 2.4e-5 and 3.8e-3; without Megatron's ``f`` (the rows' gradient all-reduced over
tp) the first step's norm is 1.1e-2 off, and at the second the tp ranks, their replicated weights now apart, route
differently and the all-to-all sizes no longer match (the spawn fails).

One reference spawn, one 4-rank spawn (pp 2 x dp 2, ep 2), one 8-rank spawn (pipe_tp_moe_zero1 and
pipe_tp_moe_etp_zero1: pp 2 x tp 2 x dp 2, ep 2; pipe_cp_moe: pp 2 x cp 2 x dp 2, ep 2, on the MoE-GPT and
Mixtral), one one-process resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.blocks.trunk import find_trunk
from lightning_par.config import ParallelConfig
from lightning_par.names import strategy_kwargs
from lightning_par.nn import MoE
from lightning_par.parallel.pipeline.owners import PipelineError, find_ownership

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PIPE = {"dp": 2, "no_routing": True}
JOBS: dict[str, dict[str, Any]] = {
    # The reference MoE-GPT with capacity 0.75 (dropped assignments) and its aux + z-loss, 1f1b, 4 microbatches.
    "moe_gpt": {**PIPE, "model": "moe_gpt_cap_sgd", "strategy": "pipe_moe", "validate": True},
    # Hugging Face Mixtral: stacked experts, its own load-balancing loss from router logits carried as side outputs.
    "mixtral": {**PIPE, "model": "hf_mixtral_aux", "strategy": "pipe_moe"},
    # Two stages per rank with a zero-bubble weight pass, and full recomputation replaying each dispatch in backward.
    "zb_ac": {**PIPE, "model": "moe_gpt_cap_sgd_4", "strategy": {"pp": 2, "ep": 2, "pp_schedule": "interleaved_zb",
                                                                  "activation_checkpointing": "full"}},
    # ZeRO-3 inside the stages (FSDP2 roots; expert shards ignored by FSDP2).
    "zero3": {**PIPE, "model": "moe_gpt_cap_sgd", "strategy": "pipe_moe_zero3"},
}  # fmt: skip
# 8 ranks: pp 2 x tp 2 x dp 2, ep 2 over the dp ranks of each (stage, tp index); attention split over tp.
JOBS_8: dict[str, dict[str, Any]] = {
    "pipe_tp_moe_zero1": {**PIPE, "model": "moe_gpt_cap_sgd", "strategy": "pipe_tp_moe_zero1"},
    # etp=tp: each stage's experts split over tp too (w1/w3 by columns, w2 by rows), aux + z-loss carried down the
    # pipeline, clipped by the global norm (expert slices summed over ep and tp, stages over pp).
    "pipe_tp_moe_etp_zero1": {
        **PIPE,
        "model": "moe_gpt_cap_aux_sgd",
        "strategy": {"pp": 2, "tp": 2, "ep": 2, "etp": 2, "zero_stage": 1},
        "clip": 0.05,
        "expert_load": True,
    },
    # pp 2 x cp 2 x dp 2, ep 2: each stage's MoE layers see a chunk of each sequence; their token group spans dp x
    # cp, their aux / z means a sample's chunks (MoE.sample_group), and the carried losses are those global values.
    "pipe_cp_moe": {**PIPE, "model": "moe_gpt_cap_aux_sgd", "strategy": "pipe_cp_moe", "expert_load": True},
    # Hugging Face Mixtral with its router loss (logits carried down the pipeline, gathered over dp).
    "mixtral_pipe_tp_moe_zero1": {
        **PIPE,
        "model": "hf_mixtral_aux",
        "strategy": "pipe_tp_moe_zero1",
        "expert_load": True,
    },
    # The same under pipe_cp_moe (SDPA): the logits are gathered over dp x cp before the stage carries them.
    "mixtral_pipe_cp_moe": {**PIPE, "model": "hf_mixtral_sdpa_aux", "strategy": "pipe_cp_moe", "expert_load": True},
}
SPLIT_8 = {
    "pipe_tp_moe_zero1": "tp",
    "pipe_tp_moe_etp_zero1": "tp",
    "pipe_cp_moe": "cp",
    "mixtral_pipe_tp_moe_zero1": "tp",
    "mixtral_pipe_cp_moe": "cp",
}  # the third dimension of each 8-rank layout
# Checkpoints: no aux term and dropless, so a pipeline trains exactly like one batch (cross-entropy is linear in the
# tokens): written under pipe_moe (ep 2 in each stage), resumed under moe (ep 4, no pipeline) and in one process.
CKPT = {**PIPE, "model": "moe_gpt_noaux", "epoch_steps": 1, "max_steps": 4}
CKPT_JOBS: dict[str, dict[str, Any]] = {
    "ckpt_full": {**CKPT, "strategy": "pipe_moe", "ckpt_dir": "ckpts"},
    "resume_moe": {**CKPT, "dp": 4, "strategy": "moe", "resume": "ckpts/epoch=1.ckpt"},
}
LR = 3e-3  # moe_gpt_noaux's AdamW


def _reference(job: dict[str, Any]) -> dict[str, Any]:
    ref = reference_job({k: v for k, v in job.items() if k not in ("strategy", "dp", "no_routing")})
    return {**ref, "global_batch": 2, "accumulate": 4, "limit_val_batches": 8}  # 4 microbatches of B = 8


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pipe_moe")
    noaux = _reference({**JOBS["moe_gpt"], "model": "moe_gpt_cap_sgd_noaux"})
    every = {**JOBS, **JOBS_8}
    refs = run_jobs(tmp, [_reference(j) for j in every.values()] + [noaux], nproc=1, timeout=900)
    got = run_jobs(tmp, list(JOBS.values()) + list(CKPT_JOBS.values()), nproc=4, timeout=900)
    one = {**CKPT, "dp": 1, "strategy": "zero1", "resume": "ckpts/epoch=1.ckpt"}
    (single,) = run_jobs(tmp, [one], nproc=1, timeout=900)
    got8 = run_jobs(tmp, list(JOBS_8.values()), nproc=8, timeout=900)
    pairs = zip(every, got[: len(JOBS)] + got8, refs[: len(every)], strict=True)  # refs[-1]: noaux
    out: dict[str, Any] = {n: (g, r) for n, g, r in pairs}
    out.update(zip(CKPT_JOBS, got[len(JOBS) :], strict=True))
    out["resume_one_process"] = single
    out["noaux"] = (refs[-1], refs[-1])
    return out


@pytest.mark.parametrize("name", list(JOBS) + list(JOBS_8))
def test_pipe_moe_matches_one_process_accumulating_microbatches(results, name):
    got, ref = results[name]
    assert got["layout"]["pp"] == 2 and got["layout"]["ep"] == 2 and got["layout"]["dp_shard"] == 2
    for dim in ("tp", "cp"):
        assert got["layout"][dim] == (2 if SPLIT_8.get(name) == dim else 1), (name, dim)
    want = [sum(ref["losses"][i : i + 4]) / 4 for i in range(0, len(ref["losses"]), 4)]  # the logged mean
    assert len(got["losses"]) == len(want) == 3
    assert rel(got["losses"], want) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    # Each rank holds its stage's experts, E/ep of each layer: a quarter of the model's (pp 2 x ep 2), whole on each
    # tp rank under etp=1, an eighth under etp=tp (each expert's hidden width split over tp 2).
    held = [m["expert_param_bytes"] for m in got["mem_all"]]
    share = 8 if "etp" in name else 4
    assert held == [ref["mem"]["expert_param_bytes"] // share] * len(held) and len(held) in (4, 8)
    if {**JOBS, **JOBS_8}[name].get("expert_load"):  # ParallelismMonitor's loads of the step, token for token
        assert got["expert_load"].keys() == ref["expert_load"].keys() and ref["expert_load"]
        for layer, r in ref["expert_load"].items():
            assert torch.equal(got["expert_load"][layer]["tokens_per_expert"], r["tokens_per_expert"]), layer
        # Model FLOPs from the whole model's active parameters, not this rank's stage, tp slice or experts.
        assert got["flops_per_token"] == ref["flops_per_token"] > 0
        _pipeline_step_is_measured(got)
    if name in JOBS and JOBS[name].get("validate"):
        assert abs(got["val"]["val_loss"] - ref["val"]["val_loss"]) <= 1e-5 * abs(ref["val"]["val_loss"])


def _pipeline_step_is_measured(got: dict[str, Any]) -> None:
    """ParallelismMonitor's bubble and timeline of the logged step, from the schedule's own waits and actions."""
    m = got["monitor_metrics"]
    # 2 stages, 4 microbatches: each rank waits at least through its peer's first forward or last backward.
    assert 0 < m["pipe/bubble_mean"] <= m["pipe/bubble_max_rank"] < 1 and 0 <= m["pipe/bubble"] < 1
    assert m["pipe/step_ms"] > 0
    timeline = got["timeline"]
    assert timeline is not None and timeline.shape[2] == 3 and timeline.dtype == np.uint8
    colours = {tuple(c) for c in timeline.reshape(-1, 3).tolist()}
    assert {(66, 133, 244), (52, 168, 83), (234, 67, 53)} <= colours  # forward, backward and waiting all drawn


def test_the_moe_losses_count(results):
    # The same model, seed and data without the aux / z-loss terms trains otherwise: the parity above is not vacuous
    # (losses missing a stage's layers' terms would fail it).
    (_, ref), (noaux, _) = results["moe_gpt"], results["noaux"]
    assert rel(noaux["losses"], ref["losses"]) > 1e-4


@pytest.mark.parametrize("name", ["resume_moe", "resume_one_process"])
def test_pipe_moe_checkpoint_resumes_under_moe_and_one_process(results, name):
    full, resumed = results["ckpt_full"], results[name]
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2 and resumed["start_step"] == 2
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    assert resumed["params"].keys() == full["params"].keys()
    for k in full["params"]:
        torch.testing.assert_close(resumed["params"][k], full["params"][k], rtol=1e-5, atol=0.01 * LR)


# ---- no spawn ----------------------------------------------------------------------------------------------------
def test_pipe_moe_names_resolve():
    layout = ParallelConfig(**strategy_kwargs("pipe_moe")).resolve(4)
    assert (layout.pp, layout.dp_shard, layout.ep) == (2, 2, 2)
    assert ParallelConfig(**strategy_kwargs("pipe_moe_zero1")).resolve(8).ep == 2
    three = ParallelConfig(**strategy_kwargs("pipe_tp_moe_zero1")).resolve(8)
    assert (three.pp, three.tp, three.dp_shard, three.ep) == (2, 2, 2, 2)
    etp = ParallelConfig(pp=2, tp=2, ep=2, etp=2, zero_stage=1).resolve(8)  # experts split over tp in each stage
    assert (etp.pp, etp.tp, etp.dp_shard, etp.ep, etp.etp) == (2, 2, 2, 2, 2)
    assert ParallelConfig(**{**strategy_kwargs("pipe_tp_moe_zero1"), "etp": 2}).resolve(8).etp == 2


class _Outside(torch.nn.Module):
    """An MoE layer with an aux loss before the trunk: the last stage could not read its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(8, 16, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.moe(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_moe_loss_slots_and_refusals():
    from lightning_par.models import MoEGPT

    model = MoEGPT(n_layer=3, n_embd=16, n_head=2, block_size=8)
    trunk = find_trunk(model)
    assert trunk is not None
    sides = find_ownership(model, trunk).sides
    assert [(s.block, s.path, s.kind) for s in sides] == [(i, "moe", "moe_loss") for i in range(3)]
    # Without losses too: the model logs every layer's routing statistics on the last stage.
    quiet = MoEGPT(n_layer=2, n_embd=16, n_head=2, block_size=8, aux_loss_coef=0.0, z_loss_coef=0.0)
    quiet_trunk = find_trunk(quiet)
    assert quiet_trunk is not None and len(find_ownership(quiet, quiet_trunk).sides) == 2
    outside = _Outside()
    outside_trunk = find_trunk(outside)
    assert outside_trunk is not None
    with pytest.raises(PipelineError, match=r"outside the trunk.*move the MoE layer into a block"):
        find_ownership(outside, outside_trunk, run=lambda: outside(torch.zeros(2, 8)))
