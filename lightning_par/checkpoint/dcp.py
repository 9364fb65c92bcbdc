"""Save and load a Lightning checkpoint as a sharded DCP folder.

Layout of ``<path>/``: DCP's ``.metadata`` and one ``__<rank>_0.distcp`` per writing rank, holding the model
(``state_dict``) and each optimizer (``optimizer_<i>``) keyed by the original parameter names; plus ``meta.pt``,
the rest of Lightning's checkpoint (loops, callbacks, schedulers, scaler, data position), written by rank 0, and
``rank_<r>.pt``, each rank's RNG states (`resume_state.py`), both loaded with ``weights_only=True``. Replicated
tensors are written once (DCP de-duplicates them); under local SGD, where replicas differ, ``state_dict`` holds the
anchor and each replica's own state is under `LOCAL_SGD` (`lightning_par.parallel.local_sgd.state`). A folder
appears only when complete: everything is written to ``<path>.tmp`` and renamed by rank 0 after all ranks finished
(`commit`). `async_save.py` writes the same layout in the background.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import shutil
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_par import _compat
from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.fast_state import model_state_dict, optimizer_state_dict
from lightning_par.checkpoint.reader import META, load_tensors, read_index, read_meta
from lightning_par.checkpoint.strided import canonicalize, restore

LOCAL_SGD = "local_sgd"  # tensors: each replica's state and the outer momentum; meta.pt["lightning_par"]: counts
# Maps the state to load (`state_for`'s layout, its tensors the live ones) and the checkpoint's ``meta.pt`` to the
# nested dict DCP loads into, whose leaves alias those tensors (`lightning_par.parallel.local_sgd.state`).
Layout = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def tmp_path(path: Path) -> Path:
    """Where the checkpoint ``path`` is written until it is complete."""
    return path.with_name(path.name + ".tmp")


def prepare_tmp(path: Path, rank: int, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Rank 0 empties ``<path>.tmp`` (left over by an interrupted save) and creates it; then all ranks meet.

    Args:
        path: the checkpoint folder (same on every rank).
        rank: this process's global rank.
        group: the process group to meet on (default: the whole world).

    Returns:
        the ``.tmp`` folder to write into.
    """
    tmp = tmp_path(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    return tmp


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    # renameat2(RENAME_EXCHANGE) swaps two directory entries in one step (Linux >= 3.15; not every filesystem).
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def commit(tmp: Path, path: Path) -> None:
    """Rank 0, once every rank's data and the index are in ``tmp``: make it the checkpoint ``path``.

    An existing ``path`` is replaced so that a complete checkpoint is under that name at every moment where the
    filesystem allows (an atomic exchange of the two folders); elsewhere the old one is moved to ``<path>.old``
    first, and a crash between the two renames leaves no ``path``, only the complete ``.old`` and ``.tmp``.

    Args:
        tmp: the complete folder written by `prepare_tmp` and DCP.
        path: the checkpoint's real name.
    """
    if path.exists() and _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
        return
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)  # keep the previous checkpoint until the new one is in place
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def rank_file(rank: int) -> str:
    """Name of the file in a checkpoint folder holding ``rank``'s own non-tensor state (its RNG states)."""
    return f"rank_{rank}.pt"


def write_small(tmp: Path, meta: Any, local: Any, rank: int) -> None:
    """Rank 0 writes ``meta`` as ``meta.pt``; every rank writes its ``local`` state as ``rank_<rank>.pt``.

    Either may also be given as the bytes of its ``torch.save``, serialized earlier (`serialize`).
    """
    for name, obj in ((META, meta if rank == 0 else None), (rank_file(rank), local)):
        if isinstance(obj, bytes):
            (tmp / name).write_bytes(obj)
        elif obj is not None:
            torch.save(obj, tmp / name)


