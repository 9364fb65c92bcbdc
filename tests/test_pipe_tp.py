"""Pipeline x tensor parallelism (`pipe_tp` on 4 ranks, `3d` = `pipe_tp_zero1` on 8) against one process.

Each pipeline stage shards its own blocks over tp (the plan is inferred on the whole model before the cut);
sequence parallelism stays on inside stages (wherever exact, as without a pipeline): the stages hand on each tp
rank's sequence shard; with ``sequence_parallel=False``, the whole hidden state. Tolerances as in test_zero.py /
test_tensor_parallel.py: losses 1e-5 relative, parameters after SGD rtol 1e-5 / atol 1e-7, after AdamW atol 2% of lr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import rel

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

LR = 3e-3
MODELS = ["gpt4", "llama4", "gpt4_sgd"]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    jobs = [{"model": m} for m in MODELS] + [{"model": "gpt_sgd", "seq_len": 17}]
    results = run_jobs(tmp_path_factory.mktemp("pptp_ref"), jobs, nproc=1)
    return dict(zip([*MODELS, "odd"], results, strict=True))


@pytest.fixture(scope="module")
def pipe_tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("pipe_tp")
    ckpt = str(tmp / "ckpts")
    jobs = [{"model": m, "strategy": "pipe_tp", "dp": 1} for m in MODELS]
    jobs += [
        {"model": "gpt4", "strategy": {"pp": 2, "tp": 2, "pp_schedule": "interleaved_1f1b"}, "dp": 1},
        {"model": "gpt4_sgd", "strategy": {"pp": 2, "tp": 2, "sequence_parallel": False}, "dp": 1},
        # 17 tokens: the stream padded to 18 on the first stage, cut back by every stage's regions.
        {"model": "gpt_sgd", "strategy": {"pp": 2, "tp": 2}, "dp": 1, "seq_len": 17},
        # A checkpoint written under pipe_tp resumes under tp_zero3 (tp 2 x dp 2): same loss curve.
        {"model": "gpt4", "strategy": "pipe_tp", "dp": 1, "epoch_steps": 1, "max_steps": 4, "ckpt_dir": ckpt},
        {"model": "gpt4", "strategy": "tp_zero3", "dp": 2, "epoch_steps": 1, "max_steps": 4,
         "resume": f"{ckpt}/epoch=1.ckpt"},
    ]  # fmt: skip
    results = run_jobs(tmp, jobs, nproc=4, timeout=600)
    out = dict(zip(MODELS, results[: len(MODELS)], strict=True))
    out["interleaved"], out["no_sp"], out["odd"], out["ckpt_full"], out["ckpt_resumed"] = results[len(MODELS) :]
    return out


@pytest.fixture(scope="module")
def three_d(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    jobs = [{"model": m, "strategy": "3d", "dp": 2} for m in ("gpt4_sgd", "llama4")]
    jobs.append({"model": "gpt4_sgd", "strategy": "pipe_tp_zero2", "dp": 2})
    results = run_jobs(tmp_path_factory.mktemp("3d"), jobs, nproc=8, timeout=900)
    return dict(zip(("gpt4_sgd", "llama4", "pipe_tp_zero2"), results, strict=True))


def _check(got: dict, ref: dict, model: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert got["params"].keys() == ref["params"].keys()  # every rank's stage, gathered under the original names
    rtol, atol = (1e-5, 1e-7) if model.endswith("sgd") else (1e-5, 0.02 * LR)
    for k in ref["params"]:
        torch.testing.assert_close(got["params"][k], ref["params"][k], rtol=rtol, atol=atol, msg=lambda m, k=k: k + m)


@pytest.mark.parametrize("model", MODELS)
def test_pipe_tp_matches_one_process(pipe_tp, references, model):
    got = pipe_tp[model]
    assert (got["layout"]["pp"], got["layout"]["tp"], got["layout"]["dp_shard"]) == (2, 2, 1)
    assert got["layout"]["sequence_parallel"] in (None, False)
    _check(got, references[model], model)


def test_interleaved_schedule_with_tp(pipe_tp, references):
    _check(pipe_tp["interleaved"], references["gpt4"], "gpt4")


def test_sequence_parallel_stays_on_inside_stages_and_the_stages_hand_on_shards(pipe_tp, references):
    def sp(got: dict) -> bool:
        (line,) = [x for x in got["startup"] if x.startswith("tensor parallel tp=2")]
        return "(norm, on the sequence shard)" in line

    assert sp(pipe_tp["gpt4_sgd"]) and pipe_tp["gpt4_sgd"]["pipe_wire"] == (2, 16, 32)
    assert not sp(pipe_tp["no_sp"]) and pipe_tp["no_sp"]["pipe_wire"] == (2, 32, 32)
    _check(pipe_tp["no_sp"], references["gpt4_sgd"], "gpt4_sgd")
    # A length tp does not divide: padded on the stream (shards of 9), exact.
    assert sp(pipe_tp["odd"]) and pipe_tp["odd"]["pipe_wire"] == (2, 16, 32)
    _check(pipe_tp["odd"], references["odd"], "gpt_sgd")


def test_pipe_tp_checkpoint_resumes_under_tp_zero3(pipe_tp):
    full, resumed = pipe_tp["ckpt_full"], pipe_tp["ckpt_resumed"]
    assert resumed["layout"]["pp"] == 1 and resumed["layout"]["zero_stage"] == 3
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    for k in full["params"]:
        torch.testing.assert_close(resumed["params"][k], full["params"][k], rtol=1e-5, atol=0.02 * LR)


@pytest.mark.parametrize("model", ["gpt4_sgd", "llama4"])
def test_3d_on_eight_ranks_matches_one_process(three_d, references, model):
    got = three_d[model]
    layout = got["layout"]
    assert (layout["pp"], layout["tp"], layout["dp_shard"], layout["zero_stage"]) == (2, 2, 2, 1)
    _check(got, references[model], model)


def test_pipe_tp_zero2_on_eight_ranks_matches_one_process(three_d, references):
    got = three_d["pipe_tp_zero2"]
    assert (got["layout"]["pp"], got["layout"]["tp"], got["layout"]["dp_shard"], got["layout"]["zero_stage"]) == (
        2, 2, 2, 2,
    )  # fmt: skip
    _check(got, references["gpt4_sgd"], "gpt4_sgd")
