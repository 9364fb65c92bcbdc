"""Run `tests/_worker.py` jobs in 1 process or under torchrun, with a hard timeout (no test may hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

WORKER = Path(__file__).with_name("_worker.py")
ROOT = Path(__file__).resolve().parents[1]


# What a launcher (torchrun, Lightning, SLURM) sets to place a process in a job. An in-process Lightning fit writes
# MASTER_PORT and friends into this process's environment; a child that inherited them would believe it was already
# placed (Lightning then starts no second process and rank 0 waits for it) or bind a port this process holds.
LAUNCHER_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")  # fmt: skip
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "PL_")


def launcher_keys(env: dict[str, str]) -> list[str]:
    """The keys of ``env`` a launcher sets (`LAUNCHER_KEYS`, and those starting with `LAUNCHER_PREFIXES`)."""
    return [k for k in env if k in LAUNCHER_KEYS or k.startswith(LAUNCHER_PREFIXES)]


def worker_env() -> dict[str, str]:
    """This process's environment for a child started by a test, less anything a launcher set."""
    env = dict(os.environ)
    for key in launcher_keys(env):
        del env[key]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    # An in-process W&B run (tests/test_monitor.py) leaves its service's address here: a child would hand its
    # runs to that service instead of starting its own.
    env.pop("WANDB_SERVICE", None)
    return env


def run_session(
    cmd: list[str], *, timeout: float, env: Optional[dict[str, str]] = None, cwd: Optional[Path | str] = None
) -> subprocess.CompletedProcess:
    """`subprocess.run` with captured text output, in a session of its own: past ``timeout`` every process of it
    is killed (torchrun's or Lightning's ranks too, which would otherwise live on and load the machine for the
    tests after), and the test fails with the tail of what they printed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:4]} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
    proc = run_session(cmd, env=worker_env(), timeout=timeout, cwd=tmp)
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
    proc = run_session(cmd, env=worker_env(), timeout=280, cwd=tmp)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    got: dict[str, dict[str, Any]] = torch.load(out, weights_only=False)
    for model, r in got.items():
        assert r["loss"] < 1e-5, (model, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < 1e-5, (model, worst, r["grads"][worst])
    return got
