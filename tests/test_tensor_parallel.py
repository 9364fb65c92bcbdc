"""Tensor (+ sequence) parallelism against the same training in one process (same seed, same global batches).

`tp` on 2 ranks (tp=2), `tp_zero3` on 4 (tp=2 x dp=2, FSDP2 over tp-sharded DTensors), `tp_zero1` / `tp_zero2` on
4 (our ZeRO engine over the tp-local shards), for the GPT (fused qkv), the Llama (GQA) and a Hugging Face Llama
wrapped by a user LightningModule. Tolerances as in test_zero.py: losses and grad norms 1e-5 relative, parameters
after SGD rtol 1e-5 / atol 1e-7. After AdamW the absolute tolerance is 2% of lr (1% under pure data parallelism):
row-parallel matmuls sum their partial products in another order, which changes float noise on gradients that
are ~0 (the attention key bias) and Adam turns that noise into steps of up to +-lr (test_zero.py says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import PARITY_JOBS, reference_job
from launch import run_jobs
from parity import clipped_fit_matches, params_close, rel, wrong_share

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

LR = 3e-3
# Low precision, against the one-process run in the same precision. Bounds set between measured runs
# (tools/mutate.py --measure, 2026-12-04; docs/testing.md, "Tolerances"): correct runs at most loss 2.6e-4 / wrong
# share 0.048; with tensor parallelism's all-reduce dropped at least 6.5e-3 / 0.61 (half the batch breaks nothing
# here: tp alone has one data-parallel rank). Margins: 3.8x / 2.5x above the correct, 6.5x / 5.1x below the broken.
LOW_LOSS = 1e-3
LOW_WRONG = 0.12
EXTRA = {  # jobs beyond the shared PARITY_JOBS, with their own one-process references
    "hf_llama": {"model": "hf_llama"},
    "gpt_sgd_foreach": {"model": "gpt_sgd_foreach"},  # foreach=True: CUDA's default
}
JOBS = ["gpt", "llama", "gpt_sgd", "gpt_accum_clip"]


def _ckpt_jobs(strategy: Any, dp: int, other: Any, other_dp: int, ckpt_dir: str) -> list[dict[str, Any]]:
    # One step per epoch, so a resume trains on the same samples (see test_zero._resume_jobs); the second job
    # resumes the first one's step-2 checkpoint under another layout.
    base = {"model": "gpt", "epoch_steps": 1, "max_steps": 4}
    return [
        {**base, "strategy": strategy, "dp": dp, "ckpt_dir": ckpt_dir},
        {**base, "strategy": other, "dp": other_dp, "resume": f"{ckpt_dir}/epoch=1.ckpt"},
    ]


RUNS: dict[str, dict[str, Any]] = {
    "tp": {
        "nproc": 2, "strategy": "tp", "dp": 1,
        "jobs": [*JOBS, "hf_llama", "gpt_sgd_foreach", "gpt_bf16_mixed", "llama_bf16_mixed", "gpt_16_mixed",
                 "gpt_bf16_true"],
        "sp_off": True, "ckpt": ("zero2", 2),
        "variants": {"ac_full": {"tp": 2, "activation_checkpointing": "full"},
                     "ac_selective_op": {"tp": 2, "activation_checkpointing": "selective_op"},
                     # tp_plan overrides reach the strategy: the MLPs stay replicated, attention is still split.
                     "plan_override": {"tp": 2, "tp_plan": {"transformer.h.*.mlp.c_fc": "replicate",
                                                            "transformer.h.*.mlp.c_proj": "replicate"}}},
    },
    "tp_zero3": {"nproc": 4, "strategy": "tp_zero3", "dp": 2, "jobs": [*JOBS, "hf_llama"], "ckpt": ("zero3", 4),
                 "variants": {"offload": {"tp": 2, "zero_stage": 3, "offload": True}}},
    "tp_zero1": {"nproc": 4, "strategy": "tp_zero1", "dp": 2, "jobs": ["gpt_sgd", "llama"], "ckpt": ("tp_zero3", 2)},
    "tp_zero2": {"nproc": 4, "strategy": "tp_zero2", "dp": 2, "jobs": ["gpt", "gpt_sgd"]},
}  # fmt: skip


def _job(name: str) -> dict[str, Any]:
    return {**PARITY_JOBS, **EXTRA}[name]


@pytest.fixture(scope="module")
def extra_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    results = run_jobs(tmp_path_factory.mktemp("tp_ref"), [reference_job(j) for j in EXTRA.values()], nproc=1)
    return dict(zip(EXTRA, results, strict=True))


@pytest.fixture(scope="module", params=list(RUNS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    name = request.param
    spec = RUNS[name]
    tmp: Path = tmp_path_factory.mktemp(name)
    jobs = [{**_job(j), "strategy": spec["strategy"], "dp": spec["dp"]} for j in spec["jobs"]]
    if spec.get("sp_off"):
        jobs.append({"model": "llama", "strategy": {"tp": 2, "sequence_parallel": False}, "dp": 1})
        jobs.append({"model": "gpt_3heads", "strategy": "tp", "dp": 1, "expect_error": True})
    variants = spec.get("variants", {})
    # SGD: its updates are linear in the gradients, so the variants' parameters are held to 1e-5. (AdamW turns the
    # float noise of another summation order on ~0 gradients into steps of up to lr, and how much noise a
    # recomputed backward adds differs between CPUs: AVX2 and AVX-512 machines part at another element.)
    jobs += [{"model": "gpt_sgd", "strategy": kw, "dp": spec["dp"]} for kw in variants.values()]
    if "ckpt" in spec:
        jobs += _ckpt_jobs(spec["strategy"], spec["dp"], *spec["ckpt"], str(tmp / "ckpts"))
    results = run_jobs(tmp, jobs, nproc=spec["nproc"], timeout=420)
    out = dict(zip(spec["jobs"], results[: len(spec["jobs"])], strict=True))
    if spec.get("sp_off"):
        out["llama_sp_off"], out["bad_tp"] = results[len(spec["jobs"]) : len(spec["jobs"]) + 2]
    start = len(spec["jobs"]) + (2 if spec.get("sp_off") else 0)
    out.update(zip(variants, results[start : start + len(variants)], strict=True))
    if "ckpt" in spec:
        out["ckpt_full"], out["ckpt_resumed"] = results[-2:]
    return name, out


def _ref(name: str, references: dict, extra_references: dict) -> dict[str, Any]:
    return {**references, **extra_references}[name]


def test_layout_is_tensor_parallel(run):
    name, out = run
    layout = next(iter(out.values()))["layout"]
    assert layout["tp"] == 2 and layout["dp_shard"] == RUNS[name]["dp"]
    assert layout["zero_stage"] == {"tp": 0, "tp_zero1": 1, "tp_zero2": 2, "tp_zero3": 3}[name]
    if name == "tp":
        # ZeRO-0 steps plain views of the tp shards (zero_local_views): no group mixes DTensors with plain tensors,
        # which torch's foreach kernels (CUDA's default) refuse; the parity tests below say the updates are unchanged.
        assert all(r["optimizer_dtensors"] == 0 for r in out.values() if "optimizer_dtensors" in r)
        assert out["gpt"]["optimizer_dtensors"] == 0 and out["gpt_sgd"]["optimizer_dtensors"] == 0


def test_fp32_adamw_matches_one_process(run, references, extra_references):
    _, out = run
    jobs = [j for j in ("gpt", "llama", "hf_llama") if j in out]
    assert jobs
    for job in jobs:
        got, ref = out[job], _ref(job, references, extra_references)
        assert len(got["losses"]) == len(ref["losses"]) == 3
        assert rel(got["losses"], ref["losses"]) < 1e-5, job
        assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5, job
        params_close(got["params"], ref["params"], rtol=1e-5, atol=0.02 * LR)


def test_fp32_sgd_parameters_match_to_1e5(run, references, extra_references):
    _, out = run
    # gpt_sgd_foreach: SGD with foreach=True (multi-tensor kernels, CUDA's default), which failed under tp at ZeRO-0
    # while its groups mixed the tp DTensors with plain tensors ("got mixed torch.Tensor and DTensor").
    for job in [j for j in ("gpt_sgd", "gpt_sgd_foreach") if j in out]:
        got, ref = out[job], _ref(job, references, extra_references)
        assert rel(got["losses"], ref["losses"]) < 1e-5, job
        params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


# tp_zero1 / tp_zero2 run no accumulation job: tp and tp_zero3 cover it, and the ZeRO engine's is test_zero's.
@pytest.mark.parametrize("run", ["tp", "tp_zero3"], indirect=True)
def test_accumulation_clipping_validation(run, references):
    _name, out = run
    got, ref = out["gpt_accum_clip"], references["gpt_accum_clip"]
    # Clipping over tp and dp shards: the true global norm.
    clipped_fit_matches(got, ref, param_atol=0.02 * LR)
    assert got["metric_groups_dp"] is True


# Precision is independent of the ZeRO stage (test_zero.py): run once, under tp.
@pytest.mark.parametrize("run", ["tp"], indirect=True)
def test_low_precision_and_sequence_parallel_off(run, references):
    _name, out = run
    for job in ("gpt_bf16_mixed", "llama_bf16_mixed", "gpt_16_mixed", "gpt_bf16_true"):
        got, ref = out[job], references[job]
        assert rel(got["losses"], ref["losses"]) < LOW_LOSS, job
        assert wrong_share(got["params"], ref["params"], ref["init_state"]) < LOW_WRONG, job
    # tp that does not divide the heads fails at setup, before the first step, naming the valid choices.
    assert out["bad_tp"]["losses"] == []
    assert "tp=2 does not divide n_heads=3" in out["bad_tp"]["error"]
    assert "choose tp in {1, 3}" in out["bad_tp"]["error"]
    got, ref = out["llama_sp_off"], references["llama"]
    assert got["layout"]["sequence_parallel"] is False
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=0.02 * LR)


@pytest.mark.parametrize("run", [n for n in RUNS if "ckpt" in RUNS[n]], indirect=True)
def test_checkpoint_resumes_on_another_layout(run):
    _name, out = run
    full, resumed = out["ckpt_full"], out["ckpt_resumed"]
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    assert resumed["layout"]["tp"] != full["layout"]["tp"] or resumed["layout"]["zero_stage"] != 0
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=0.02 * LR)


def _gpt_split_over_tp(name: str) -> bool:
    in_block = ".h." in name
    if name.endswith(".weight"):
        return in_block and any(m in name for m in ("c_attn", "c_fc", "c_proj"))
    return in_block and name.endswith(("c_attn.bias", "c_fc.bias"))  # row-parallel biases stay replicated


def test_per_rank_parameter_bytes(run):
    name, out = run
    got = out["gpt" if "gpt" in out else "gpt_sgd"]
    tp, dp = 2, RUNS[name]["dp"]
    expected = 0
    for k, t in got["params"].items():
        n = t.numel() * 4 // (tp if _gpt_split_over_tp(k) else 1)
        expected += n // dp if name == "tp_zero3" else n  # ZeRO 1-2 keep full (tp-local) parameters
    assert got["mem"]["params"] == expected


@pytest.mark.parametrize("run", [n for n in RUNS if RUNS[n].get("variants")], indirect=True)
def test_activation_checkpointing_and_offload_compose_with_tp(run, references):
    name, out = run
    variants = RUNS[name]["variants"]
    for key in variants:  # full / selective_op recomputation under tp; ZeRO-3 CPU offload of tp shards
        got, ref = out[key], references["gpt_sgd"]
        assert rel(got["losses"], ref["losses"]) < 1e-5, key
        params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    if "plan_override" in variants:
        # Replicated MLPs: only the attention Linears are split, so the rank holds more than under the full plan.
        full, kept = out["gpt"]["mem"]["params"], out["plan_override"]["mem"]["params"]
        mlp = sum(t.numel() * 4 for k, t in out["gpt"]["params"].items() if ".mlp.c_" in k and k.endswith("weight"))
        mlp += sum(t.numel() * 4 for k, t in out["gpt"]["params"].items() if k.endswith("mlp.c_fc.bias"))
        assert kept - full == mlp // 2
