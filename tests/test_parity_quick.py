"""One parity check per parallel dimension, for the quick tier (``pytest -m "not slow"``, docs/testing.md).

One 2-rank spawn (forked ranks, tests/forked.py) trains the reference models for 3 steps under ``ddp`` (ZeRO-0),
``zero1``, ``zero2``, ``zero3``, ``tp``, ``pipe`` (4 microbatches), ``moe`` (ep 2, two experts per rank) and ``cp``,
and a ``zero2`` run that checkpoints after each one-step epoch and is resumed from its second; one process runs
the references. Each is held to the fp32 tolerances of the full tier (docs/testing.md): losses and gradient norms
1e-5 relative with equal lengths, SGD parameters 1e-5 relative / 1e-7 absolute, AdamW parameters 1% of lr. SGD
(linear in the gradient) is used wherever it can be, so a dropped reduction moves the parameters far past 1e-7.
tools/mutate.py checks that each representative bug fails a test of this tier; the slow tier repeats every
dimension in depth.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

pytestmark = pytest.mark.timeout(300)

LR = 3e-3  # the AdamW models' learning rate (tests/_job_models.py)

JOBS: dict[str, dict[str, Any]] = {
    "ddp": {"model": "gpt_sgd", "strategy": {"zero_stage": 0}},
    "zero1": {"model": "gpt_sgd", "strategy": "zero1"},
    "zero2": {"model": "gpt_sgd", "strategy": "zero2", "accumulate": 2},
    "zero3": {"model": "gpt_sgd", "strategy": "zero3"},
    "tp": {"model": "gpt_sgd", "strategy": "tp", "dp": 1},
    "pipe": {"model": "gpt4_sgd", "strategy": {"pp": 2, "microbatches": 4}, "dp": 1},
    "moe": {"model": "moe_gpt_sgd", "strategy": "moe"},
    "cp": {"model": "gpt_sgd", "strategy": {"cp": 2}, "dp": 1},
}
# AdamW (its state matters on resume): one-step epochs, a checkpoint after each, the second resumed.
CKPT = {"model": "gpt", "strategy": "zero2", "epoch_steps": 1, "max_steps": 4}


def _reference(job: dict[str, Any]) -> dict[str, Any]:
    return reference_job({k: v for k, v in job.items() if k not in ("strategy", "dp")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("quick")
    ckpt = [{**CKPT, "ckpt_dir": str(tmp / "ckpts")}, {**CKPT, "resume": str(tmp / "ckpts" / "epoch=1.ckpt")}]
    got = run_jobs(tmp, [*JOBS.values(), *ckpt], nproc=2, timeout=240)
    refs = run_jobs(tmp, [_reference(j) for j in JOBS.values()], nproc=1, timeout=120)
    return {"got": dict(zip(JOBS, got[: len(JOBS)], strict=True)), "ref": dict(zip(JOBS, refs, strict=True)),
            "ckpt": got[len(JOBS) :]}  # fmt: skip


@pytest.mark.parametrize("name", list(JOBS))
def test_each_dimension_trains_as_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs["got"][name], runs["ref"][name]
    layout, want = got["layout"], JOBS[name]
    assert layout["world_size"] == 2
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    if name != "ddp":  # the layout asked for is the one that trained
        dim = {"zero1": "dp_shard", "zero2": "dp_shard", "zero3": "dp_shard", "tp": "tp", "pipe": "pp", "moe": "ep",
               "cp": "cp"}[name]  # fmt: skip
        assert layout[dim] == 2, (name, layout)
    assert want.get("dp", 2) == layout.get("dp_shard", 1) * layout.get("dp_replicate", 1)


def test_a_resumed_run_continues_the_uninterrupted_one(runs: dict[str, Any]) -> None:
    full, resumed = runs["ckpt"]
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    # Same samples per step (one-step epochs); AdamW's moments come from the checkpoint, or the steps would differ.
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=0.01 * LR)
