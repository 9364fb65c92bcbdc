"""``fabric.save`` / ``fabric.load`` state dicts as the sharded folders the Trainer writes (`checkpoint/dcp.py`).

One folder format for both loops: the model's tensors under ``state_dict``, the i-th optimizer of the state dict
under ``optimizer_<i>``, everything else in ``meta.pt``. So ``fabric.load`` restores a Trainer's checkpoint (model and
optimizers, onto any layout), and the Trainer (``pretrained=``), ``lightning-par consolidate`` and the HF export
read Fabric's. Which state keys held the model and the optimizers is kept under `KEYS`, so a Fabric checkpoint loads
back under its own names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_par import _compat
from lightning_par.checkpoint.dcp import OptimizerEntry, load_sharded, model_state, save_sharded
from lightning_par.parallel.run import ParallelRun
from lightning_par.strategies._checkpointing import ShardedCheckpoints, optimizer_entries

KEYS = "lightning_par_fabric"  # meta.pt entry: {"model": state key, "optimizers": [state keys]}


def _split(state: dict[str, Any], run: ParallelRun) -> tuple[str, list[str], list[str]]:
    """The key of the set-up model, the optimizers' keys in order, and the other keys."""
    models = [k for k, v in state.items() if isinstance(v, nn.Module)]
    ours = [k for k in models if state[k] is run.model or state[k] is run.module]
    if len(ours) != 1 or len(models) != 1:
        raise ValueError(
            f"the state holds modules {models}; a lightning_par checkpoint holds exactly the one model this strategy "
            "set up (fabric.setup(model, ...)): pass state={'model': model, 'optimizer': optimizer, ...}"
        )
    optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    rest = [k for k in state if k not in ours and k not in optimizers]
    return ours[0], optimizers, rest


def _entries(run: ParallelRun, state: dict[str, Any], keys: list[str]) -> list[OptimizerEntry]:
    return optimizer_entries(run, run.module, [state[k] for k in keys])


def save_state(path: Path, state: dict[str, Any], run: ParallelRun, rank: int, broadcast: Callable[[Any], Any]) -> None:
    """Write Fabric's ``state`` (the set-up model, its optimizers, plain values and stateful objects) as a folder.

    Args:
        path: the checkpoint folder (rank 0's path is used on every rank).
        state: as given to ``fabric.save``.
        run: the layout the model was set up with.
        rank: this process's global rank.
        broadcast: rank 0's object to every rank.
    """
    model_key, optimizer_keys, rest = _split(state, run)
    entries = _entries(run, state, optimizer_keys)
    tensors: dict[str, Any] = {"state_dict": model_state(run.module, run.distribute_model())}
    for i, key in enumerate(optimizer_keys):
        tensors[f"optimizer_{i}"] = ShardedCheckpoints.optimizer_state(run, entries, state[key])
    meta = {k: state[k].state_dict() if isinstance(state[k], _compat.stateful_protocol()) else state[k] for k in rest}
    meta[KEYS] = {"model": model_key, "optimizers": optimizer_keys}
    save_sharded(Path(broadcast(str(path))), tensors, meta, rank)


def load_state(path: Path, state: dict[str, Any], run: ParallelRun, strict: bool) -> dict[str, Any]:
    """Load a folder (Fabric's or the Trainer's) into ``state`` in place; return what ``state`` did not ask for.

    The model's weights and the optimizers (the i-th optimizer of ``state`` from the checkpoint's i-th) are resharded
    onto this layout; stateful objects get ``load_state_dict``, other values are replaced.

    Raises:
        KeyError: ``strict`` and a key of ``state`` is not in the checkpoint.
    """
    _, optimizer_keys, rest = _split(state, run)
    meta = load_sharded(path, run.module, _entries(run, state, optimizer_keys), strict=strict,
                        distribute_model=run.distribute_model(), elsewhere=run.other_stage_keys())  # fmt: skip
    meta.pop(KEYS, None)
    missing = [k for k in rest if k not in meta]
    if strict and missing:
        raise KeyError(
            f"{path} holds no {missing} (it has {sorted(meta)}); drop them from the state or load with strict=False"
        )
    for key in rest:
        if key not in meta:
            continue
        value = meta.pop(key)
        if isinstance(state[key], _compat.stateful_protocol()):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return meta


def load_weights(path: Path, run: ParallelRun, strict: bool) -> Optional[dict[str, Any]]:
    """Load only the model's weights from a folder (``fabric.load_raw`` or ``fabric.load(path, model)``)."""
    load_sharded(path, run.module, [], strict=strict, distribute_model=run.distribute_model(),
                 elsewhere=run.other_stage_keys())  # fmt: skip
    return {}
