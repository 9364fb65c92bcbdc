"""Shared fixtures: one-process references are computed once per session and reused by every parity test."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch loads OpenMP: before the forkserver imports torch
sys.path.insert(0, str(Path(__file__).parent))

from deepspeed_ops import extensions_folder, remove_stale_locks
from launch import run_jobs, set_deadline
from watchdog import Watchdog

# DeepSpeed JIT-builds its C++ ops on first use (cpu_adam ~125 CPU-s, shm_comm ~65 CPU-s): once per machine, in a
# cache outside the checkout (`.ci/run` builds them before the tests: tests/deepspeed_ops.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_folder()))

# The jobs every ZeRO stage is compared on. Reference runs use the same jobs on one process with strategy "auto".
PARITY_JOBS: dict[str, dict[str, Any]] = {
    "gpt": {"model": "gpt"},
    "llama": {"model": "llama"},
    "gpt_sgd": {"model": "gpt_sgd"},
    "gpt_accum_clip": {"model": "gpt", "accumulate": 2, "clip": 0.05, "validate": True, "test": True, "predict": True},
    "gpt_bf16_mixed": {"model": "gpt", "precision": "bf16-mixed"},
    "llama_bf16_mixed": {"model": "llama", "precision": "bf16-mixed"},
    "gpt_16_mixed": {"model": "gpt", "precision": "16-mixed"},
    "gpt_bf16_true": {"model": "gpt", "precision": "bf16-true"},
    "sgd_bf16_mixed": {"model": "gpt_sgd", "precision": "bf16-mixed"},
    "sgd_16_mixed": {"model": "gpt_sgd", "precision": "16-mixed"},
    "sgd_bf16_true": {"model": "gpt_sgd", "precision": "bf16-true"},
}


@pytest.fixture(autouse=True)
def _restore_environment() -> Any:
    """Put `os.environ` back after every test: an in-process Lightning fit leaves MASTER_PORT, LOCAL_RANK, ... there,
    and a later test's launch that inherited them hung (CI, 2026-12-03). `launch.worker_env` drops them too."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Any:
    """End the default process group a test started: an in-process fit (devices=1) leaves Lightning's, and a later
    test in the same worker that starts its own failed with "trying to initialize the default process group twice"
    (tests/test_moe_syncs.py after tests/test_released.py, CI 2026-12-04). A group a wider fixture started stays."""
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


LOW_PRECISION = ("bf16-mixed", "16-mixed", "bf16-true")


def reference_job(job: dict[str, Any]) -> dict[str, Any]:
    ref = {**job, "strategy": "auto"}
    if job.get("precision") in LOW_PRECISION:
        ref["record_init"] = True  # low-precision checks measure how much of the training a run got wrong (parity.py)
    if job.get("precision") == "16-mixed":
        # Lightning turns 16-mixed into bf16 on CPU; its own fp16 AMP plugin with a CPU GradScaler is the reference.
        ref["lightning_fp16_reference"] = True
    return ref


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("reference")
    results = run_jobs(tmp, [reference_job(j) for j in PARITY_JOBS.values()], nproc=1)
    return dict(zip(PARITY_JOBS, results, strict=True))


_WATCHDOG = Watchdog()


def pytest_configure(config: pytest.Config) -> None:
    # A build killed midway leaves a lock that torch waits on forever: every DeepSpeed test would wait out its limit.
    remove_stale_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    deadline = os.environ.get("LP_SUITE_DEADLINE")  # unix time
    if deadline:  # .ci/run: fail, naming the running test and the live processes, before CI's own limit
        _WATCHDOG.start(float(deadline) - time.time())


@pytest.fixture(scope="session", autouse=True)
def _reference_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One-process runs kept for the session (tests/references.py)."""
    import references

    references.set_folder(tmp_path_factory.getbasetemp() / "references")
    yield
    print(f"\none-process jobs: {references.STATS['runs']} run, {references.STATS['hits']} read from earlier tests")


def _test_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    # Launches end (killing their ranks, with their output) before pytest-timeout interrupts the test (tests/launch.py).
    timeout = _test_timeout(item)
    set_deadline(time.monotonic() + timeout if timeout > 0 else None)
    _WATCHDOG.running(item.nodeid)
    yield
    set_deadline(None)
