"""Precision for the sharded world: autocast, fp32 master weights, a sharded gradient scaler (Trainer and Fabric)."""

from lightning_par.precision.fabric import FabricPrecision
from lightning_par.precision.parallel import ParallelPrecision, ShardedGradScaler

__all__ = ["FabricPrecision", "ParallelPrecision", "ShardedGradScaler"]
