"""Register the strategy names (`lightning_par.names`) in Lightning's `StrategyRegistry` (Trainer) and in Fabric's
``STRATEGY_REGISTRY`` on ``import lightning_par``.

The only module that imports the strategy classes together. Names whose combination has not landed yet (or that a
loop cannot run) are registered too and fail at construction with the reason, so recipes and docs stay stable.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.names import (
    AUTO_NAME,
    DEEPSPEED_STRATEGY_NAMES,
    STRATEGY_NAMES,
    deepspeed_strategy_kwargs,
    strategy_kwargs,
)
from lightning_par.strategies.auto import AutoParallelStrategy
from lightning_par.strategies.deepspeed import DeepSpeedParallelStrategy
from lightning_par.strategies.fabric import FabricParallelStrategy
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
    if AUTO_NAME not in registry:
        registry.register(AUTO_NAME, AutoParallelStrategy, description="lightning_par: the planner picks the layout")


class _NamedFabricStrategy(FabricParallelStrategy):
    """Registered constructor of the Fabric names (``pipe*`` fail here with the reason)."""

    def __init__(self, preset: str, **kwargs: Any) -> None:
        if preset in DEEPSPEED_STRATEGY_NAMES:
            raise ValueError(
                f"Fabric(strategy={preset!r}): lightning_par runs DeepSpeed under the Trainer only; under Fabric use "
                "the native layout of the same name without 'deepspeed_' (e.g. 'zero3'), or Lightning's own "
                "Fabric(strategy='deepspeed_stage_3')"
            )
        super().__init__(**{**strategy_kwargs(preset), **kwargs})
        self.registered_name = preset


def register_fabric_strategies(registry: Any = FABRIC_REGISTRY) -> None:
    """Register every name of `STRATEGY_NAMES` and `DEEPSPEED_STRATEGY_NAMES` for ``Fabric(strategy=...)``
    (idempotent); the ``deepspeed_*`` and ``pipe*`` ones refuse at construction, with the reason."""
    for name in (*STRATEGY_NAMES, *DEEPSPEED_STRATEGY_NAMES):
        if name not in registry:
            registry.register(name, _NamedFabricStrategy, description=f"lightning_par {name} (Fabric)", preset=name)
