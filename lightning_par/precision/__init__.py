"""Precision for the sharded world: autocast, fp32 master weights, a sharded gradient scaler."""

from lightning_par.precision.parallel import ParallelPrecision, ShardedGradScaler

__all__ = ["ParallelPrecision", "ShardedGradScaler"]
