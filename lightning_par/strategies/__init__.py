"""Lightning glue: `ParallelStrategy` and the registry of strategy names."""

from lightning_par.strategies.parallel import ParallelStrategy
from lightning_par.strategies.registry import STRATEGY_NAMES, register_strategies, strategy_kwargs

__all__ = ["STRATEGY_NAMES", "ParallelStrategy", "register_strategies", "strategy_kwargs"]
