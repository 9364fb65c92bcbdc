"""Lightning glue: `ParallelStrategy`, its DeepSpeed-backed variant, and the registry of strategy names."""

from lightning_par.strategies.deepspeed import DeepSpeedParallelStrategy
from lightning_par.strategies.parallel import ParallelStrategy
from lightning_par.strategies.registry import STRATEGY_NAMES, make_strategy, register_strategies, strategy_kwargs

__all__ = [
    "STRATEGY_NAMES",
    "DeepSpeedParallelStrategy",
    "ParallelStrategy",
    "make_strategy",
    "register_strategies",
    "strategy_kwargs",
]
