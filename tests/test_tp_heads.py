"""Tensor parallelism of what an attention holds per head besides its projections, against one process.

Three things the column split of q/k/v leaves to do (lightning_par/parallel/tensor/heads.py): Qwen3's per-head q/k norms
(``head_norm``: the weight's gradient summed over tp), GPT-OSS's per-head ``sinks`` (split with the heads) and OLMoE's
q/k norms over the whole width (``colwise_norm``: weight split, mean of squares over tp). First the gradients themselves
after one backward on 2 ranks (`tests/_tp_heads_worker.py`), then training: the families under ``tp`` (2 ranks; the MoE
layers kept whole), dense Qwen3 with accumulation and clipping, GPT-OSS with activation checkpointing, a GPT-OSS
checkpoint written under ``tp`` resumed under ``zero2``, and on 4 ranks ``pipe_tp`` (pp 2 x tp 2) and ``tp_zero3`` (tp 2
x dp 2, FSDP2 sharding the tp-local tensors over dp), and tp 4 with fewer key/value heads than ranks (Hugging Face
Llama's 2, Falcon's multi-query 1: each replicated over the ranks that read it). Tolerances as everywhere: fp32 losses
and gradient norms 1e-5 relative, SGD + momentum parameters 1e-5 relative / 1e-7 absolute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs, split_gradients
from parity import params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GRAD_MODELS = ("hf_qwen3", "hf_qwen3_moe", "hf_gpt_oss", "hf_olmoe")

# Keys spelled out: docs/compatibility.md cites them (tests/test_check.py looks for each one here).
TP, TP_ZERO3 = {"strategy": {"tp": 2}, "dp": 1}, {"strategy": {"tp": 2, "zero_stage": 3}, "dp": 2}
JOBS_2: dict[str, dict[str, Any]] = {
    "hf_qwen3_tp": {"model": "hf_qwen3", **TP},
    "hf_qwen3_moe_tp": {"model": "hf_qwen3_moe", **TP},  # MoE layers kept whole, aux loss on
    "hf_gpt_oss_tp": {"model": "hf_gpt_oss", **TP},
    "hf_olmoe_tp": {"model": "hf_olmoe", **TP},
    "hf_qwen3_tp_accum_clip": {"model": "hf_qwen3", **TP, "accumulate": 2, "clip": 0.05},
    # Recomputation runs the attention's forward again: the sinks are swapped in and out once more. The model's
    # config keeps use_cache=True: checkpointing turns the model's own switch on, so no KV cache is filled twice.
    "hf_gpt_oss_tp_ac": {
        "model": "hf_gpt_oss",
        "strategy": {"tp": 2, "activation_checkpointing": "full"},
        "dp": 1,
    },
}
JOBS_4: dict[str, dict[str, Any]] = {
    "hf_qwen3_pipe_tp": {"model": "hf_qwen3", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    "hf_qwen3_tp_zero3": {"model": "hf_qwen3", **TP_ZERO3},
    "hf_gpt_oss_tp_zero3": {"model": "hf_gpt_oss", **TP_ZERO3},  # the sinks' swap under FSDP2's unsharded params
    "hf_olmoe_tp_zero3": {"model": "hf_olmoe", **TP_ZERO3},
    # Fewer key/value heads than tp ranks: each replicated over the ranks whose query heads read it (kv_heads.py).
    "hf_llama_gqa_tp4": {"model": "hf_llama", "strategy": {"tp": 4}, "dp": 1},  # 2 k/v heads: ranks 0-1, 2-3
    "hf_falcon_mqa_tp4": {"model": "hf_falcon_mqa", "strategy": {"tp": 4}, "dp": 1},  # 1 k/v head in a fused qkv
}
ALL = {**JOBS_2, **JOBS_4}


def _ckpt_jobs(ckpt_dir: str) -> list[dict[str, Any]]:
    # One step per epoch, so the resumed run trains on the same samples (tests/test_tensor_parallel.py).
    base = {"model": "hf_gpt_oss", "epoch_steps": 1, "max_steps": 4}
    return [
        {**base, "strategy": {"tp": 2}, "dp": 1, "ckpt_dir": ckpt_dir},
        {**base, "strategy": {"zero_stage": 2}, "dp": 2, "resume": f"{ckpt_dir}/epoch=1.ckpt"},
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp_heads")
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k != "dp"}) for j in ALL.values()], nproc=1,
                    timeout=900)  # fmt: skip
    got = run_jobs(tmp, [*JOBS_2.values(), *_ckpt_jobs(str(tmp / "ckpt"))], nproc=2, timeout=900)
    full, resumed = got[len(JOBS_2) :]
    got = got[: len(JOBS_2)] + run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=900)
    return {"pairs": dict(zip(ALL, zip(got, refs, strict=True), strict=True)), "ckpt": (full, resumed)}


@pytest.mark.timeout(300)
def test_gradients_of_split_heads_match_one_process(tmp_path: Path) -> None:
    got = split_gradients(tmp_path, GRAD_MODELS)
    layer = "model.model.layers.0.self_attn"
    # Per-head norms: replicated weights whose gradient is the sum over both ranks' heads (checked above).
    for model in ("hf_qwen3", "hf_qwen3_moe"):
        assert got[model]["layouts"][f"{layer}.q_norm.weight"] == "(Replicate(),)"
    assert got["hf_gpt_oss"]["layouts"][f"{layer}.sinks"] == "(Shard(dim=0),)"  # each rank its heads' sinks
    assert got["hf_olmoe"]["layouts"][f"{layer}.q_norm.weight"] == "(Shard(dim=0),)"  # split like q_proj's output


@pytest.mark.parametrize("name", list(ALL))
def test_matches_one_process(results: dict[str, Any], name: str) -> None:
    got, ref = results["pairs"][name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


def test_sinks_checkpoint_resumes_under_zero2(results: dict[str, Any]) -> None:
    # Written under tp, where each rank holds half of every layer's sinks; the checkpoint holds the whole tensor.
    full, resumed = results["ckpt"]
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=1e-7)
    assert full["params"]["model.model.layers.0.self_attn.sinks"].shape == (4,)
