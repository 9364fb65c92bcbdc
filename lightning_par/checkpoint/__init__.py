"""Sharded distributed checkpoints (DCP), keyed by the original parameter names."""

from lightning_par.checkpoint.consolidate import consolidate, load_full_state
from lightning_par.checkpoint.dcp import load_sharded, save_sharded
from lightning_par.checkpoint.reader import CheckpointError, CheckpointNotFoundError
from lightning_par.checkpoint.recovery import latest
from lightning_par.checkpoint.strided import full_tensor

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "consolidate",
    "full_tensor",
    "latest",
    "load_full_state",
    "load_sharded",
    "save_sharded",
]
