"""Context parallelism with mixture-of-experts (``cp_moe*``) against one process (docs/moe.md, "Under context
parallelism"): each cp rank's MoE layers see a chunk of its samples' tokens, so capacity, the load-balancing
statistics and the expert loads span dp x cp; ep stays over dp (ranks of one cp index), and cp ranks hold the same
experts, their gradients averaged over cp too.

One spawn on 4 ranks (cp 2 x dp 2, ep 2 by the degree rule): the reference MoE-GPT with capacity (a quarter or more
of the assignments dropped) and its aux + z losses (weights 1.0 and 0.1, so that a wrong mean shows), Hugging Face
Mixtral on its SDPA path with its own load-balancing term (router logits gathered over dp x cp), ``cp_moe_zero3``,
and an uneven length under ZeRO-2. One spawn on 8 ranks (tp 2 x cp 2 x dp 2, ep 2): the MoE-GPT with capacity under
Ulysses attention, and Mixtral under ``tp_cp_moe_zero3``.
Tolerances as everywhere (docs/testing.md): fp32 losses and gradient norms 1e-5 relative, SGD parameters 1e-5
relative / 1e-6 absolute at dp 2 (tests/test_context_parallel.py says why).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.config import ParallelConfig
from lightning_par.names import STRATEGY_NAMES, strategy_kwargs

# The worker's routing recorder reassembles dp ranks' samples, not a sample's cp chunks; the losses, parameters and
# expert loads below check the routing.
NO_ROUTING = {"no_routing": True}
JOBS: dict[str, dict[str, Any]] = {
    "capacity": {"model": "moe_gpt_cap_aux_sgd", "strategy": "cp_moe", "dp": 2, "expert_load": True, **NO_ROUTING},
    "hf_mixtral_sdpa_aux": {"model": "hf_mixtral_sdpa_aux", "strategy": "cp_moe", "dp": 2, "expert_load": True},
    "capacity_zero3": {"model": "moe_gpt_cap_aux_sgd", "strategy": "cp_moe_zero3", "dp": 2, **NO_ROUTING},
    # 29 tokens: cp ranks hold 15 and 14, so a mean of the two ranks' means would be off; the sums are not.
    "dropless_zero2_uneven": {
        "model": "moe_gpt_aux_sgd", "seq_len": 29, "dp": 2, **NO_ROUTING,
        "strategy": {"cp": 2, "ep": 2, "zero_stage": 2, "cp_uneven": True},
    },
}  # fmt: skip
# 8 ranks: tp 2 x cp 2 x dp 2, ep 2 (ep over the dp ranks of one tp and cp index).
JOBS_8: dict[str, dict[str, Any]] = {
    "capacity_tp_cp_moe_ulysses": {
        "model": "moe_gpt_cap_aux_sgd", "strategy": {"tp": 2, "cp": 2, "ep": 2, "cp_mode": "ulysses"}, "dp": 2,
        "expert_load": True, **NO_ROUTING,
    },
    "hf_mixtral_sdpa_aux_tp_cp_moe_zero3": {
        "model": "hf_mixtral_sdpa_aux", "strategy": "tp_cp_moe_zero3", "dp": 2, "expert_load": True,
    },
}  # fmt: skip
ALL = {**JOBS, **JOBS_8}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cp_moe")
    jobs = {k: {**j, "steps": 3} for k, j in ALL.items()}
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k != "dp"}) for j in jobs.values()], nproc=1)
    got = run_jobs(tmp, [jobs[k] for k in JOBS], nproc=4, timeout=500)
    got += run_jobs(tmp, [jobs[k] for k in JOBS_8], nproc=8, timeout=700)
    return dict(zip(ALL, zip(got, refs, strict=True), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_cp_moe_matches_one_process(results, name):
    got, ref = results[name]
    assert got.get("error") is None, got.get("error")
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cp_moe_expert_load_is_the_one_process_load(results):
    # ParallelismMonitor's tokens per expert sum over strategy.token_group: dp x cp under cp.
    names = [n for n, j in ALL.items() if j.get("expert_load")]
    for name in names:
        got, ref = (r["expert_load"] for r in results[name])
        assert ref and got.keys() == ref.keys(), name
        tokens = 8 * ALL[name].get("seq_len", 32)
        for layer, r in ref.items():
            assert torch.equal(got[layer]["tokens_per_expert"], r["tokens_per_expert"]), (name, layer)
            assert got[layer]["dropped_fraction"] == pytest.approx(r["dropped_fraction"], abs=1e-12)
            assert float(r["tokens_per_expert"].sum()) == pytest.approx(tokens * 2 * (1 - r["dropped_fraction"]))
    assert all(r["dropped_fraction"] > 0.01 for r in results["capacity"][1]["expert_load"].values())
    # Model FLOPs come from the whole model's active parameters: the same number under every layout.
    for name in names:
        got, ref = (r["flops_per_token"] for r in results[name])
        assert got == ref > 0, (name, got, ref)
        # Pictures on rank 0: a bar per rank (all-gathered), a heatmap row per MoE layer, a cell per expert.
        pictures, world = results[name][0]["pictures"], results[name][0]["layout"]["world_size"]
        assert pictures["pictures/memory_per_rank"] == (270, 220 + 40 * world, 3), (name, pictures)
        layers = len(results[name][1]["expert_load"])
        assert pictures["pictures/expert_load"][0] == 24 + 18 * layers + 10, (name, pictures)


def test_cp_moe_names_train_and_follow_the_degree_rule():
    for name in ("cp_moe", "cp_moe_zero1", "cp_moe_zero2", "cp_moe_zero3", "tp_cp_moe", "tp_cp_moe_zero3"):
        assert name in STRATEGY_NAMES
        strategy_kwargs(name)  # no longer refused
    four = ParallelConfig(**strategy_kwargs("cp_moe")).resolve(4)
    assert (four.cp, four.dp_shard, four.ep, four.tp) == (2, 2, 2, 1)
    eight = ParallelConfig(**strategy_kwargs("tp_cp_moe_zero3")).resolve(8)
    assert (eight.tp, eight.cp, eight.dp_shard, eight.ep) == (2, 2, 2, 2)
    ParallelConfig(cp=2, ep=2)  # explicit degrees too
