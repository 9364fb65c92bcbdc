"""Asynchronous save of the `dcp.save_sharded` layout: copy to CPU memory, write in the background, then commit.

`AsyncSaver.save` blocks while ``meta.pt`` is serialized and while the tensors a forward pass may change (buffers)
are copied into CPU buffers (`_BufferStager`), and it meets no other rank. Parameters and optimizer state, which
only an optimizer step changes, are copied by the saver's worker thread while training computes the next forward
and backward, and `wait_for_staging` (a pre-hook on each optimizer's step) holds that step until their copy is
taken. The copies are the snapshot. The same thread then agrees on rank 0's path, writes ``<path>.tmp`` with DCP
over a process group of its own, and rank 0 renames it to ``<path>`` (`dcp.commit`) once its DCP save returned:
that return means every rank's data files were written and synced and the index ``.metadata`` was written after
them (DCP gathers each rank's write result to rank 0 before writing the index). So a folder appears under its
real name only complete, and a crash at any point leaves at most a ``.tmp`` folder, which loading ignores.

On a GPU the copies go into page-locked buffers on a stream of the saver's own and return at once; a device-side
fence orders them before the next forward and a host-side one before the next optimizer step (`device_staging`).

Costs: a CPU copy of this rank's part of the model and optimizer state (ZeRO-1/2 also copy the replicated
parameters; DCP writes them once), kept from the first save until `AsyncSaver.release`, so later saves copy into
it instead of allocating. At most one save is in flight: the next one first waits for the previous, as do loading
and the end of training.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_par import _compat
from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.dcp import commit, prepare_tmp, serialize, tmp_path, write_small
from lightning_par.checkpoint.device_staging import DeviceCopies, pinned_like
from lightning_par.checkpoint.reader import CheckpointError
from lightning_par.checkpoint.strided import canonicalize
from lightning_par.utils import dtensors


@dataclasses.dataclass
class _Pending:
    path: Path
    done: Future  # set by rank 0 after the commit, by the other ranks when DCP's save returned


class StagingError(RuntimeError):
    """A tensor being staged in the background was changed in place before its copy was taken."""


_Copy = tuple[torch.Tensor, torch.Tensor, int, tuple[Any, ...]]  # (buffer, source, source version, key path)


class _BufferStager:
    """Copies a state dict into CPU buffers kept by key path, reused by the next save (same keys and shapes).

    DCP's default stager deep-copies, which for a DTensor costs ~0.2 ms of Python per tensor (measured: 15-28 ms
    for 100 sharded tensors, against 2 ms for plain ones), and allocates fresh memory every time. This copies only
    the local shard and re-wraps it with the DTensor's own (immutable) spec. `AsyncSaver` waits for the previous
    write before staging the next, so a buffer is never overwritten while DCP reads it.

    Tensors that only an optimizer step changes (``deferred``: parameters and optimizer state, by storage) are
    left to `_copy_later`, which `AsyncSaver` runs in its worker thread while training computes the next forward
    and backward; `AsyncSaver.wait_for_staging` runs before that step's optimizer changes them (the way torchtitan
    overlaps its staging copy with forward and backward). Every other tensor (buffers such as BatchNorm statistics,
    which a forward changes) is copied by `capture` itself. A deferred tensor changed in place before its copy was
    taken (its version counter moved) fails the staging with `StagingError` rather than saving a mixture of two
    steps.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._later: list[_Copy] = []
        self._watched: list[_Copy] = []  # deferred accelerator tensors: copied by `_device`, version-checked later
        self._device = DeviceCopies()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.deferred: frozenset[int] = frozenset()  # storage pointers whose copy may wait for the worker thread

    def _copy(self, key: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor.detach()) is not torch.Tensor:  # a wrapper subclass: it has no storage of its own
            parts = dtensors.storages(tensor)
            if len(parts) != 1 or parts[0].shape != tensor.shape:
                # Several tensors (QLoRA's NF4: codes and scalers): a host copy of the whole wrapper, taken now
                # (its clone would quantize again); not deferred, not pinned.
                held = tensor.detach()
                return copy.deepcopy(held) if held.device.type == "cpu" else held.to("cpu")
            tensor = parts[0]  # one plain tensor (fp8 training's weights): its values are the state
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._buffers[key] = pinned_like(tensor)
        source = tensor.detach()
        deferred = source.untyped_storage().data_ptr() in self.deferred
        if source.device.type == "cuda":
            self._device.add(buf, source, deferred)
            if deferred:
                self._watched.append((buf, source, _compat.tensor_version(source), key))
        elif deferred and source.device.type == "cpu":
            self._later.append((buf, source, _compat.tensor_version(source), key))
        else:
            buf.copy_(source)
        return buf

    def _stage(self, key: tuple[Any, ...], value: Any) -> Any:
        if isinstance(value, DTensor):
            local = self._copy(key, _compat.dtensor_local(value))  # not to_local(): an autograd call, ~10 us each
            return _compat.dtensor_like(local, value)
        if isinstance(value, torch.Tensor):
            return self._copy(key, value)
        if isinstance(value, dict):
            # Also OrderedDict: `Module.state_dict()` (and so the model's state) is one; a deep copy of it would
            # copy every tensor anew, and each DTensor at ~0.2 ms of Python. DCP reads any mapping alike.
            return {k: self._stage((*key, k), v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._stage((*key, i), v) for i, v in enumerate(value))
        return copy.deepcopy(value)  # e.g. param_groups' numbers, which LR schedulers change in place

    def capture(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], _Later]:
        """The staged state dict (its buffers filled except the deferred ones) and what is left to copy or wait for.

        Accelerator tensors' copies are issued here and run on the saver's stream (`device_staging`).
        """
        self._later, self._watched = [], []
        staged = {k: self._stage((k,), v) for k, v in state_dict.items()}
        self._device.issue(self._streams)
        later = _Later(self._later, self._watched, self._device)
        self._later, self._watched, self._device = [], [], DeviceCopies()
        return staged, later

    @staticmethod
    def _copy_later(later: _Later) -> None:
        later.run()  # a seam the recovery tests slow down or gate

    def close(self) -> None:
        self._buffers.clear()
        self._streams.clear()


