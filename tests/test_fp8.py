"""fp8 training (``ParallelStrategy(fp8="emulate")``: torchao's float8 recipe, emulated on CPU) against one process.

The one-process reference converts its trunk's linear layers with torchao itself (`_job_callbacks.TorchaoFp8`, a
rule written apart from the library's), and reads each global batch in the sub-batches a layout's activation
scales come from: tensor-wise scaling takes one scale per tensor, so a data-parallel rank's (a pipeline
microbatch's) activations and gradients get their own, as one process accumulating gradients over the same
sub-batches gets them (``rank_order``, ``accumulate``). The weights' scales are the whole weights' in every layout.

- Data parallelism and pipelines compute each sample as the reference does: ZeRO-1, ZeRO-3 (weights all-gathered
  in fp8, also with activation offload), ``pipe``, ``pipe_zero3`` and ZBV match it as fp32 layouts match one
  process (measured: bitwise on 2 ranks).
- Tensor parallelism sums a row-split layer's partial products in another order, and an fp8 cast rounds that fp32
  noise to the nearest of 8 (e4m3) or 4 (e5m2) steps per octave, now and then to the other side: with AdamW one
  such flip moves a weight by a step's worth (measured: 0.9 % of the training's movement). Tested on Hugging Face
  Llama with SGD, linear in the gradient, by `parity.wrong_share` < 1e-3 and losses within 5e-5: measured
  2026-12-06, 6e-7 / 1e-7 under tp (with and without sequence parallelism), pipe_tp and tp_zero3; the same layout
  with fp8 off (a silently ignored setting) scores 2.7e-2 / 2.2e-4, and is checked to fail here.
- ``compile=True`` compiles the casts, whose scales then round differently from eager's (measured against the
  eager reference, gpt + SGD: wrong_share 2.0e-3, losses 1.5e-5; compiled with fp8 off: 1.26e-2, 2.2e-4): bounds
  5e-3 and 5e-5, each about 2.5x from both.
- Over 50 steps in bf16-mixed, fp8 stays as close to the bf16 loss curve as fp32 does (measured: mean relative gap
  0.22 %, max 1.4 %; fp32 0.17 %, 1.6 %); the bound (mean 0.8 %, max 4 %) fails the same bf16 run on half the
  batch (2.4 %, 10.7 %).
- Which layers: the reference's and the run's fp8 layers are the same, and under tp the fused projections tp
  splits with its own code stay in the training precision (listed at start-up).
- A meta-built model (``empty_init``) gets the same initial values with fp8 as without.
- Models we did not write (the zoo's OLMo, Falcon, Mamba) under ZeRO-3 match one process converting the same layers,
  and the layers their code would break (an output changed in place, a weight read outside its layer) are kept.

- A checkpoint of a ZeRO-3 fp8 run, saved in the background, resumes under ZeRO-3 and ZeRO-1 and continues the
  uninterrupted run; pretrained weights read into a ZeRO-3 fp8 layout train as one process loading them does.

Spawns: two 2-rank torchruns (23 jobs, then 2 resumes), one 4-rank torchrun (2 jobs), two of one process (9
references, then the zoo models' 3).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import params_close, rel, wrong_share

FP8 = {"fp8": "emulate"}
STEPS = 3
# name -> (job, its reference: (model, rank_order, accumulate)).
RUNS: dict[str, tuple[dict[str, Any], tuple[str, int, int]]] = {
    "zero1": ({"model": "gpt", "strategy": {"zero_stage": 1, **FP8}}, ("gpt", 2, 2)),
    "zero3": ({"model": "gpt", "strategy": {"zero_stage": 3, **FP8}}, ("gpt", 2, 2)),
    "zero3_llama": ({"model": "hf_llama_sgd", "strategy": {"zero_stage": 3, **FP8}}, ("hf_llama_sgd", 2, 2)),
    # 2*pp = 4 microbatches of 2 samples: each its own activation scales, as 4 accumulated sub-batches
    "pipe": ({"model": "gpt", "dp": 1, "strategy": {"pp": 2, **FP8}}, ("gpt", 1, 4)),
    "pipe_zero3": ({"model": "gpt", "dp": 1, "strategy": {"pp": 2, "zero_stage": 3, **FP8}}, ("gpt", 1, 4)),
    # a V schedule (two stages a rank, the weights' backward apart) on 8 blocks
    "pipe_zbv": (
        {"model": "gpt8_sgd", "dp": 1, "strategy": {"pp": 2, "pp_schedule": "zbv", **FP8}},
        ("gpt8_sgd", 1, 4),
    ),
    # activation offload beside fp8's wrapped weights (it crashed reading their storage)
    "zero3_ac_offload": (
        {"model": "gpt", "strategy": {"zero_stage": 3, "activation_checkpointing": "offload", **FP8}},
        ("gpt", 2, 2),
    ),
    "tp": ({"model": "hf_llama_sgd", "dp": 1, "strategy": {"tp": 2, **FP8}}, ("hf_llama_sgd", 1, 1)),
    "tp_no_sp": (
        {"model": "hf_llama_sgd", "dp": 1, "strategy": {"tp": 2, "sequence_parallel": False, **FP8}},
        ("hf_llama_sgd", 1, 1),
    ),
    # our GPT under tp: its fused q/k/v projection stays in fp32 (tp splits it by parts with its own code)
    "tp_fused": ({"model": "gpt", "dp": 1, "strategy": {"tp": 2, **FP8}}, ("gpt", 1, 1)),
    # compiled blocks with the regions' fp8 gathers (kept out of the graph): the eager tp run's numbers exactly
    "tp_compile": ({"model": "hf_llama_sgd", "dp": 1, "strategy": {"tp": 2, "compile": True, **FP8}},
                   ("hf_llama_sgd", 1, 1)),
    "compile": ({"model": "gpt_sgd", "strategy": {"zero_stage": 3, "compile": True, **FP8}}, ("gpt_sgd", 2, 2)),
    # Broken on purpose: fp8 off, against the fp8 references (each tolerance must fail it).
    "tp_off": ({"model": "hf_llama_sgd", "dp": 1, "strategy": {"tp": 2}}, ("hf_llama_sgd", 1, 1)),
    "zero3_off": ({"model": "gpt", "strategy": {"zero_stage": 3}}, ("gpt", 2, 2)),
    "compile_off": ({"model": "gpt_sgd", "strategy": {"zero_stage": 3, "compile": True}}, ("gpt_sgd", 2, 2)),
}
RUNS4: dict[str, tuple[dict[str, Any], tuple[str, int, int]]] = {
    # ZeRO-3 over tp: the weights' scales from the whole weight (fp8/scales.py), not one tp rank's slice
    "tp_zero3": (
        {"model": "hf_llama_sgd", "dp": 2, "strategy": {"tp": 2, "zero_stage": 3, **FP8}},
        ("hf_llama_sgd", 2, 2),
    ),
    "pipe_tp": ({"model": "hf_llama_sgd", "dp": 1, "strategy": {"pp": 2, "tp": 2, **FP8}}, ("hf_llama_sgd", 1, 4)),
}
ZOO = ("olmo", "falcon", "mamba")
EXACT = ("zero1", "zero3", "zero3_llama", "pipe", "pipe_zero3", "pipe_zbv", "zero3_ac_offload", "pretrained")
SUMMED = ("tp", "tp_no_sp", "tp_zero3", "pipe_tp")  # tp's partial sums: the fp8 casts round their noise (docstring)
WRONG, LOSS = 1e-3, 5e-5
COMPILED_WRONG, COMPILED_LOSS = 5e-3, 5e-5
CURVE_STEPS = 50
CURVE: dict[str, dict[str, Any]] = {
    "fp8": {"strategy": {"zero_stage": 3, **FP8}},
    "bf16": {"strategy": {"zero_stage": 3}},
    "half_batch": {"strategy": {"zero_stage": 3}, "global_batch": 4},  # broken on purpose
}
MEAN_GAP, MAX_GAP = 8e-3, 4e-2


def _reference(model: str, order: int, accumulate: int) -> dict[str, Any]:
    return {"model": model, "strategy": "auto", "steps": STEPS, "global_batch": 8 // accumulate,
            "accumulate": accumulate, "rank_order": order, "torchao_fp8": True, "record_init": True}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fp8")
    refs: dict[Any, dict[str, Any]] = {ref: _reference(*ref) for _, ref in (*RUNS.values(), *RUNS4.values())}
    jobs = {name: {"steps": STEPS, **job} for name, (job, _) in RUNS.items()}
    meta = {"model": "gpt", "steps": 1, "empty_init": True, "record_init": True}
    jobs["meta_fp8"] = {**meta, "strategy": {"zero_stage": 3, **FP8}}
    jobs["meta_fp32"] = {**meta, "strategy": {"zero_stage": 3}}
    jobs["on_cpu"] = {"model": "gpt", "steps": 1, "strategy": {"zero_stage": 3, "fp8": True}, "expect_error": True}
    jobs.update({f"curve_{k}": {"model": "gpt", "steps": CURVE_STEPS, "precision": "bf16-mixed", **j}
                 for k, j in CURVE.items()})  # fmt: skip
    # Its checkpoints are written in the background (async_save): fp8's wrapped weights staged as their values.
    jobs["zero3"].update(ckpt_dir=str(tmp / "ckpt"), ckpt_every_n_steps=1)
    jobs["zero3"]["strategy"] = {**jobs["zero3"]["strategy"], "async_save": True}
    # Pretrained weights read into the fp8 layers of a ZeRO-3 layout, against one process loading them itself.
    folder = _pretrained_folder(tmp / "hf")
    jobs["pretrained"] = {"model": "hf_llama_sgd", "steps": STEPS,
                          "strategy": {"zero_stage": 3, "pretrained": str(folder), **FP8}}  # fmt: skip
    refs["pretrained"] = {**_reference("hf_llama_sgd", 2, 2), "hf_from_pretrained": str(folder)}
    # Models we did not write, from the zoo's shrinking rule (tests/_zoo.py): OLMo (a block of fp8 weights only:
    # its unit all-gathered as bytes), Falcon (its MLP output changed in place), Mamba (a weight read outside its
    # layer). Their reference converts what the run converted (the run names them: fp8_layers).
    jobs.update({f"zoo_{arch}": {"model": f"zoo:{arch}", "steps": STEPS, "strategy": {"zero_stage": 3, **FP8}}
                 for arch in ZOO})  # fmt: skip
    one = dict(zip(refs, run_jobs(tmp / "n1", list(refs.values()), nproc=1, timeout=400), strict=True))
    got = dict(zip(jobs, run_jobs(tmp / "n2", list(jobs.values()), nproc=2, timeout=600), strict=True))
    got["pretrained"]["ref"] = one["pretrained"]
    # Resumed from the ZeRO-3 run's step 2: under ZeRO-3 again, and under ZeRO-1 (the same scales on 2 ranks).
    resumed = {name: {**RUNS["zero3"][0], "steps": STEPS, "resume": str(tmp / "ckpt" / "step=2.ckpt"),
                      "strategy": {"zero_stage": stage, **FP8}} for name, stage in (("resume_zero3", 3),
                                                                                     ("resume_zero1", 1))}  # fmt: skip
    got.update(zip(resumed, run_jobs(tmp / "r2", list(resumed.values()), nproc=2, timeout=600), strict=True))
    zoo_refs = [{**_reference(f"zoo:{arch}", 2, 2), "torchao_fp8": got[f"zoo_{arch}"]["fp8_layers"]} for arch in ZOO]
    for arch, ref in zip(ZOO, run_jobs(tmp / "z1", zoo_refs, nproc=1, timeout=400), strict=True):
        got[f"zoo_{arch}"]["ref"] = ref
    four = run_jobs(tmp / "n4", [{"steps": STEPS, **job} for job, _ in RUNS4.values()], nproc=4, timeout=600)
    got.update(zip(RUNS4, four, strict=True))
    for name, (_, ref) in (*RUNS.items(), *RUNS4.items()):
        got[name]["ref"] = one[ref]
    return got


def _pretrained_folder(path: Any) -> Any:
    """A Hugging Face folder of the test Llama (`_job_models`' ``hf_llama``) with weights unlike a fresh model's."""
    from _job_models import MODELS

    torch.manual_seed(3)
    model = MODELS["hf_llama"]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.model.save_pretrained(path)
    return path


def _losses(got: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The run's losses and the reference's, each step's mean over its sub-batches."""
    ref = got["ref"]["losses"]
    parts = len(ref) // len(got["losses"])
    assert len(got["losses"]) == STEPS and len(ref) == STEPS * parts
    return got["losses"], [sum(ref[i : i + parts]) / parts for i in range(0, len(ref), parts)]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_data_parallel_and_pipelines_match_one_process(runs: dict[str, Any], name: str) -> None:
    got = runs[name]
    assert got["fp8_layers"] and got["fp8_layers"] == got["ref"]["fp8_layers"]
    losses, want = _losses(got)
    assert rel(losses, want) < 1e-6
    params_close(got["params"], got["ref"]["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ZOO)
def test_models_we_did_not_write_match_one_process(runs: dict[str, Any], arch: str) -> None:
    got = runs[f"zoo_{arch}"]
    assert got["fp8_layers"]
    kept = " ".join(line for line in got["startup"] if "kept in the training precision" in line)
    if arch == "falcon":  # its MLP's output projection: the attention's output is added into it in place
        assert "its output is changed in place" in kept and "dense_4h_to_h" in kept
    if arch == "mamba":  # dt_proj: its weight multiplies the time step outside the layer
        assert "its weight is read outside its forward" in kept and "dt_proj" in kept
    losses, want = _losses(got)
    assert rel(losses, want) < 1e-6
    params_close(got["params"], got["ref"]["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", SUMMED)
def test_tensor_parallel_layouts_follow_one_process(runs: dict[str, Any], name: str) -> None:
    got = runs[name]
    assert got["fp8_layers"] and got["fp8_layers"] == got["ref"]["fp8_layers"]
    losses, want = _losses(got)
    assert rel(losses, want) < LOSS
    assert wrong_share(got["params"], got["ref"]["params"], got["ref"]["init_state"]) < WRONG


@pytest.mark.slow
@pytest.mark.parametrize(("name", "regions"), [("tp", "model.model.layers.*.self_attn, model.model.layers.*.mlp"),
                                               ("tp_zero3", "model.model.layers.*.self_attn, model.model.layers.*.mlp"),
                                               ("pipe_tp", "model.model.layers.*.self_attn, model.model.layers.*.mlp"),
                                               ("tp_fused", "transformer.h.*.mlp"), ("tp_no_sp", None)])  # fmt: skip
def test_sequence_parallelism_gathers_the_regions_inputs_in_fp8(runs: dict[str, Any], name: str,
                                                                regions: str | None) -> None:  # fmt: skip
    # The runs above follow one process with it on (tests/test_fp8_sequence.py: bitwise the same as without).
    lines = [line for line in runs[name]["startup"] if "all-gathers in fp8" in line]
    assert lines == ([f"fp8: sequence parallelism all-gathers in fp8 the input of {regions}"] if regions else [])


@pytest.mark.slow
def test_compiled_tp_blocks_gather_in_fp8_as_eager_ones_do(runs: dict[str, Any]) -> None:
    got, eager = runs["tp_compile"], runs["tp"]
    assert got["compiled_blocks"] == 2 and any("all-gathers in fp8" in line for line in got["startup"])
    assert rel(got["losses"], eager["losses"]) < 1e-6  # measured: equal (traced with the block it drifted 3.6e-3)
    params_close(got["params"], eager["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_tolerances_fail_a_run_without_fp8(runs: dict[str, Any]) -> None:
    off = runs["tp_off"]
    assert not off["fp8_layers"]
    losses, want = _losses(off)
    assert rel(losses, want) > LOSS
    assert wrong_share(off["params"], off["ref"]["params"], off["ref"]["init_state"]) > WRONG
    with pytest.raises(AssertionError):
        params_close(runs["zero3_off"]["params"], runs["zero3_off"]["ref"]["params"], rtol=1e-5, atol=1e-7)
    compiled_off = runs["compile_off"]
    assert rel(*_losses(compiled_off)) > COMPILED_LOSS
    ref = compiled_off["ref"]
    assert wrong_share(compiled_off["params"], ref["params"], ref["init_state"]) > COMPILED_WRONG


@pytest.mark.slow
def test_compiled_blocks_train_in_fp8(runs: dict[str, Any]) -> None:
    got = runs["compile"]
    assert got["compiled_blocks"] == 2 and got["fp8_layers"] == got["ref"]["fp8_layers"]
    assert rel(*_losses(got)) < COMPILED_LOSS
    assert wrong_share(got["params"], got["ref"]["params"], got["ref"]["init_state"]) < COMPILED_WRONG


@pytest.mark.slow
def test_tp_keeps_the_fused_projection_it_splits_itself(runs: dict[str, Any]) -> None:
    got = runs["tp_fused"]
    assert got["fp8_layers"] == [n for n in got["ref"]["fp8_layers"] if not n.endswith("attn.c_attn")]
    assert "transformer.h.0.attn.c_proj" in got["fp8_layers"]
    kept = [line for line in got["startup"] if "kept in the training precision (split by tensor parallelism" in line]
    assert kept and "transformer.h.*.attn.c_attn" in kept[0]


@pytest.mark.slow
def test_fp8_stays_near_the_bf16_curve(runs: dict[str, Any]) -> None:
    bf16 = runs["curve_bf16"]["losses"]
    assert runs["curve_fp8"]["fp8_layers"] and not runs["curve_bf16"]["fp8_layers"]

    def gaps(name: str) -> tuple[float, float]:
        losses = runs[f"curve_{name}"]["losses"]
        assert len(losses) == len(bf16) == CURVE_STEPS
        each = [abs(a - b) / b for a, b in zip(losses, bf16, strict=True)]
        return sum(each) / len(each), max(each)

    mean, worst = gaps("fp8")
    assert 0 < mean < MEAN_GAP and worst < MAX_GAP
    mean, worst = gaps("half_batch")  # the bound can fail
    assert mean > MEAN_GAP and worst > MAX_GAP


@pytest.mark.slow
def test_a_meta_built_model_starts_from_the_same_values(runs: dict[str, Any]) -> None:
    fp8, fp32 = runs["meta_fp8"], runs["meta_fp32"]
    assert fp8["fp8_layers"]
    assert fp8["init_state"].keys() == fp32["init_state"].keys()
    for name, value in fp32["init_state"].items():
        assert torch.equal(fp8["init_state"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume_zero3", "resume_zero1"])
def test_a_resumed_run_continues_the_uninterrupted_one(runs: dict[str, Any], name: str) -> None:
    got, whole = runs[name], runs["zero3"]
    assert got["resumed_from"] == "step=2.ckpt" and got["fp8_layers"] == whole["fp8_layers"]
    assert got["losses"] == whole["losses"][2:]
    params_close(got["params"], whole["params"], rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_hardware_fp8_on_cpu_is_refused_before_training(runs: dict[str, Any]) -> None:
    got = runs["on_cpu"]
    assert got["error"] and "fp8='emulate'" in got["error"] and not got["losses"]
