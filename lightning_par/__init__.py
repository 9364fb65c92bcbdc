"""lightning_par: parallel training strategies for unmodified LightningModules.

``import lightning_par`` registers the strategy names (``"zero1"``, ``"zero2"``, ``"zero3"``,
``"zero3_offload"``, ...) so ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")`` work.
"""

from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.precision.parallel import ParallelPrecision
from lightning_par.strategies import (
    STRATEGY_NAMES,
    DeepSpeedParallelStrategy,
    FabricParallelStrategy,
    ParallelStrategy,
    _precision_choice,
    register_fabric_strategies,
    register_strategies,
)
from lightning_par.streams.parquet import ParquetShards
from lightning_par.streams.shards import ShardedSource

__version__ = "0.1.0"

_precision_choice.install()
register_strategies()
register_fabric_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "DeepSpeedParallelStrategy",
    "FabricParallelStrategy",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelPrecision",
    "ParallelStrategy",
    "ParquetShards",
    "ShardedSource",
]
