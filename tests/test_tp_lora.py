"""Low-rank adapters under tensor parallelism, against the same adapted model in one process (same seed, batches).

A user's LoRA wrappers (`tests/_lora_models.py`: a frozen ``nn.Linear`` plus two trainable ones, on every projection)
and peft's ``get_peft_model`` on Hugging Face Llama (LoRA r 4 on q/k/v/o/gate/up/down, B initialised random). Each
adapter pair follows its base projection (lightning_par/parallel/tensor/adapters.py): ``b`` split like a column-split
base, ``a`` like a row-split one; DoRA's magnitude (peft ``use_dora=True``) follows a column-split base's output rows
and stays whole beside a row-split one, whose squared row norms are summed over tp. 2 ranks: ``tp`` with and without
sequence parallelism; 4 ranks: tp 4 (Llama's 2 key/value heads replicated over 2 ranks each, so ``b`` of k and v
takes the replicated rows, DoRA's magnitudes too), ``tp_zero3`` and ``tp_zero1`` (tp 2 x dp 2) and ``pipe_tp`` (pp 2 x
tp 2). fp32 losses and gradient norms 1e-5 relative, SGD parameters 1e-5 relative / 1e-7 absolute; the frozen base
weights must come out as they went in. The planner's per-rank bytes equal the runs'.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

pytest.importorskip("peft")

TP = {"tp": 2}
JOBS_2: dict[str, dict[str, Any]] = {
    "user_lora_tp": {"model": "user_lora", "strategy": TP, "dp": 1},
    "user_lora_tp_nosp": {"model": "user_lora", "strategy": {**TP, "sequence_parallel": False}, "dp": 1},
    "peft_llama_tp": {"model": "peft_llama", "strategy": TP, "dp": 1},
    # DoRA: each magnitude follows its base's output rows; a row split sums the squared row norms over tp.
    "peft_llama_dora_tp": {"model": "peft_llama_dora", "strategy": TP, "dp": 1},
    # With an adapter dropout, DoRA recomputes the base on the dropped-out input (a fixed-token dropout: one mask).
    "peft_llama_dora_drop_tp": {"model": "peft_llama_dora_drop", "strategy": TP, "dp": 1},
    "peft_llama_dora_drop_tp_nosp": {
        "model": "peft_llama_dora_drop",
        "strategy": {**TP, "sequence_parallel": False},
        "dp": 1,
    },
}
JOBS_4: dict[str, dict[str, Any]] = {
    "peft_llama_tp4": {"model": "peft_llama", "strategy": {"tp": 4}, "dp": 1},
    "peft_llama_tp_zero3": {"model": "peft_llama", "strategy": {**TP, "zero_stage": 3}, "dp": 2},
    "user_lora_tp_zero1": {"model": "user_lora", "strategy": {**TP, "zero_stage": 1}, "dp": 2},
    "peft_llama_pipe_tp": {"model": "peft_llama", "strategy": {"pp": 2, **TP}, "dp": 1},
    "peft_llama_dora_pipe_tp": {"model": "peft_llama_dora", "strategy": {"pp": 2, **TP}, "dp": 1},
    # tp 4 replicates Llama's 2 key/value heads over pairs of ranks: k's and v's magnitudes gathered for the head's
    # rows, their gradients summed back over the pair (with an adapter dropout too: the base recomputed on its rows).
    "peft_llama_dora_tp4": {"model": "peft_llama_dora", "strategy": {"tp": 4}, "dp": 1},
    "peft_llama_dora_drop_tp4": {"model": "peft_llama_dora_drop", "strategy": {"tp": 4}, "dp": 1},
}
ALL = {**JOBS_2, **JOBS_4}
# DoRA on Phi-3's fused qkv_proj (rows regrouped per rank): refused before the first step.
REFUSED = {"peft_phi3_dora_tp": {"model": "peft_phi3_dora", "strategy": TP, "dp": 1, "expect_error": True}}
# The parameters tp=2 splits: the bases, their row-split biases excepted, and the split adapter of each pair.
SPLIT = {
    "user_lora_tp": r"\.(q|k|v|out|up|down)\.base\.weight$|\.(q|k|v|up)\.(base\.bias|b\.weight)$|"
    r"\.(out|down)\.a\.weight$",
    "peft_llama_tp": r"_proj\.base_layer\.weight$|\.(q|k|v|gate|up)_proj\.lora_B\.default\.weight$|"
    r"\.(o|down)_proj\.lora_A\.default\.weight$",
    "peft_llama_dora_tp": r"_proj\.base_layer\.weight$|\.(q|k|v|gate|up)_proj\.(lora_B\.default|"
    r"lora_magnitude_vector\.default)\.weight$|\.(o|down)_proj\.lora_A\.default\.weight$",
}
FROZEN = r"\.base(_layer)?\.(weight|bias)$"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("tp_lora")
    models = sorted({j["model"] for j in ALL.values()})
    jobs = [{**reference_job({"model": m}), "record_init": True} for m in models]  # the parameters before any step
    refs = dict(zip(models, run_jobs(tmp, jobs, nproc=1, timeout=300), strict=True))
    two = run_jobs(tmp, [*JOBS_2.values(), *REFUSED.values()], nproc=2, timeout=600)
    got = dict(zip([*JOBS_2, *REFUSED], two, strict=True))
    got.update(zip(JOBS_4, run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=600), strict=True))
    return {"ref": refs, "got": got}


@pytest.mark.parametrize("name", list(ALL))
def test_adapted_model_matches_one_process(runs: dict[str, Any], name: str) -> None:
    job, got = ALL[name], runs["got"][name]
    ref = runs["ref"][job["model"]]
    assert got["layout"]["tp"] == job["strategy"]["tp"]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    # Whole tensors under their original names (merged over the pipeline's stages).
    assert {k: tuple(v.shape) for k, v in got["params"].items()} == ref["param_shapes"]
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model", ["user_lora", "peft_llama"])
def test_frozen_base_weights_do_not_move_and_adapters_do(runs: dict[str, Any], model: str) -> None:
    # Not vacuous: the adapters trained (they differ from their initial values), the bases did not.
    start, end = runs["ref"][model]["init_state"], runs["got"][f"{model}_tp"]["params"]
    frozen = [k for k in end if re.search(FROZEN, k)]
    adapters = [k for k in end if re.search(r"\.(a|b|lora_A\.default|lora_B\.default)\.weight$", k)]
    assert len(frozen) >= 8 and len(adapters) >= 16
    params_close({k: end[k] for k in frozen}, {k: start[k] for k in frozen}, rtol=0, atol=0)
    assert all(not torch.allclose(end[k], start[k], rtol=1e-4, atol=0) for k in adapters)


@pytest.mark.parametrize("name", list(SPLIT))
def test_each_rank_holds_half_of_every_split_projection_and_adapter(runs: dict[str, Any], name: str) -> None:
    got = runs["got"][name]
    split = [k for k in got["params"] if re.search(SPLIT[name], k)]
    assert len(split) >= 16
    expected = sum(t.numel() * 4 // (2 if k in split else 1) for k, t in got["params"].items())
    assert got["mem"]["params"] == expected


@pytest.mark.parametrize("name", ["user_lora_tp", "peft_llama_tp", "peft_llama_dora_tp"])
def test_the_planner_prices_each_rank_exactly(runs: dict[str, Any], name: str) -> None:
    # Parameters (split adapters and magnitudes included), gradients and SGD momentum of the trainable ones only.
    from _job_models import MODELS

    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import state_bytes

    mem = runs["got"][name]["mem"]
    want = state_bytes(specs_from_module(MODELS[ALL[name]["model"]]()), Layout(tp=2, precision="32-true"),
                       optimizer="sgd", rank=0)  # fmt: skip
    assert (mem["params"], mem["grads"], mem["optim"]) == (want.parameters, want.gradients, want.optimizer)
    assert 0 < want.optimizer < want.parameters // 4  # the frozen bases hold no state


def test_dora_on_a_fused_projection_is_refused_before_the_first_step(runs: dict[str, Any]) -> None:
    got = runs["got"]["peft_phi3_dora_tp"]
    assert got["losses"] == [] and "TPPlanError" in got["error"]
    assert (
        "layers.0.self_attn.qkv_proj is a DoRA layer (peft use_dora=True) whose base lightning_par splits"
        in (got["error"])
    )
    assert "(a fused projection or a Conv1D); train it without tensor parallelism (tp=1" in got["error"]
