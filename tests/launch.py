"""Run `tests/_worker.py` jobs in 1 process or under torchrun, with a hard timeout (no test may hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    # An in-process W&B run (tests/test_monitor.py) leaves its service's address here: a child would hand its
    # runs to that service instead of starting its own.
    env.pop("WANDB_SERVICE", None)
    return env


def run_jobs(tmp: Path, jobs: list[dict[str, Any]], nproc: int = 1, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``nproc`` ranks and return rank 0's results; raise with the output on failure."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"result_{nproc}_{abs(hash(json.dumps(jobs, sort_keys=True)))}.pt"
    spec = tmp / (out.stem + ".json")
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), str(spec)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(spec)]  # fmt: skip
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def split_gradients(tmp: Path, models: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Run tests/_tp_heads_worker.py on 2 ranks (one forward and backward of each model, whole vs tp=2) and check
    that every model's loss and every gradient match the whole model's within 1e-5 relative.

    Returns:
        per model: ``loss`` and ``grads`` (relative errors), ``layouts`` (each parameter's placements).
    """
    out = tmp / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).parent / "_tp_heads_worker.py"), str(out), *models]  # fmt: skip
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=280, cwd=tmp)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    got: dict[str, dict[str, Any]] = torch.load(out, weights_only=False)
    for model, r in got.items():
        assert r["loss"] < 1e-5, (model, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < 1e-5, (model, worst, r["grads"][worst])
    return got
