"""Register the strategy names (`lightning_par.names`) in Lightning's `StrategyRegistry` on ``import lightning_par``.

The only module that imports both strategy classes. Names whose combination has not landed yet are registered too
and fail at construction with the reason, so recipes and docs stay stable when it lands.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.names import (
    DEEPSPEED_STRATEGY_NAMES,
    STRATEGY_NAMES,
    deepspeed_strategy_kwargs,
    strategy_kwargs,
)
from lightning_par.strategies.deepspeed import DeepSpeedParallelStrategy
from lightning_par.strategies.parallel import ParallelStrategy


def make_strategy(backend: str = "native", **kwargs: Any) -> ParallelStrategy:
    """Build the strategy for a ZeRO ``backend``: `ParallelStrategy` (``"native"``) or `DeepSpeedParallelStrategy`.

    Args:
        backend: ``"native"`` or ``"deepspeed"``.
        **kwargs: the strategy's arguments.
    """
    if backend == "deepspeed":
        return DeepSpeedParallelStrategy(**kwargs)
    return ParallelStrategy(backend=backend, **kwargs)


class _NamedParallelStrategy(ParallelStrategy):
    """Registered constructor: resolves the name at construction, so unsupported names fail with their reason."""

    def __init__(self, preset: str, **kwargs: Any) -> None:
        super().__init__(**{**strategy_kwargs(preset), **kwargs})
        self.registered_name = preset


class _NamedDeepSpeedStrategy(DeepSpeedParallelStrategy):
    """Registered constructor for the ``deepspeed_*`` names."""

    def __init__(self, preset: str, **kwargs: Any) -> None:
        super().__init__(**{**deepspeed_strategy_kwargs(preset), **kwargs})
        self.registered_name = preset


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register every name in `STRATEGY_NAMES` and `DEEPSPEED_STRATEGY_NAMES` (idempotent)."""
    for names, cls in ((STRATEGY_NAMES, _NamedParallelStrategy), (DEEPSPEED_STRATEGY_NAMES, _NamedDeepSpeedStrategy)):
        for name in names:
            if name not in registry:
                registry.register(name, cls, description=f"lightning_par {name}", preset=name)
