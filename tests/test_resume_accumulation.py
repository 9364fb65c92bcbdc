"""A resumed run with gradient accumulation does not save again before its first optimizer step.

Lightning's `ModelCheckpoint` does not restore which step it saved last, so after a resume the first batch end
saved at once: mid-accumulation (its gradients not in the file), under the loaded checkpoint's own name, replacing
it. Resumed later, such a file trains a step on part of its batch; on another data-parallel size it was refused
(`tests/test_elastic_agent.py` failed so when a node came back). The strategy marks the loaded step saved
(`strategies/_checkpointing.py`). Checked under ``zero2`` (dp 2, accumulation 2, a checkpoint after every step): the
checkpoint resumed from comes out unchanged, every checkpoint sits at a step's end, and the resumed run's losses are
the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = {"model": "gpt_sgd", "strategy": "zero2", "dp": 2, "accumulate": 2, "ckpt_every_n_steps": 1, "steps": 4}


def _progress(ckpt: Path) -> dict[str, Any]:
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    return dict(meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("resume_accumulation")
    first = tmp / "first"
    full, _ = run_jobs(tmp, [{**BASE, "ckpt_dir": str(tmp / "full")},
                             {**BASE, "max_steps": 1, "ckpt_dir": str(first)}], nproc=2, timeout=300)  # fmt: skip
    before = _progress(first / "step=1.ckpt")
    (got,) = run_jobs(tmp, [{**BASE, "ckpt_dir": str(first), "resume": str(first / "step=1.ckpt")}], nproc=2,
                      timeout=300)  # fmt: skip
    return {"full": full, "got": got, "before": before, "first": first}


def test_the_checkpoint_resumed_from_is_not_replaced(runs: dict[str, Any]) -> None:
    assert runs["before"]["ready"] == 2  # one step of two micro-batches
    assert _progress(runs["first"] / "step=1.ckpt") == runs["before"]


def test_every_checkpoint_of_the_resumed_run_sits_at_a_step_end(runs: dict[str, Any]) -> None:
    # No other file: Lightning names a second save of step 1 "step=1-v1.ckpt" (this job's ModelCheckpoint monitors
    # the step) or writes over "step=1.ckpt" (one that monitors nothing: tests/_elastic_train.py).
    assert sorted(p.name for p in runs["first"].iterdir()) == [f"step={s}.ckpt" for s in (1, 2, 3, 4)]
    for step in (2, 3, 4):
        meta = torch.load(runs["first"] / f"step={step}.ckpt" / "meta.pt", weights_only=True)
        assert meta["global_step"] == step and _progress(runs["first"] / f"step={step}.ckpt")["ready"] == 2 * step


def test_the_resumed_run_follows_the_uninterrupted_one(runs: dict[str, Any]) -> None:
    # One logged loss per micro-batch: 3 steps of 2 after the resume, the uninterrupted run's last 6 of 8.
    assert len(runs["got"]["losses"]) == 6 and len(runs["full"]["losses"]) == 8
    assert rel(runs["got"]["losses"], runs["full"]["losses"][2:]) < 1e-5
