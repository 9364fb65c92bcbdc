"""Pipeline parallelism on model code we did not write, on tied weights and on pp 3 / pp 4, against one process.

Families (tests/_families.py, plain user LightningModules): litgpt's GPT (Pythia and Llama configs; litgpt registers
``lm_head`` before the embedding, so ownership must come from execution order), Hugging Face GPT-2 (Conv1D, head tied to
the embedding), Qwen2 with ``tie_word_embeddings=True`` and ViT (whose forward reads attributes of the embedding on
every stage), Swin and a user's pyramid (blocks change the hidden state's length and width). Tied weights: a copy on
each end stage, gradients summed over the two (pp 2, pp 2 x dp 2 under ZeRO-1 / ZeRO-2 / ZeRO-3, pp 2 x tp 2, nanoGPT
under pp 2 x tp 2), or one
shared parameter where one rank runs both ends (zbv, dualpipev); the gradient norm counts the weight once (accumulation
+ clipping at 0.05 with norms > 0.5). pp 3 splits 4 blocks unevenly.

Tolerances as in tests/test_pipeline.py: fp32 losses and gradient norms 1e-5 relative, SGD parameters 1e-5 relative /
1e-7 absolute, AdamW parameters 1% of lr. Every model here trains with SGD + momentum except ``llama4`` (AdamW). Three
spawns (2, 3 and 4 ranks) and one reference process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# 2 ranks, pp 2.
JOBS_2: dict[str, dict[str, Any]] = {
    "litgpt_pythia": {"model": "litgpt_pythia", "strategy": {"pp": 2}, "validate": True},
    "litgpt_llama": {"model": "litgpt_llama", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"}},
    "hf_vit": {"model": "hf_vit", "strategy": {"pp": 2}, "validate": True},
    "hf_gpt2_tied": {"model": "hf_gpt2", "strategy": {"pp": 2}, "validate": True},
    "gpt_tied_accum_clip": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2}, "accumulate": 2, "clip": 0.05},
    # zbv: rank 0 runs stage 0 and the last stage, so the tied weight is one parameter there.
    "qwen2_tied_zbv": {"model": "hf_qwen2_tied", "strategy": {"pp": 2, "pp_schedule": "zbv"}},
    # Each attention moves the rotary table to its device (a no-op `.to()`): once read as a value of block 0.
    "llama4_text": {"model": "zoo:llama4_text", "strategy": {"pp": 2}},
    "gpt_tied_dualpipev": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2, "pp_schedule": "dualpipev"}},
    # Skip connections inside groups of three blocks (tests/_job_models.py's SkipLM): the split keeps to the one cut
    # they do not cross, before block 3, whatever balances best.
    "skip_groups": {"model": "skip_groups", "strategy": {"pp": 2}},
    # Blocks that return a permuted (non-contiguous) view, as ConvNeXt's do: what a stage sends is made dense.
    "permuted_views": {"model": "permuted_views", "strategy": {"pp": 2}},
    "hf_convnext": {"model": "hf_convnext", "strategy": {"pp": 2}},
    # torch's nn.TransformerEncoder: its forward reads the first layer's attributes on every stage.
    "torch_encoder": {"model": "torch_encoder", "strategy": {"pp": 2}},
    # Hierarchical: blocks change the length and width and return more than the hidden state, which the loop
    # unpacks on every stage (Swin's stages; a user's pyramid, 4 stages on 2 ranks: a shape at every boundary).
    "hf_swin": {"model": "hf_swin", "strategy": {"pp": 2}, "validate": True},
    "pyramid_interleaved": {"model": "pyramid_lm", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"},
                            "validate": True},
    # T5: the trunk is the decoder; the encoder's output, which every decoder block reads, travels with the hidden
    # state to every stage, and so does the position bias the boundary's last block returns. Interleaved: rank 0
    # runs stages 0 and 2, and takes the received encoder output in stage 2, not its own encoder's.
    "hf_t5": {"model": "hf_t5", "strategy": {"pp": 2}, "validate": True},
    "hf_t5_interleaved": {"model": "hf_t5_4", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"},
                          "validate": True},
    # BART: the encoder's output (after its final layer norm, a first-stage module) read by every decoder layer.
    "hf_bart": {"model": "hf_bart", "strategy": {"pp": 2}},
    # Learned scalars directly on the model that holds the blocks (modded-nanoGPT's): every stage holds them, their
    # gradients summed over the pipeline; a zero-bubble schedule's weight pass computes theirs too.
    "scalars_lm": {"model": "scalars_lm", "strategy": {"pp": 2}},
    "scalars_lm_zbv": {"model": "scalars_lm", "strategy": {"pp": 2, "pp_schedule": "zbv"}},
    # A user's model whose first block makes a relative-position bias it returns to the loop for the later blocks.
    "user_rel_bias": {"model": "user_rel_bias", "strategy": {"pp": 2}},
}

# 3 ranks, pp 3: 4 blocks split unevenly.
JOBS_3: dict[str, dict[str, Any]] = {
    "gpt_pp3": {"model": "gpt4_sgd", "strategy": {"pp": 3, "microbatches": 4}},
    "litgpt_pythia_pp3": {"model": "litgpt_pythia", "strategy": {"pp": 3, "microbatches": 4}},
    "qwen2_tied_pp3": {"model": "hf_qwen2_tied", "strategy": {"pp": 3, "microbatches": 4}, "validate": True},
}

# 4 ranks: pp 4 (dp 1), pp 2 x dp 2 with ZeRO on tied models, and pp 2 x tp 2 on a tied model.
JOBS_4: dict[str, dict[str, Any]] = {
    "llama_pp4": {"model": "llama4", "strategy": {"pp": 4}, "dp": 1},
    "litgpt_llama_pp4": {"model": "litgpt_llama", "strategy": {"pp": 4}, "dp": 1},
    "hf_gpt2_tied_pp4": {"model": "hf_gpt2", "strategy": {"pp": 4}, "dp": 1},
    "gpt_tied_zero1": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2, "zero_stage": 1}, "dp": 2},
    "gpt_tied_zero3_accum_clip": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2, "zero_stage": 3}, "dp": 2,
                                  "accumulate": 2, "clip": 0.05},
    "gpt_tied_pipe_tp": {"model": "gpt4_tied_sgd", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    # nanoGPT (tied head): its attention runs on the gathered outputs of its split projections in each stage.
    "nano_gpt_pipe_tp": {"model": "nano_gpt", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    "qwen2_tied_zero2_accum_clip": {"model": "hf_qwen2_tied", "strategy": {"pp": 2, "zero_stage": 2}, "dp": 2,
                                    "accumulate": 2, "clip": 0.05},
    "scalars_lm_zero1": {"model": "scalars_lm", "strategy": {"pp": 2, "zero_stage": 1}, "dp": 2},
    # The encoder's output carried through the two middle stages, which read it and hand it on.
    "hf_t5_pp4": {"model": "hf_t5_4", "strategy": {"pp": 4}, "dp": 1},
    # Under tp each rank's bias holds its heads (the decoder's bias table split with them): what crosses the cut.
    "hf_t5_pipe_tp": {"model": "hf_t5_4", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    # Under ZeRO-3: the encoder in the first stage's FSDP2 root, the carried tensors with their gradients.
    "hf_t5_pipe_zero3": {"model": "hf_t5_4", "strategy": {"pp": 2, "zero_stage": 3}, "dp": 2},
}  # fmt: skip

ALL = {**JOBS_2, **JOBS_3, **JOBS_4}
REFUSED = ("skip_unet", "pyramid_unprobed")
TIED = {"hf_gpt2", "gpt4_tied_sgd", "hf_qwen2_tied", "nano_gpt", "hf_t5", "hf_t5_4", "hf_bart"}


def _checkpoint_jobs(tmp: Path) -> list[dict[str, Any]]:
    # A tied model saved under pipe resumes under pipe and under zero1, and a zero1 checkpoint under pipe (one step
    # per epoch, resumed after step 2, as tests/test_pipeline.py's checkpoint runs).
    pipe, zero1 = str(tmp / "tied_pipe"), str(tmp / "tied_zero1")
    base = {"model": "gpt4_tied_sgd", "epoch_steps": 1, "max_steps": 4}
    return [
        {**base, "strategy": "pipe", "dp": 1, "ckpt_dir": pipe},  # uninterrupted, saving each epoch
        {**base, "strategy": "pipe", "dp": 1, "resume": f"{pipe}/epoch=1.ckpt"},
        {**base, "strategy": "zero1", "dp": 2, "resume": f"{pipe}/epoch=1.ckpt"},
        {**base, "strategy": "zero1", "dp": 2, "ckpt_dir": zero1},
        {**base, "strategy": "pipe", "dp": 1, "resume": f"{zero1}/epoch=1.ckpt"},
    ]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory: pytest.TempPathFactory) -> Spawns:
    tmp = tmp_path_factory.mktemp("pipeline_families")
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k not in ("strategy", "dp")})
                          for j in ALL.values()], nproc=1, timeout=900)  # fmt: skip
    # Last on 2 ranks, refused before the first step: a U-Net's skip connections cross every cut; a pyramid the
    # ownership probe could not run (8 tokens are too few for its merges), whose stages then fail in the pre-flight.
    # (Blocks that run more than once, Dory's and ALBERT's, train: tests/test_pipeline_calls.py.)
    refused = [{"model": m, "strategy": {"pp": 2}, "dp": 1, "steps": 1, "expect_error": True} for m in REFUSED]
    got = run_jobs(tmp, [{**j, "dp": 1} for j in JOBS_2.values()] + _checkpoint_jobs(tmp) + refused, nproc=2,
                   timeout=900)  # fmt: skip
    n = len(JOBS_2)
    got, checkpoints, unet = got[:n], got[n : -len(REFUSED)], dict(zip(REFUSED, got[-len(REFUSED) :], strict=True))
    got += run_jobs(tmp, [{**j, "dp": 1} for j in JOBS_3.values()], nproc=3, timeout=900)
    got += run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=900)
    return dict(zip(ALL, zip(got, refs, strict=True), strict=True)), checkpoints, unet


Spawns = tuple[dict[str, tuple[dict, dict]], list[dict[str, Any]], dict[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def results(spawns: Spawns) -> dict[str, tuple[dict, dict]]:
    return spawns[0]


def _merge_tied(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The pipeline's parameters with each tied weight once, under the one-process name: the copies must agree
    bit for bit (same summed gradient, same update)."""
    params = dict(got["params"])
    for names in got.get("tied", []):
        canonical = next(n for n in names if n in ref["params"])
        held = [n for n in names if n in params]
        assert canonical in params and len(held) >= 1
        for alias in held:
            assert torch.equal(params[alias], params[canonical]), alias
            if alias != canonical:
                del params[alias]
    return params


