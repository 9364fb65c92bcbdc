"""Save and load a Lightning checkpoint as a sharded DCP folder.

Layout of ``<path>/``: DCP's ``.metadata`` and one ``__<rank>_0.distcp`` per writing rank, holding the model
(``state_dict``) and each optimizer (``optimizer_<i>``) keyed by the original parameter names; plus ``meta.pt``,
the rest of Lightning's checkpoint (loops, callbacks, schedulers, scaler), written by rank 0 and loaded with
``weights_only=True``. Replicated tensors are written once (DCP de-duplicates them). A folder appears only when
complete: everything is written to ``<path>.tmp`` and renamed by rank 0 after all ranks finished.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META = "meta.pt"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(path: Path, tensors: dict[str, Any], meta: dict[str, Any], rank: int) -> None:
    """Write ``tensors`` with DCP and ``meta`` with ``torch.save`` into the folder ``path``, atomically.

    Args:
        path: the checkpoint folder (same on every rank).
        tensors: ``{"state_dict": ..., "optimizer_0": ...}`` with plain or DTensor values.
        meta: the non-tensor rest of the checkpoint, saved by rank 0.
        rank: this process's global rank.
    """
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(tensors, checkpoint_id=tmp)
    if rank == 0:
        torch.save(meta, tmp / META)
    _barrier()
    if rank == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)  # keep the previous checkpoint until the new one is in place
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def state_for(module: nn.Module, optimizers: Sequence[tuple[nn.Module, torch.optim.Optimizer]]) -> dict[str, Any]:
    """Name-keyed (sharded) state of a model and its optimizers, in the layout `save_sharded` writes.

    Args:
        module: the model whose parameter names key the state.
        optimizers: pairs of (module whose parameters the optimizer holds, optimizer).
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    for i, (owner, opt) in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(owner, opt)
    return state


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
    strict: bool = True,
) -> dict[str, Any]:
    """Load a folder written by `save_sharded` into ``module`` and ``optimizers`` in place.

    Args:
        path: the checkpoint folder.
        module: the model, already parallelized.
        optimizers: as in `state_for`; empty when only the weights are wanted.
        strict: fail on missing or unexpected model keys.

    Returns:
        the non-tensor rest of the checkpoint (``meta.pt``).
    """
    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise FileNotFoundError(
            f"{path} is not a lightning_par checkpoint folder (expected .metadata and {META} inside); pass the "
            "folder that trainer.save_checkpoint wrote"
        )
    for _, opt in optimizers:
        _init_optim_state(opt)  # DCP loads into existing tensors, so the state must exist first
    state = state_for(module, optimizers)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["state_dict"], options=_options(strict))
    for i, (owner, opt) in enumerate(optimizers):
        set_optimizer_state_dict(owner, opt, state[f"optimizer_{i}"])
    return torch.load(path / META, weights_only=True, map_location="cpu")


def _options(strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)
