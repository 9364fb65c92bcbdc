"""QLoRA (Dettmers et al., arXiv 2305.14314): peft LoRA over Hugging Face Llama whose adapted base weights are 4-bit
NF4 (torchao's ``NF4Tensor``, frozen; tests/_lora_models.py ``QLoRALlama``), against the same QLoRA model in one
process. ``zero1`` and ``zero3`` (dp 2) and ``pipe`` (pp 2): fp32 losses and gradient norms 1e-5 relative, SGD
parameters 1e-5 relative / 1e-7 absolute (the 4-bit weights compared dequantised, and unchanged). Under ZeRO-3 each
rank holds half of the 4-bit codes and scalers (FSDP2 shards and gathers the NF4 tensors themselves, through
torchao's all-gather extension); under tp the model is refused before the first step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

pytest.importorskip("peft")
pytest.importorskip("torchao")

JOBS: dict[str, dict[str, Any]] = {
    "zero1": {"model": "qlora_llama", "strategy": "zero1", "dp": 2},
    "zero3": {"model": "qlora_llama", "strategy": "zero3", "dp": 2},
    "pipe": {"model": "qlora_llama", "strategy": {"pp": 2}, "dp": 1},
}
BASES = r"_proj\.base_layer\.weight$"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("qlora")
    ref = run_jobs(tmp, [{**reference_job({"model": "qlora_llama"}), "record_init": True}], nproc=1, timeout=300)[0]
    jobs = [*JOBS.values(), {"model": "qlora_llama", "strategy": "tp", "dp": 1, "expect_error": True}]
    got = run_jobs(tmp, jobs, nproc=2, timeout=600)
    return {"ref": ref, "got": dict(zip(JOBS, got, strict=False)), "tp": got[-1]}


@pytest.mark.parametrize("name", list(JOBS))
def test_qlora_matches_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs["got"][name], runs["ref"]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    bases = [k for k in got["params"] if re.search(BASES, k)]
    assert len(bases) == 14  # every projection of both layers is 4-bit, and comes out as it went in
    params_close({k: got["params"][k] for k in bases}, {k: ref["init_state"][k] for k in bases}, rtol=0, atol=0)


def _bytes(tensors: Any) -> int:
    from lightning_par.utils.dtensors import storages

    return sum(part.numel() * part.element_size() for t in tensors for part in storages(t))


def test_zero3_shards_the_four_bit_weights(runs: dict[str, Any]) -> None:
    from _lora_models import QLoRALlama

    model = QLoRALlama()
    total = _bytes(model.parameters())  # the NF4 tensors as their codes and scalers
    trainable = _bytes(p for p in model.parameters() if p.requires_grad)
    bases = [p for n, p in model.named_parameters() if re.search(BASES, n)]
    fp32 = sum(p.numel() * 4 for p in bases)
    assert _bytes(bases) * 7 < fp32  # NF4: 4 bits a value, plus the double-quantised scales
    zero1, zero3 = runs["got"]["zero1"]["mem"], runs["got"]["zero3"]["mem"]
    assert zero1["params"] == total  # every rank holds the whole model, the 4-bit weights as they are
    # ZeRO-3: half of every tensor per rank (all split evenly over 2), the 4-bit codes and scales included, but for
    # each NF4 weight's 16-value code book and scale mean, which every shard carries whole (68 bytes a weight); the
    # adapters' gradients and momentum only.
    small = sum(getattr(p, n).numel() * 4 for p in bases for n in ("scaler_mean", "nf4"))
    assert small == 68 * len(bases)
    assert zero3["params"] == (total - small) // 2 + small
    assert zero3["grads"] == zero3["optim"] == trainable // 2


@pytest.mark.parametrize("stage", [1, 3])
def test_the_planner_prices_each_rank_exactly(runs: dict[str, Any], stage: int) -> None:
    # The 4-bit weights at their stored bytes (split by ZeRO-3 but for their whole parts), nothing for their state.
    from _lora_models import QLoRALlama

    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import state_bytes

    mem = runs["got"][f"zero{stage}"]["mem"]
    layout = Layout(dp_shard=2, zero_stage=stage, precision="32-true")
    want = state_bytes(specs_from_module(QLoRALlama()), layout, optimizer="sgd", rank=0)
    assert (mem["params"], mem["grads"], mem["optim"]) == (want.parameters, want.gradients, want.optimizer)


def test_tensor_parallelism_refuses_a_quantised_base_before_the_first_step(runs: dict[str, Any]) -> None:
    got = runs["tp"]
    assert got["losses"] == [] and "TPPlanError" in got["error"]
    assert "self_attn.q_proj.base_layer.weight is a quantised weight (NF4Tensor: a QLoRA base)" in got["error"]
    assert "strategy='zero3', which shards the 4-bit weights themselves" in got["error"]