def serialize(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` into memory: a snapshot of it that `write_small` writes later, unchanged."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_sharded(
    path: Path, tensors: dict[str, Any], meta: dict[str, Any], rank: int, local: Optional[dict[str, Any]] = None
) -> None:
    """Write ``tensors`` with DCP and ``meta`` with ``torch.save`` into the folder ``path``, atomically.

    Args:
        path: the checkpoint folder (same on every rank).
        tensors: ``{"state_dict": ..., "optimizer_0": ...}`` with plain or DTensor values.
        meta: the non-tensor rest of the checkpoint, saved by rank 0.
        rank: this process's global rank.
        local: this rank's own non-tensor state (its RNG states), saved by every rank as ``rank_<rank>.pt``.
    """
    tmp = prepare_tmp(path, rank)
    dcp.save(canonicalize(tensors)[0], checkpoint_id=tmp)
    write_small(tmp, meta, local, rank)
    checksums.record(tmp, rank)  # every rank hashes what it wrote; rank 0 writes the table
    _barrier()
    if rank == 0:
        commit(tmp, path)
    _barrier()


# Wraps an optimizer-state tensor of the named parameter into the DTensor it is a shard of (or returns it as is).
Distribute = Callable[[str, Any], Any]


@dataclasses.dataclass
class OptimizerEntry:
    """An optimizer and how to name and place its state.

    Args:
        owner: the module whose parameters (and their names) the optimizer holds.
        optimizer: the optimizer.
        distribute: for optimizers over plain local shards (ZeRO 1-2): wraps each state tensor as its DTensor.
    """

    owner: nn.Module
    optimizer: torch.optim.Optimizer
    distribute: Optional[Distribute] = None


# Optimizers whose latest saved state was DCP's initialisation (no step taken yet): see `optimizer_state`.
FRESH: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def optimizer_state(entry: OptimizerEntry) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded tensors as DTensors.

    An optimizer that has not stepped yet (PipeDream-2BW's first step applies no gradient) has no state, which DCP
    creates with one zero-gradient step at learning rate 0 (torch's ``_init_optim_state``): that step would count
    (AdamW's step count, hence its bias correction), so the state is dropped again after it is read, the optimizer
    is marked in `FRESH`, and a resume drops the loaded state the same way (`ShardedCheckpoints.load`).
    """
    fresh = not entry.optimizer.state
    sd = optimizer_state_dict(entry.owner, entry.optimizer)
    if fresh:
        entry.optimizer.state.clear()
        FRESH.add(entry.optimizer)
    else:
        FRESH.discard(entry.optimizer)
    wrap = entry.distribute
    if wrap is not None:
        # New dicts: the inner ones may be the optimizer's live state, which must stay plain tensors.
        sd["state"] = {name: {k: wrap(str(name), v) for k, v in st.items()} for name, st in sd["state"].items()}
    return sd


def model_state(module: nn.Module, distribute: Optional[Distribute] = None) -> dict[str, Any]:
    """The model's state dict by parameter name; plain local shards wrapped as DTensors by ``distribute``."""
    sd = model_state_dict(module)
    if distribute is not None:
        sd = {name: distribute(name, v) for name, v in sd.items()}
    return sd


def _unwrap(value: Any, live: Any) -> Any:
    # Back to the local tensor only where `distribute` wrapped a plain one: FSDP2's own DTensors stay DTensors.
    return value.to_local() if isinstance(value, DTensor) and not isinstance(live, DTensor) else value


def _localize(sd: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    local = dict(sd)
    local["state"] = {
        name: {k: _unwrap(v, live["state"].get(name, {}).get(k)) for k, v in st.items()}
        for name, st in sd["state"].items()
    }
    return local


def state_for(
    module: nn.Module, optimizers: Sequence[OptimizerEntry], distribute_model: Optional[Distribute] = None
) -> dict[str, Any]:
    """Name-keyed (sharded) state of a model and its optimizers, in the layout `save_sharded` writes.

    Args:
        module: the model whose parameter names key the state.
        optimizers: the optimizers with their owners.
        distribute_model: wraps model tensors that are plain local shards (expert parallelism) as their DTensors.
    """
    state: dict[str, Any] = {"state_dict": model_state(module, distribute_model)}
    for i, entry in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(entry)
    return state


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[OptimizerEntry],
    strict: bool = True,
    distribute_model: Optional[Distribute] = None,
    elsewhere: frozenset[str] = frozenset(),
    layout: Optional[Layout] = None,
    keep: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Load a folder written by `save_sharded` into ``module`` and ``optimizers`` in place.

    Args:
        path: the checkpoint folder.
        module: the model, already parallelized.
        optimizers: as in `state_for`; empty when only the weights are wanted.
        strict: fail on missing or unexpected model keys.
        distribute_model: as in `state_for`.
        elsewhere: model keys (``state_dict.<name>``) other ranks load: other pipeline stages' parameters.
        layout: where the state is in the checkpoint, when not as `state_for` lays it out (local SGD's replicas);
            it may refuse the checkpoint (before any tensor is read).
        keep: model names that keep their values, not read (frozen weights a checkpoint left out on purpose).

    Returns:
        the non-tensor rest of the checkpoint (``meta.pt``).
    """
    # Every file against the index, then its checksum, then keys and shapes, before anything is modified (reader.py).
    index = read_index(path)
    meta = read_meta(path)  # a truncated meta.pt is named as such, before its checksum would say it changed
    distributed = dist.is_available() and dist.is_initialized()
    checksums.verify(path, dist.get_rank() if distributed else 0, dist.get_world_size() if distributed else 1)
    for entry in optimizers:
        _compat.init_optim_state(entry.optimizer)  # DCP loads into existing tensors, so the state must exist first
    state = state_for(module, optimizers, distribute_model)
    if keep:
        state["state_dict"] = {k: v for k, v in state["state_dict"].items() if k not in keep}
    on_disk = state if layout is None else layout(state, meta)
    canonical, swaps = canonicalize(on_disk)  # fused tensor-parallel tensors are stored whole (strided.py)
    load_tensors(path, index, canonical, strict=strict, elsewhere=elsewhere)
    restore(swaps)
    model_sd = state["state_dict"]
    if distribute_model is not None:  # the wrapped shards alias the parameters: DCP already wrote into them
        live = get_model_state_dict(module)
        model_sd = {k: _unwrap(v, live.get(k)) for k, v in model_sd.items()}
    set_model_state_dict(module, model_sd, options=_options(strict and not keep))  # (keys checked above)
    for i, entry in enumerate(optimizers):
        sd = state[f"optimizer_{i}"]
        if entry.distribute:
            sd = _localize(sd, dict(get_optimizer_state_dict(entry.owner, entry.optimizer)))
        set_optimizer_state_dict(entry.owner, entry.optimizer, sd)
    return meta


def _options(strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)