@dataclasses.dataclass
class _Later:
    """What a save leaves to its worker thread before the next optimizer step may run."""

    copies: list[_Copy]  # CPU tensors to copy now
    watched: list[_Copy]  # accelerator tensors whose issued copies `device` waits for
    device: DeviceCopies

    def run(self) -> None:
        """Make the copies, wait for the device's, then check that no source changed before its copy was taken."""
        for buf, source, _, _ in self.copies:
            buf.copy_(source)
        self.device.wait()
        for _, source, version, key in self.copies + self.watched:
            if _compat.tensor_version(source) != version:
                name = ".".join(str(k) for k in key)
                raise StagingError(
                    f"{name} was changed in place while an asynchronous save was copying it (before the next "
                    "optimizer step); the checkpoint was not written. Code that changes parameters outside "
                    "optimizer.step() right after a save must first call trainer.strategy.wait_for_staging()"
                )


def _write(
    staged: dict[str, Any],
    later: _Later,
    small: tuple[Optional[bytes], Optional[bytes]],
    *,
    path: Path,
    rank: int,
    group: Optional[dist.ProcessGroup],
    staging: Future,
    done: Future,
) -> None:
    # Runs in the saver's worker thread; an exception here would be lost, so every outcome goes to the futures the
    # training thread waits on. The deferred copies first: the next optimizer step waits for them.
    try:
        _BufferStager._copy_later(later)
    except BaseException as err:
        staging.set_exception(err)
        done.set_exception(err)
        return
    staging.set_result(None)
    try:
        if group is not None:  # every rank writes into rank 0's folder, as a synchronous save does
            box = [str(path)]
            dist.broadcast_object_list(box, group_src=0, group=group)
            path = Path(box[0])
        tmp = prepare_tmp(path, rank, group)
        write_small(tmp, *small, rank)
        dcp.save(staged, checkpoint_id=tmp, process_group=group, no_dist=group is None)
        checksums.record(tmp, rank, group)  # before the commit: the folder appears with its table
        if rank == 0:
            commit(tmp, path)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        done.set_exception(err)
    else:
        done.set_result(path)


