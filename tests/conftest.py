"""Shared fixtures: one-process references are computed once per session and reused by every parity test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds its C++ ops (shm comm ~30 s, cpu_adam ~40 s) on first use: once per checkout, here.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))

from launch import run_jobs

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


def reference_job(job: dict[str, Any]) -> dict[str, Any]:
    ref = {**job, "strategy": "auto"}
    if job.get("precision") == "16-mixed":
        # Lightning turns 16-mixed into bf16 on CPU; its own fp16 AMP plugin with a CPU GradScaler is the reference.
        ref["lightning_fp16_reference"] = True
    return ref


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("reference")
    results = run_jobs(tmp, [reference_job(j) for j in PARITY_JOBS.values()], nproc=1)
    return dict(zip(PARITY_JOBS, results))


def pytest_configure(config: pytest.Config) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
