"""Sharded distributed checkpoints (DCP), keyed by the original parameter names."""

from lightning_par.checkpoint.dcp import load_sharded, save_sharded

__all__ = ["load_sharded", "save_sharded"]
