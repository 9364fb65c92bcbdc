"""Low-rank adapters under the layouts other than tp, against the same adapted model in one process.

peft's ``get_peft_model`` LoRA (r 4, B random) on Hugging Face Llama (every attention and MLP projection; also DoRA,
its magnitude vector per projection), on Mixtral's attention (its stacked experts and router frozen), and a user's own
wrappers (`tests/_lora_models.py`), under ``zero1`` / ``zero2`` / ``zero3`` (dp 2), DeepSpeed's ZeRO-1 and ZeRO-3,
``pipe`` (pp 2), ``cp`` (2, SDPA) and ``moe`` (ep 2). The models are unmodified: nothing is refused because a
projection is wrapped. fp32 losses and gradient norms 1e-5 relative (the norms not under DeepSpeed, whose engine
keeps the gradients), SGD parameters 1e-5 relative / 1e-7 absolute; the frozen base weights come out as they went in,
and hold no gradient and no optimizer state (per-rank bytes: exactly the adapters' share, against full
fine-tuning's). Under tp (`tests/test_tp_lora.py`) the adapters follow their base's split, DoRA's magnitudes too.
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

JOBS: dict[str, dict[str, Any]] = {
    "peft_llama_zero1": {"model": "peft_llama", "strategy": "zero1", "dp": 2},
    "peft_llama_zero2": {"model": "peft_llama", "strategy": "zero2", "dp": 2},
    "peft_llama_zero3": {"model": "peft_llama", "strategy": "zero3", "dp": 2},
    "peft_llama_pipe": {"model": "peft_llama", "strategy": {"pp": 2}, "dp": 1},
    "peft_llama_cp": {"model": "peft_llama_sdpa", "strategy": {"cp": 2}, "dp": 1},
    "peft_llama_deepspeed_zero1": {"model": "peft_llama", "strategy": "deepspeed_zero1", "dp": 2},
    "peft_llama_deepspeed_zero3": {"model": "peft_llama", "strategy": "deepspeed_zero3", "dp": 2},
    "peft_llama_dora_zero1": {"model": "peft_llama_dora", "strategy": "zero1", "dp": 2},
    "peft_llama_dora_zero3": {"model": "peft_llama_dora", "strategy": "zero3", "dp": 2},
    "peft_llama_dora_cp": {"model": "peft_llama_dora_sdpa", "strategy": {"cp": 2}, "dp": 1},
    "peft_llama_dora_pipe": {"model": "peft_llama_dora", "strategy": {"pp": 2}, "dp": 1},
    "user_lora_zero2": {"model": "user_lora", "strategy": "zero2", "dp": 2},
    "user_lora_zero3": {"model": "user_lora", "strategy": "zero3", "dp": 2},
    "user_lora_pipe": {"model": "user_lora", "strategy": {"pp": 2}, "dp": 1},
    "peft_mixtral_moe": {"model": "peft_mixtral", "strategy": "moe", "dp": 2},
    "peft_mixtral_zero3": {"model": "peft_mixtral", "strategy": "zero3", "dp": 2},
    # LoRA on the stacked expert weights too (peft target_parameters): the MoE finder sees through the adapters, so the
    # routers' statistics are gathered over dp as without them (they were not: the losses drifted 1.6e-4).
    "peft_mixtral_experts_zero1": {"model": "peft_mixtral_experts", "strategy": "zero1", "dp": 2},
    "peft_mixtral_experts_zero3": {"model": "peft_mixtral_experts", "strategy": "zero3", "dp": 2},
    "peft_mixtral_experts_tp": {"model": "peft_mixtral_experts", "strategy": {"tp": 2}, "dp": 1},
    # Under ep each rank folds in its experts' share of the whole adapters (parallel/experts/stacked.py).
    "peft_mixtral_experts_moe": {"model": "peft_mixtral_experts", "strategy": "moe", "dp": 2},
}
# 4 ranks: ep 2 x 2 replicas of each expert (their gradients averaged over dp like any dense parameter's).
JOBS_4 = {"peft_mixtral_experts_ep2_dp4": {"model": "peft_mixtral_experts", "strategy": {"ep": 2}, "dp": 4}}
# Under pipe each microbatch's load-balancing loss is its own: the reference accumulates the 4 microbatches.
PIPE = {"peft_mixtral_experts_pipe": {"model": "peft_mixtral_experts", "strategy": {"pp": 2}, "dp": 1}}
FROZEN = r"\.base(_layer)?\.(weight|bias)$|\.experts\.|\.gate\.weight$|\.embed_tokens\.|\.lm_head\.|norm\.weight$"
ADAPTERS = r"\.(a|b|lora_A\.default|lora_B\.default)\.weight$|lora_magnitude_vector"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("lora_layouts")
    models = sorted({j["model"] for j in JOBS.values()} | {"hf_llama"})
    jobs = [{**reference_job({"model": m}), "record_init": True} for m in models]  # the parameters before any step
    accumulated = {**reference_job({"model": "peft_mixtral_experts"}), "global_batch": 2, "accumulate": 4}
    refs = dict(zip([*models, "accumulated"], run_jobs(tmp, [*jobs, accumulated], nproc=1, timeout=300), strict=True))
    extra = [{"model": "hf_llama", "strategy": "zero1", "dp": 2}]  # full fine-tuning, for its state bytes
    got = run_jobs(tmp, [*JOBS.values(), *PIPE.values(), *extra], nproc=2, timeout=600)
    n = len(JOBS)
    got_4 = dict(zip(JOBS_4, run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=600), strict=True))
    return {"ref": refs, "got": {**dict(zip(JOBS, got[:n], strict=True)), **got_4}, "pipe": got[n],
            "full_zero1": got[n + 1]}  # fmt: skip


@pytest.mark.parametrize("name", [*JOBS, *JOBS_4])
def test_adapted_model_matches_one_process(runs: dict[str, Any], name: str) -> None:
    job, got = {**JOBS, **JOBS_4}[name], runs["got"][name]
    ref = runs["ref"][job["model"]]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    if "deepspeed" not in name:  # DeepSpeed's engine keeps the gradients in its own buffers, not in .grad
        assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(JOBS))
def test_frozen_weights_do_not_move_and_adapters_do(runs: dict[str, Any], name: str) -> None:
    # Not vacuous: the adapters trained (they differ from their initial values), the frozen weights did not.
    start, end = runs["ref"][JOBS[name]["model"]]["init_state"], runs["got"][name]["params"]
    frozen = [k for k in end if re.search(FROZEN, k) and not re.search(ADAPTERS, k)]
    adapters = [k for k in end if re.search(ADAPTERS, k)]
    assert len(frozen) >= 8 and len(adapters) >= 8
    params_close({k: end[k] for k in frozen}, {k: start[k] for k in frozen}, rtol=0, atol=0)
    assert all(not torch.allclose(end[k], start[k], rtol=1e-4, atol=0) for k in adapters)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_weights_hold_no_gradient_and_no_optimizer_state(runs: dict[str, Any], stage: int) -> None:
    # Per rank (dp 2): gradients and SGD's momentum exactly half of the adapters' bytes (16 KiB over 2), where full
    # fine-tuning of the same Llama holds half of every weight's (per state: its AdamW has two); ZeRO-3 also shards
    # the frozen weights themselves.
    from _lora_models import PeftLlama

    model = PeftLlama()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * 4 for p in model.parameters())
    mem = runs["got"][f"peft_llama_zero{stage}"]["mem"]
    assert mem["grads"] == mem["optim"] == trainable // 2
    assert mem["params"] == (total // 2 if stage == 3 else total)
    full = runs["full_zero1"]["mem"]
    assert full["optim"] >= (total - trainable) // 2 > 8 * mem["optim"]


def test_expert_adapters_under_pipe_match_one_process_accumulating_the_microbatches(runs: dict[str, Any]) -> None:
    got, ref = runs["pipe"], runs["ref"]["accumulated"]
    want = [sum(ref["losses"][i : i + 4]) / 4 for i in range(0, len(ref["losses"]), 4)]  # the pipeline logs the mean
    assert len(got["losses"]) == len(want) == 3
    assert rel(got["losses"], want) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
