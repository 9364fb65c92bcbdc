"""QLoRA (Dettmers et al., arXiv 2305.14314): peft LoRA over Hugging Face Llama whose adapted base weights are 4-bit
NF4 (torchao's ``NF4Tensor``, frozen; tests/_lora_models.py ``QLoRALlama``), against the same QLoRA model in one
process. ``zero1`` and ``zero3`` (dp 2), ``pipe`` (pp 2) and the tp layouts: fp32 losses and gradient norms 1e-5
relative, SGD parameters 1e-5 relative / 1e-7 absolute (the 4-bit weights compared dequantised, and unchanged). Under
ZeRO-3 each rank holds half of the 4-bit codes and scales (FSDP2 shards and gathers the NF4 tensors themselves,
through torchao's all-gather extension). ``tp`` (with and without sequence parallelism) and ``tp_zero3`` (tp 2 x
dp 2): the 4-bit bases stay whole on every tp rank, each multiplying by its rows or columns of their values. The
planner's per-rank bytes equal the runs'.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import fp32_parity, params_close

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

pytest.importorskip("peft")
pytest.importorskip("torchao")

JOBS: dict[str, dict[str, Any]] = {
    "zero1": {"model": "qlora_llama", "strategy": "zero1", "dp": 2},
    "zero3": {"model": "qlora_llama", "strategy": "zero3", "dp": 2},
    "pipe": {"model": "qlora_llama", "strategy": {"pp": 2}, "dp": 1},
    # The 4-bit bases stay whole on every tp rank, each multiplying by its rows or columns of their values.
    "tp": {"model": "qlora_llama", "strategy": {"tp": 2}, "dp": 1},
    "tp_nosp": {"model": "qlora_llama", "strategy": {"tp": 2, "sequence_parallel": False}, "dp": 1},
}
JOBS_4 = {"tp_zero3": {"model": "qlora_llama", "strategy": {"tp": 2, "zero_stage": 3}, "dp": 2}}
BASES = r"_proj\.base_layer\.weight$"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("qlora")
    ref = run_jobs(tmp, [{**reference_job({"model": "qlora_llama"}), "record_init": True}], nproc=1, timeout=300)[0]
    got = dict(zip(JOBS, run_jobs(tmp, list(JOBS.values()), nproc=2, timeout=600), strict=True))
    got.update(zip(JOBS_4, run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=600), strict=True))
    # Written in the background (async_save: the NF4 tensors, which have no storage of their own, staged whole) and
    # resumed from step 2: the run continues the uninterrupted one.
    writer = {"model": "qlora_llama", "steps": 4, "strategy": {"zero_stage": 3, "async_save": True}, "dp": 2,
              "ckpt_dir": str(tmp / "ckpt"), "ckpt_every_n_steps": 1}  # fmt: skip
    got["async_writer"] = run_jobs(tmp / "w", [writer], nproc=2, timeout=600)[0]
    resumed = {**writer, "ckpt_dir": None, "ckpt_every_n_steps": None, "resume": str(tmp / "ckpt" / "step=2.ckpt")}
    got["async_resumed"] = run_jobs(tmp / "r", [resumed], nproc=2, timeout=600)[0]
    return {"ref": ref, "got": got}


def test_an_asynchronously_saved_checkpoint_resumes_exactly(runs: dict[str, Any]) -> None:
    whole, resumed = runs["got"]["async_writer"], runs["got"]["async_resumed"]
    assert resumed["resumed_from"] == "step=2.ckpt" and resumed["losses"] == whole["losses"][2:]
    params_close(resumed["params"], whole["params"], rtol=0, atol=0)


@pytest.mark.parametrize("name", [*JOBS, *JOBS_4])
def test_qlora_matches_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs["got"][name], runs["ref"]
    fp32_parity(got, ref, steps=3)
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


@pytest.mark.parametrize(("name", "layout"), [
    ("zero1", {"dp_shard": 2, "zero_stage": 1}),
    ("zero3", {"dp_shard": 2, "zero_stage": 3}),
    ("tp", {"tp": 2}),  # the 4-bit weights whole, the adapters split with their bases
    ("tp_zero3", {"tp": 2, "dp_shard": 2, "zero_stage": 3}),
])  # fmt: skip
def test_the_planner_prices_each_rank_exactly(runs: dict[str, Any], name: str, layout: dict[str, int]) -> None:
    # The 4-bit weights at their stored bytes (split by ZeRO-3 but for their whole parts), nothing for their state.
    from _lora_models import QLoRALlama

    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import state_bytes

    mem = runs["got"][name]["mem"]
    want = state_bytes(specs_from_module(QLoRALlama()), Layout(**layout, precision="32-true"), optimizer="sgd", rank=0)
    assert (mem["params"], mem["grads"], mem["optim"]) == (want.parameters, want.gradients, want.optimizer)
