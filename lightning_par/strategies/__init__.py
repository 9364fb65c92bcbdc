"""Lightning glue: `ParallelStrategy`, its DeepSpeed-backed variant, `FabricParallelStrategy`, and the registry of
strategy names."""

# Through the registry: the one module that imports the strategy classes together.
from lightning_par.strategies.registry import (
    STRATEGY_NAMES,
    DeepSpeedParallelStrategy,
    FabricParallelStrategy,
    ParallelStrategy,
    make_strategy,
    register_fabric_strategies,
    register_strategies,
    strategy_kwargs,
)

__all__ = [
    "STRATEGY_NAMES",
    "DeepSpeedParallelStrategy",
    "FabricParallelStrategy",
    "ParallelStrategy",
    "make_strategy",
    "register_fabric_strategies",
    "register_strategies",
    "strategy_kwargs",
]
