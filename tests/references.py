"""One-process runs computed once per test session: a job described twice (the same reference in several test
modules) runs once, and later requests read the saved result.

A job's result depends only on its description (each job seeds everything; tests/_worker.py), so two equal
descriptions give equal results. Jobs that leave files a test reads afterwards (checkpoints, saved models, a folder
listing) or that kill themselves are always run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

# Keys of jobs that write files their test reads later, or that end their process on purpose.
_SIDE_EFFECTS = frozenset({"ckpt_dir", "ckpt_epoch_end_dir", "save", "sigkill_at_step", "sigkill_in_save", "list_dir",
                           "expert_load", "fail_at_step", "stream_dir"})  # fmt: skip
_FOLDER: Optional[Path] = None
STATS = {"hits": 0, "runs": 0}


def set_folder(folder: Optional[Path]) -> None:
    """Where this session keeps results (``None``: nothing is kept, every job runs)."""
    global _FOLDER
    _FOLDER = folder
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)


def _key(job: dict[str, Any]) -> Optional[str]:
    if _FOLDER is None or _SIDE_EFFECTS & job.keys():
        return None
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:24]


def cached(jobs: list[dict[str, Any]], run: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> list[Any]:
    """The results of one-process ``jobs``, running (in one call of ``run``, in order) only those not kept yet."""
    keys = [_key(job) for job in jobs]
    assert _FOLDER is not None or all(k is None for k in keys)
    todo: list[int] = []
    seen: set[str] = set()
    for i, key in enumerate(keys):
        if key is None or (key not in seen and not (_FOLDER / f"{key}.pt").exists()):  # type: ignore[operator]
            todo.append(i)
        if key is not None:
            seen.add(key)
    done = dict(zip(todo, run([jobs[i] for i in todo]), strict=True)) if todo else {}
    STATS["runs"] += len(todo)
    STATS["hits"] += len(jobs) - len(todo)
    for i, result in done.items():
        if keys[i] is not None:
            torch.save(result, _FOLDER / f"{keys[i]}.pt")  # type: ignore[operator]
    return [done[i] if i in done else torch.load(_FOLDER / f"{keys[i]}.pt", weights_only=False)  # type: ignore[operator]
            for i in range(len(jobs))]  # fmt: skip