def _message(err: BaseException) -> str:
    if isinstance(err, CheckpointException):
        # One line per rank: DCP gathers every rank's exception with its traceback.
        parts = []
        for rank, failure in sorted(err.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


class AsyncSaver:
    """Writes sharded checkpoints in the background, one at a time, each committed atomically by rank 0.

    Args:
        timeout: collective timeout of the checkpoint process group.
    """

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._group: Optional[dist.ProcessGroup] = None
        self._pending: Optional[_Pending] = None
        self._staging: Optional[Future] = None
        self._stager = _BufferStager()
        # One long-lived worker: DCP's async_save starts a thread per save (~1.5 ms of the training thread's time
        # on a busy host); this one stages the deferred copies, then runs DCP's save and the commit.
        self._worker: Optional[ThreadPoolExecutor] = None
        self.staging_wait_s = 0.0  # total time `wait_for_staging` held training (for benchmarks)

    @property
    def in_flight(self) -> Optional[Path]:
        """The checkpoint being written in the background on this rank, or ``None``."""
        pending = self._pending
        return pending.path if pending is not None and not pending.done.done() else None

    def _checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        if not dist.is_initialized():
            return None
        if self._group is None:
            # DCP's collectives run in the writer thread while training issues its own: on one group their order
            # would differ between ranks, and gloo crashes (docs/testing.md). gloo, because the staged copies are on
            # the CPU whatever the device. Created on the first save, which every rank reaches at the same point.
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def save(
        self,
        path: Path,
        tensors: dict[str, Any],
        meta: dict[str, Any],
        rank: int,
        local: Optional[dict[str, Any]] = None,
        deferred: frozenset[int] = frozenset(),
    ) -> None:
        """Start writing a checkpoint; returns once the state is captured. Called by every rank, in the same order.

        Args:
            path: the checkpoint folder; rank 0's is used on every rank.
            tensors: ``{"state_dict": ..., "optimizer_0": ...}`` with plain or DTensor values; captured before this
                returns except ``deferred`` ones, so the caller may change the others afterwards.
            meta: the non-tensor rest of the checkpoint, saved by rank 0 (serialized before this returns).
            rank: this process's global rank.
            local: this rank's own non-tensor state, saved by every rank (serialized before this returns).
            deferred: storage pointers (``untyped_storage().data_ptr()``) of the tensors that nothing but an
                optimizer step changes: they are copied in the background, and `wait_for_staging` must run before
                the next optimizer step. Every other tensor is copied before this returns.
        """
        self.wait()  # at most one save in flight
        group = self._checkpoint_group()
        # Serialized now, so they are the state at this call; written with the rest by the worker. Nothing on this
        # thread meets the other ranks: the path, the .tmp folder and DCP's collectives go over `group` there.
        small = (serialize(meta) if rank == 0 else None, serialize(local) if local is not None else None)
        tensors = canonicalize(tensors)[0]  # collectives only for fused tensor-parallel tensors (strided.py)
        self._stager.deferred = deferred
        staged, later = self._stager.capture(tensors)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_par_async_save")
        staging: Future = Future()
        done: Future = Future()
        self._staging, self._pending = staging, _Pending(path, done)
        self._worker.submit(_write, staged, later, small, path=path, rank=rank, group=group, staging=staging, done=done)

    def wait_for_staging(self) -> None:
        """Wait until the save in flight has copied the tensors it copies in the background; cheap when it has.

        Raises:
            CheckpointError: a tensor changed in place before its copy was taken; the save will not be committed.
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        start = time.perf_counter()
        try:
            staging.result()
        except Exception as err:
            path = self._pending.path if self._pending is not None else "?"
            raise CheckpointError(
                f"asynchronous save of checkpoint {path} failed while copying the state: {err}"
            ) from err
        finally:
            self.staging_wait_s += time.perf_counter() - start

    def wait(self) -> Optional[Path]:
        """Wait for the save in flight, if any (on rank 0: until it is committed under its name).

        Returns:
            the path of the checkpoint that was waited for, or ``None``.

        Raises:
            CheckpointError: the background write failed; the checkpoint was not committed.
        """
        self.wait_for_staging()
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.done.result()
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"asynchronous save of checkpoint {pending.path} failed ({_message(err)}); it was not committed, "
                f"and the earlier checkpoints are intact. Its partial write is in {tmp_path(pending.path)} (the "
                "next save under that name replaces it); fix the cause (free disk space, permissions) and save again"
            ) from err

    def release(self) -> None:
        """Wait for the save in flight (see `wait`), then free the staging buffers (the next save allocates anew)."""
        try:
            self.wait()
        finally:
            self._stager.close()
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
