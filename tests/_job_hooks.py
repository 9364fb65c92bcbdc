"""What `tests/_worker.py` patches around a job's fit: DCP's file writer (a background write held until training
has ended one more step; a SIGKILL of one rank inside a save), the asynchronous save's staging copy (slowed), the
warnings raised (recorded) and FSDP2's reduce-scatters (counted)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from _job_callbacks import STEP_ENDS, STEPS, first_attempt, kill_self
from jobs import Job


@contextmanager
def _slow_staging(pause: float) -> Iterator[None]:
    # The background copy of parameters and optimizer state (async_save.py) sleeps first: the optimizer step after a
    # save must wait for it, or the checkpoint would hold that step's update.
    from lightning_par.checkpoint.async_save import _BufferStager

    original = _BufferStager._copy_later

    def copy_later(copies: Any) -> None:
        time.sleep(pause)
        original(copies)

    _BufferStager._copy_later = staticmethod(copy_later)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _BufferStager._copy_later = staticmethod(original)  # type: ignore[method-assign]


@contextmanager
def patch_checkpoint_writes(job: Job) -> Iterator[None]:
    """Test hooks in DCP's file writer (the data files of every save, sync or async, in whichever thread):
    ``write_after_next_step``: a write in a background thread (an asynchronous save) starts only once training has
    ended one more step (or is over), so that training provably runs on while a checkpoint is written, whatever the
    machine's speed; ``sigkill_in_save: {"nth": n, "rank": r}`` SIGKILLs rank r right after its data file of the n-th
    save was written (before the index), on torchrun's first attempt only."""
    slow, kill = job.write_after_next_step, job.sigkill_in_save
    rank = int(os.environ.get("RANK", "0"))
    if job.slow_staging_s:
        rest = dataclasses.replace(job, slow_staging_s=0.0)
        with _slow_staging(float(job.slow_staging_s)), patch_checkpoint_writes(rest):
            yield
        return
    if not slow and not (kill and kill["rank"] == rank and first_attempt()):
        yield
        return
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data
    calls = [0]

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if slow and threading.current_thread() is not threading.main_thread():
            # Until the step after the one that saved (not after this thread started), the end of training, or
            # another save, which waits for this one (Lightning saves step=N.ckpt and last.ckpt at one step end).
            with STEP_ENDS:
                at_save = STEPS["saves"].pop(0) if STEPS["saves"] else STEPS["ended"]
                STEP_ENDS.wait_for(lambda: STEPS["ended"] > at_save or STEPS["over"] or STEPS["saves"], timeout=120)
        written = original(self, plan, planner)
        calls[0] += 1
        if kill and calls[0] == kill["nth"]:
            written.wait()
            kill_self()
        return written

    _FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        _FileSystemWriter.write_data = original  # type: ignore[method-assign]


@contextmanager
def recorded_warnings(into: list[Any], record: bool) -> Iterator[None]:
    if not record:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    into.extend(caught)


@contextlib.contextmanager
def counted_reduce_scatters(into: list[int], record: bool) -> Iterator[None]:
    """Count the reduce-scatters FSDP2 issues (it calls ``torch.distributed.reduce_scatter_single``); each call
    still runs the real collective."""
    if not record:
        yield
        return
    real = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        into.append(1)
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        yield
    finally:
        dist.reduce_scatter_single = real
