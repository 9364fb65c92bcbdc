"""Context parallelism under pipelines (`pipe_cp` on 4 ranks, `pipe_tp_cp_zero1` on 8) against one process.

Each stage cuts the sequence to this rank's chunks at its first block (side inputs, rotary tables and masks, are
recomputed whole on every stage and cut there too), stages exchange the chunks, and the last stage gathers after
the trunk's last block, before the head and the loss (docs/context_parallel.md, "Under a pipeline"). Two spawns:
4 ranks (pp 2 x cp 2: 1f1b on GPT + SGD, interleaved 1f1b with full activation checkpointing on GPT + AdamW,
`pipe_cp_zero3`, and Ulysses attention on Hugging Face's Llama), 8 ranks (pp 2 x tp 2 x cp 2 with ZeRO-1 on GPT +
SGD and Hugging Face's Llama on its SDPA path).
Tolerances as everywhere (docs/testing.md): fp32 losses 1e-5 relative, SGD parameters 1e-5 relative / 1e-7
absolute, AdamW ones 1% of the learning rate absolute.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.config import ParallelConfig
from lightning_par.names import strategy_kwargs

LR = 3e-3  # the AdamW models' learning rate (tests/_job_models.py)

JOBS_4: dict[str, dict[str, Any]] = {
    "gpt4_sgd_pipe_cp": {"model": "gpt4_sgd", "strategy": "pipe_cp", "dp": 1},
    "gpt4_pipe_cp_interleaved_ac": {
        "model": "gpt4", "strategy": {"pp": 2, "cp": 2, "pp_schedule": "interleaved_1f1b",
                                      "activation_checkpointing": "full"}, "dp": 1,
    },
    "gpt4_sgd_pipe_cp_zero3": {"model": "gpt4_sgd", "seq_len": 24, "strategy": "pipe_cp_zero3", "dp": 1},
    # Ulysses attention inside the stages, Hugging Face's grouped K/V at an uneven length.
    "hf_llama_sdpa_pipe_cp_ulysses": {
        "model": "hf_llama_sdpa", "seq_len": 30,
        "strategy": {"pp": 2, "cp": 2, "cp_mode": "ulysses", "cp_uneven": True}, "dp": 1,
    },
}  # fmt: skip
JOBS_8: dict[str, dict[str, Any]] = {
    "gpt4_sgd_pipe_tp_cp_zero1": {"model": "gpt4_sgd", "strategy": "pipe_tp_cp_zero1", "dp": 1},
    "hf_llama_sdpa_pipe_tp_cp_zero1": {"model": "hf_llama_sdpa", "strategy": "pipe_tp_cp_zero1", "dp": 1},
}
ALL = {**JOBS_4, **JOBS_8}
LAYOUT = {"gpt4_sgd_pipe_cp": (2, 1, 2), "gpt4_sgd_pipe_tp_cp_zero1": (2, 2, 2)}  # (pp, tp, cp)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cp_pipe")
    jobs = {k: {**j, "steps": 3} for k, j in ALL.items()}
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k != "dp"}) for j in jobs.values()], nproc=1)
    got = run_jobs(tmp, [jobs[k] for k in JOBS_4], nproc=4, timeout=500)
    got += run_jobs(tmp, [jobs[k] for k in JOBS_8], nproc=8, timeout=700)
    return dict(zip(ALL, zip(got, refs, strict=True), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_cp_under_pipeline_matches_one_process(results, name):
    got, ref = results[name]
    if name in LAYOUT:
        assert (got["layout"]["pp"], got["layout"]["tp"], got["layout"]["cp"]) == LAYOUT[name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert got["params"].keys() == ref["params"].keys()  # every stage's, gathered under the original names
    atol = 1e-7 if ALL[name]["model"].endswith("_sgd") else 0.01 * LR
    params_close(got["params"], ref["params"], rtol=1e-5, atol=atol)


def test_cp_names_with_pipe_resolve():
    assert strategy_kwargs("pipe_tp_cp_zero1")["auto_dims"] == ("pp", "tp", "cp", "dp")
    resolved = ParallelConfig(**strategy_kwargs("pipe_tp_cp_zero1")).resolve(8)
    assert (resolved.pp, resolved.tp, resolved.cp, resolved.dp_shard) == (2, 2, 2, 1)