@pytest.mark.parametrize("name", list(ALL))
def test_matches_one_process(results, name):
    got, ref = results[name]
    job = ALL[name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5  # tied weights counted once
    assert bool(got["tied"]) == (job["model"] in TIED)
    params = _merge_tied(got, ref)
    params_close(params, ref["params"], rtol=1e-5, atol=1e-7 if job["model"] != "llama4" else 3e-5)
    if "clip" in job:
        assert min(ref["grad_norms"]) > 0.5  # clipping at 0.05 is active
    if job.get("validate"):
        assert got["val"]["val_loss"] == pytest.approx(ref["val"]["val_loss"], rel=1e-5)


def test_tied_copies_live_on_both_end_stages_only(results):
    got, ref = results["hf_gpt2_tied_pp4"]
    # Four ranks, one stage each: the embedding on rank 0, the head (the second copy) on rank 3, neither between.
    counts = got["param_counts_all"]
    assert len(counts) == 4 and all(c > 0 for c in counts)
    (names,) = got["tied"]
    assert names == ("model.transformer.wte.weight", "model.lm_head.weight")
    assert set(names) <= got["params"].keys()
    per_rank = [m["params"] for m in got["mem_all"]]
    vocab_rows = 256 * 32 * 4
    total = sum(t.numel() * 4 for t in ref["params"].values())
    assert sum(per_rank) == total + vocab_rows  # exactly one extra copy of the tied matrix


def test_skip_connections_keep_to_the_cut_they_do_not_cross_or_are_refused(results, spawns):
    got, _ = results["skip_groups"]
    # Block costs alone would cut before block 4 (the head costs about two blocks); the skips allow block 3 only:
    # rank 0 holds the embedding's tensor and three blocks'.
    per_block = len(list(_worker_model("skip_groups").blocks[0].parameters()))
    assert got["param_counts_all"] == [1 + 3 * per_block, 3 * per_block + 2]
    unet = spawns[2]["skip_unet"]
    assert unet["losses"] == [] and unet["error"] is not None  # refused before the first step
    assert (
        "cannot cut the trunk before blocks.1: the code between blocks.4 and blocks.5 reads, in add(), a value "
        "blocks.0 computed" in unet["error"]
    )
    assert "No cut of this trunk keeps the values: train without pipeline parallelism" in unet["error"]


def _worker_model(name: str) -> Any:
    from _job_models import MODELS

    return MODELS[name]()


def test_tied_checkpoints_resume_across_pipeline_and_data_parallel_layouts(spawns):
    full, resumed, as_zero1, zero1_full, zero1_as_pipe = spawns[1]
    assert full["tied"] and len(full["losses"]) == 4 and len(resumed["losses"]) == len(as_zero1["losses"]) == 2
    for run, ref in ((resumed, full), (as_zero1, full), (zero1_as_pipe, zero1_full)):
        assert rel(run["losses"], ref["losses"][2:]) < 1e-5
        ref_params = _merge_tied(ref, {"params": zero1_full["params"]})  # one-process names, each tied weight once
        params_close(_merge_tied(run, {"params": ref_params}), ref_params, rtol=1e-5, atol=1e-7)


def test_a_stage_that_fails_on_the_shapes_it_receives_is_refused_before_the_first_step(spawns):
    # Without an example_input_array the probe cannot run this pyramid (8 tokens, 4 merges), so nothing told the
    # pipeline that its blocks change the shape: stage 1 receives the trunk's input shape. Its pre-flight fails on
    # every rank alike, before any step, naming the stage, the error and the fix; it no longer crashes mid-step.
    got = spawns[2]["pyramid_unprobed"]
    assert got["losses"] == [] and got["error"] is not None
    assert "the pipeline's pre-flight (each stage once on the shapes it receives) failed: stage 1 (" in got["error"]
    assert "RuntimeError: Given normalized_shape=[16]" in got["error"]
    assert "give the LightningModule an example_input_array of a real input" in got["error"]


def test_the_encoder_is_split_on_the_first_stage_under_pipe_tp(results):
    # T5's encoder (another stack of blocks, first-stage modules) is split over tp on the ranks of stage 0: each
    # rank holds the bytes the planner predicts from the suite's own introspection (both stacks, the bias tables).
    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import state_bytes

    got, _ = results["hf_t5_pipe_tp"]
    specs = specs_from_module(_worker_model("hf_t5_4"))
    want = [state_bytes(specs, Layout(pp=2, tp=2, precision="32-true"), rank=r).parameters for r in range(4)]
    assert [m["params"] for m in got["mem_all"]] == want
    assert any(s.tp_dim is not None for s in specs if s.name.startswith("model.encoder.block."))  # priced split


def test_scalars_on_the_model_resume_across_layouts_and_zero3_is_refused(tmp_path):
    # Held by every stage under one name, written once (DCP keeps one copy); a pipeline checkpoint resumes under
    # pipe and under zero1. ZeRO-3 would shard them in one stage's unit: refused before training, naming zero 1/2.
    ckpt = str(tmp_path / "scalars")
    base = {"model": "scalars_lm", "epoch_steps": 1, "max_steps": 4}
    full, as_pipe, as_zero1, zero3 = run_jobs(tmp_path, [
        {**base, "strategy": "pipe", "dp": 1, "ckpt_dir": ckpt},
        {**base, "strategy": "pipe", "dp": 1, "resume": f"{ckpt}/epoch=1.ckpt"},
        {**base, "strategy": "zero1", "dp": 2, "resume": f"{ckpt}/epoch=1.ckpt"},
        {"model": "scalars_lm", "strategy": {"pp": 2, "zero_stage": 3}, "dp": 1, "steps": 1, "expect_error": True},
    ], nproc=2, timeout=900)  # fmt: skip
    for resumed in (as_pipe, as_zero1):
        assert len(resumed["losses"]) == 2 and rel(resumed["losses"], full["losses"][2:]) < 1e-5
        params_close(resumed["params"], full["params"], rtol=1e-5, atol=1e-7)
    assert zero3["losses"] == [] and "scale, lambdas, out_scale sit on a module that contains the trunk" in (
        zero3["error"]
    )
    assert "strategy='pipe_zero1'" in zero3["error"]
