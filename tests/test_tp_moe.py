"""Expert parallelism inside tensor parallelism (``tp_moe``, ``tp_moe_zero1/2/3``, ``etp``) against one process.

4 ranks: tp 2 x dp 2, ep 2 over dp (the ep group is the dp ranks with the same tp index). Attention and dense
layers are split over tp; each MoE layer's router, capacity and balancing statistics run on every token of the
data-parallel batch on every tp rank; the experts then run either on ``1/tp`` of the tokens per tp rank
(``etp=1``, `lightning_par.parallel.experts.with_tp.TokenSplit`) or on every token with their hidden width split over
tp (``etp=tp``). Checked per job: every loss and gradient norm (fp32, 1e-5 relative), every parameter after
training (experts gathered over ep, and over tp under ``etp=2``; SGD + momentum: rtol 1e-5 / atol 1e-7), each
rank's expert bytes, and for MoE-GPT the router logits, chosen experts and kept-by-capacity flags of every token.
Clipping (``clip``) makes the gradient norm part of the update: a replicated-over-tp weight counted tp times
changes the parameters. A checkpoint written under ``tp_moe`` resumes under ``moe`` (ep 4 over dp 4, no tp).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

import lightning_par
from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.names import strategy_kwargs

# Keys spelled out: docs/compatibility.md cites them.
JOBS: dict[str, dict[str, Any]] = {
    # Capacity 0.75: a quarter of the assignments or more dropped, the same ones as on one process.
    "moe_gpt_tp_moe": {"model": "moe_gpt_cap_sgd", "strategy": "tp_moe", "dp": 2},
    "moe_gpt_tp_moe_zero3": {"model": "moe_gpt_cap_sgd", "strategy": "tp_moe_zero3", "dp": 2, "clip": 0.05},
    # Experts split over tp too (w1/w3 by columns, w2 by rows of the hidden width), with ZeRO-1.
    "moe_gpt_etp_zero1": {
        "model": "moe_gpt_sgd",
        "strategy": {"tp": 2, "ep": 2, "etp": 2, "zero_stage": 1},
        "dp": 2,
        "clip": 0.05,
    },
    "hf_mixtral_tp_moe": {"model": "hf_mixtral", "strategy": "tp_moe", "dp": 2},
    "hf_mixtral_tp_moe_zero3": {"model": "hf_mixtral", "strategy": "tp_moe_zero3", "dp": 2},
    "hf_mixtral_tp_moe_zero2": {"model": "hf_mixtral", "strategy": "tp_moe_zero2", "dp": 2, "clip": 0.05},
}
CKPT = {"model": "moe_gpt", "epoch_steps": 1, "max_steps": 4}
CKPT_JOBS: dict[str, dict[str, Any]] = {
    "ckpt_tp_moe": {**CKPT, "strategy": "tp_moe", "dp": 2, "ckpt_dir": "ckpts"},
    "resume_moe": {**CKPT, "strategy": "moe", "resume": "ckpts/epoch=1.ckpt"},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp_moe")
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k != "dp"}) for j in JOBS.values()], nproc=1,
                    timeout=600)  # fmt: skip
    ckpt = [{**j, **{k: str(tmp / j[k]) for k in ("ckpt_dir", "resume") if k in j}} for j in CKPT_JOBS.values()]
    got = run_jobs(tmp, [*JOBS.values(), *ckpt], nproc=4, timeout=900)
    out = {name: (g, r) for name, g, r in zip(JOBS, got[: len(JOBS)], refs, strict=True)}
    out.update({name: g for name, g in zip(CKPT_JOBS, got[len(JOBS) :], strict=True)})
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(JOBS))
def test_tp_moe_matches_one_process(results: dict[str, Any], name: str) -> None:
    got, ref = results[name]
    assert (got["layout"]["tp"], got["layout"]["ep"], got["layout"]["dp_shard"]) == (2, 2, 2)
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    # Each rank holds E/ep of the experts, and 1/tp of that under etp = tp.
    total = ref["mem"]["expert_param_bytes"]
    share = total // (4 if name.startswith("moe_gpt_etp") else 2)
    assert total > 0 and [m["expert_param_bytes"] for m in got["mem_all"]] == [share] * 4
    if name.startswith("hf_mixtral"):  # Hugging Face names kept, E/ep = 2 of 4 rows
        assert got["mem"]["expert_shapes"]["model.model.layers.0.mlp.experts.gate_up_proj"] == (2, 96, 32)
    if ref["routing"] is None:
        return
    # Each dispatched row is computed once over the 4 ranks under etp=1 (each tp rank its share), on both tp
    # ranks' slices under etp=tp.
    per_rank = [m["expert_rows"] for m in got["mem_all"]]
    assert ref["mem"]["expert_rows"] > 0 and sum(per_rank) == ref["mem"]["expert_rows"] * (2 if "etp" in name else 1)
    # The two tp ranks of a dp rank hold the same experts; each takes half of every expert's rows from each source
    # (at most one row apart per local expert, source, layer and step): 2 x 2 x 2 x 3.
    assert all(abs(per_rank[i] - per_rank[i + 1]) <= 24 for i in (0, 2)), per_rank
    for step, (g, r) in enumerate(zip(got["routing"], ref["routing"], strict=True)):
        assert g.keys() == r.keys()
        for key in r:
            if key.endswith("logits"):
                where = f"step {step} {key}"
                torch.testing.assert_close(g[key], r[key], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
            else:  # chosen experts, kept flags, token counts: exactly equal
                assert torch.equal(g[key], r[key]), (step, key)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_moe_checkpoint_resumes_under_moe(results: dict[str, Any]) -> None:
    full, resumed = results["ckpt_tp_moe"], results["resume_moe"]
    assert resumed["layout"]["tp"] == 1 and resumed["layout"]["ep"] == 4
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2 and resumed["start_step"] == 2
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=3e-5)  # AdamW: atol 1% of lr


def test_tp_moe_names_resolve_to_tp_times_ep_over_dp() -> None:
    assert strategy_kwargs("tp_moe") == {"zero_stage": 0, "offload": False, "auto_dims": ("tp", "ep")}
    for zero in (1, 2, 3):
        assert strategy_kwargs(f"tp_moe_zero{zero}")["zero_stage"] == zero
    config = ParallelConfig(**strategy_kwargs("tp_moe_zero3")).resolve(4)
    assert (config.tp, config.dp_shard, config.ep, config.etp) == (2, 2, 2, 1)
    lightning_par.ParallelStrategy(tp=2, ep=2, etp=2, zero_stage=3)  # constructs
    lightning_par.ParallelStrategy(pp=2, tp=2, ep=2, etp=2, zero_stage=1)  # inside pipeline stages too


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 2, "ep": 2, "etp": 4}, r"etp=4 must be 1 or equal tp=2.*set etp=2 or etp=1"),
        ({"tp": 2, "etp": 2}, r"etp=2 splits experts over tensor parallelism, so it needs ep > 1 and tp > 1"),
        ({"ep": 2, "etp": 2}, r"needs ep > 1 and tp > 1"),
        ({"tp": 2, "ep": 2, "etp": 0}, r"etp=0 must be a positive int"),
    ],
)
def test_bad_etp_is_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ParallelConfigError, NotImplementedError), match=message):
        lightning_par.ParallelStrategy(**kwargs)


def test_etp_not_dividing_the_expert_hidden_size_is_refused_before_training() -> None:
    import _job_models

    from lightning_par.parallel.experts.apply import _check_etp
    from lightning_par.parallel.experts.finder import find_moe_layers

    model = _job_models.MoEGPT(**{**_job_models._MOE, "expert_hidden": 6})
    message = r"etp=4 does not divide the expert hidden size d_ff=6 in .*choose etp=1 .*\{1, 2, 3, 6\}"
    with pytest.raises(ValueError, match=message):
        _check_etp(find_moe_layers(model), 4, 4)
    _check_etp(find_moe_layers(model), 2, 2)  # 2 divides 6
    with pytest.raises(ValueError, match=r"etp=2 splits each expert over the tensor-parallel group.*tp group of 1"):
        _check_etp(find_moe_layers(model), 2, 1)
    with pytest.raises(ValueError, match=r"etp=2: .* is a stacked MoE block.*set etp=1"):
        _check_etp(find_moe_layers(_job_models.HFMixtralLM()), 2, 2)


def test_tp_moe_resolves_etp_against_the_world_size() -> None:
    assert ParallelConfig(tp=2, ep=2, etp=2).resolve(4).etp == 2
    assert ParallelConfig(etp=2, auto_dims=("tp", "ep")).resolve(4).tp == 2
    # A name's tp comes from the world size: one device per node leaves tp 1, which etp=2 cannot match.
    refused = pytest.raises(ParallelConfigError, match=r"etp=2 must be 1 or equal tp=1 here")
    with pytest.warns(UserWarning, match="gives tp=1"), refused:
        ParallelConfig(etp=2, auto_dims=("tp", "ep")).resolve(2, devices_per_node=1)
