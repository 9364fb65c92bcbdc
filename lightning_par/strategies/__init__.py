"""Lightning glue: `ParallelStrategy`, its DeepSpeed-backed variant, and the registry of strategy names."""

# Through the registry: the one module that imports both strategy classes.
from lightning_par.strategies.registry import (
    STRATEGY_NAMES,
    DeepSpeedParallelStrategy,
    ParallelStrategy,
    make_strategy,
    register_strategies,
    strategy_kwargs,
)

__all__ = [
    "STRATEGY_NAMES",
    "DeepSpeedParallelStrategy",
    "ParallelStrategy",
    "make_strategy",
    "register_strategies",
    "strategy_kwargs",
]
