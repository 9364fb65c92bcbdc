"""The Fabric side, under Lightning's own naming (``lightning.fabric.strategies.FSDPStrategy`` beside
``lightning.pytorch.strategies.FSDPStrategy``): ``from lightning_par.fabric import ParallelStrategy`` and
``Fabric(strategy=ParallelStrategy(tp=2, zero_stage=3))`` take the arguments of the Trainer's
`lightning_par.ParallelStrategy` (docs/fabric.md)."""

from lightning_par.precision.fabric import FabricPrecision
from lightning_par.strategies.fabric import FabricParallelStrategy

ParallelStrategy = FabricParallelStrategy

__all__ = ["FabricPrecision", "ParallelStrategy"]
