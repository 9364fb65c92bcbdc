"""Run `tests/_worker.py` jobs on ranks forked from the test forkserver (tests/forked.py) or one process, and other
commands in sessions of their own, each with a hard timeout within its test's (no test may hang, nothing outlives
its test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from forked import Launched, launch
from jobs import check

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


# The current test's deadline (monotonic seconds), set by conftest from its pytest-timeout: a launch ends, with the
# ranks' output, before pytest-timeout would interrupt it.
_DEADLINE: Optional[float] = None


def set_deadline(deadline: Optional[float]) -> None:
    """The monotonic time by which the running test must end (``None``: no limit)."""
    global _DEADLINE
    _DEADLINE = deadline


def capped(timeout: float, margin: float = 15.0) -> float:
    """``timeout``, cut to what the current test has left less ``margin`` seconds (at least 1 s)."""
    if _DEADLINE is None:
        return timeout
    return max(1.0, min(timeout, _DEADLINE - time.monotonic() - margin))


def run_session(
    cmd: list[str], *, timeout: float, env: Optional[dict[str, str]] = None, cwd: Optional[Path | str] = None
) -> subprocess.CompletedProcess:
    """`subprocess.run` with captured text output, in a session of its own: when it ends for any reason (its
    ``timeout``, cut to the test's own, or the test interrupted) every process of it is killed (torchrun's or
    Lightning's ranks too, which would otherwise live on and load the machine for the tests after), and past the
    timeout the test fails with the tail of what they printed."""
    timeout = capped(timeout)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:4]} ran past {timeout:.0f} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        kill_session(proc)  # what the launcher left behind, and everything when the test was interrupted
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session=True``), if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_jobs(tmp: Path, jobs: list[dict[str, Any]], nproc: int = 1, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``nproc`` ranks forked from the test forkserver (tests/forked.py; a torchrun-style job) and
    return rank 0's results; raise with the ranks' output on failure. One-process jobs that an earlier test of the
    session ran with the same description are not run again (`references.cached`). A job key that is no `jobs.Job`
    field fails here, before any rank starts."""
    from references import cached

    check(jobs)
    tmp.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        return cached(jobs, lambda todo: _run_jobs(tmp, todo, 1, timeout))
    return _run_jobs(tmp, jobs, nproc, timeout)


_NATIVE_CRASH = (-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS)


def _launch(target: str, argv: list[str], nproc: int, *, env: dict[str, str], cwd: Path, timeout: float) -> Launched:
    """`forked.launch`, run once more when a rank died of a native crash.

    A rank killed by glibc's heap check (``malloc(): unaligned tcache chunk detected``, SIGABRT) was seen in about
    one clean-clone run in five, in different spawns, and never reproduced alone (docs/testing.md, "A native crash
    in a forked rank"). Such a job runs once more, and pytest's summary says so with the crashed rank's output; a
    second crash fails the test, and any other failure is reported at once.
    """
    done = launch(target, argv, nproc, env=env, cwd=cwd, timeout=timeout)
    if done.returncode in _NATIVE_CRASH and not done.timed_out:
        warnings.warn(f"a forked rank crashed ({done.returncode}); the job runs again:\n{done.stdout[-3000:]}",
                      stacklevel=3)  # fmt: skip
        done = launch(target, argv, nproc, env=env, cwd=cwd, timeout=timeout)
    return done


def _run_jobs(tmp: Path, jobs: list[dict[str, Any]], nproc: int, timeout: float) -> list[dict[str, Any]]:
    out = tmp / f"result_{nproc}_{abs(hash(json.dumps(jobs, sort_keys=True)))}.pt"
    spec = tmp / (out.stem + ".json")
    write_spec(spec, out, jobs)
    done = _launch("_worker:main", [str(spec)], nproc, env=worker_env(), cwd=tmp, timeout=capped(timeout))
    if done.returncode != 0 or not out.exists():
        why = f"ran past {capped(timeout):.0f} s" if done.timed_out else f"failed ({done.returncode})"
        raise AssertionError(f"worker {why}:\n{done.stdout[-10000:]}")
    return torch.load(out, weights_only=False)


def write_spec(spec: Path, out: Path, jobs: list[dict[str, Any]]) -> None:
    """Write the file tests/_worker.py reads: where rank 0 saves the results, and ``jobs``, each checked first (a key
    that is no `jobs.Job` field fails here)."""
    check(jobs)
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))


def run_forked(script: Path, argv: list[str], nproc: int, *, cwd: Path, timeout: float,
               env: Optional[dict[str, str]] = None) -> Launched:  # fmt: skip
    """Run a test script's ``__main__`` as ``nproc`` forked torchrun-style ranks (tests/forked.py)."""
    return _launch(str(script), argv, nproc, env=env or worker_env(), cwd=cwd, timeout=capped(timeout))


def split_gradients(tmp: Path, models: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Run tests/_tp_heads_worker.py on 2 ranks (one forward and backward of each model, whole vs tp=2) and check
    that every model's loss and every gradient match the whole model's within 1e-5 relative.

    Returns:
        per model: ``loss`` and ``grads`` (relative errors), ``layouts`` (each parameter's placements).
    """
    out = tmp / "grads.pt"
    proc = run_forked(Path(__file__).parent / "_tp_heads_worker.py", [str(out), *models], 2, cwd=tmp, timeout=280)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-6000:]
    got: dict[str, dict[str, Any]] = torch.load(out, weights_only=False)
    for model, r in got.items():
        assert r["loss"] < 1e-5, (model, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < 1e-5, (model, worst, r["grads"][worst])
    return got
