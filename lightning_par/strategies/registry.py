"""Strategy names registered in Lightning's `StrategyRegistry` on ``import lightning_par``.

A name lists the dimensions it uses, joined by ``_`` in the order ``pipe``, ``tp``, ``moe``, ``zero1|2|3``
(DESIGN.md). Every non-empty combination is registered, plus ``zero3_offload`` and the alias ``3d``; the degrees
are split from the world size at start-up (`lightning_par.config.split_world`). Names whose dimensions have not
landed yet are registered too and fail at construction with "not yet supported", so recipes and docs are stable.
"""

from __future__ import annotations

import itertools
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.config import expert_parallel_conflict
from lightning_par.strategies.parallel import ParallelStrategy

_MODEL_DIMS = (("pipe", "pp"), ("tp", "tp"), ("moe", "ep"))
_ZERO = ("", "zero1", "zero2", "zero3")
ALIASES = {"3d": "pipe_tp_zero1"}


def strategy_kwargs(name: str) -> dict[str, Any]:
    """Constructor arguments of `ParallelStrategy` for a registered name.

    Args:
        name: e.g. ``"zero3"``, ``"pipe_tp_zero1"``, ``"zero3_offload"`` or an alias.
    """
    name = ALIASES.get(name, name)
    parts = name.split("_")
    offload = parts[-1] == "offload"
    if offload:
        parts = parts[:-1]
    dims: list[str] = []
    kwargs: dict[str, Any] = {"zero_stage": 0, "offload": offload}
    for part in parts:
        if part.startswith("zero") and part[4:].isdigit():
            kwargs["zero_stage"] = int(part[4:])
            dims.append("dp")
        elif part in ("pipe", "tp"):
            dims.append({"pipe": "pp", "tp": "tp"}[part])
        elif part == "moe":
            dims.append("ep")  # ep = all data-parallel ranks, resolved at start-up (DESIGN.md: moe on 2 = ep 2 / dp 2)
        else:
            raise ValueError(f"unknown strategy part {part!r} in {name!r}; see lightning_par.STRATEGY_NAMES")
    if "ep" in dims:
        reason = expert_parallel_conflict("tp" in dims, "pp" in dims)
        if reason:
            raise NotImplementedError(f"strategy {name!r}: {reason}")
    kwargs["auto_dims"] = tuple(dims)
    return kwargs


def _names() -> list[str]:
    names = []
    for n in range(len(_MODEL_DIMS) + 1):
        for dims in itertools.combinations([d for d, _ in _MODEL_DIMS], n):
            for zero in _ZERO:
                parts = [*dims, zero] if zero else list(dims)
                if parts:
                    names.append("_".join(parts))
    return [*names, "zero3_offload", *ALIASES]


STRATEGY_NAMES: tuple[str, ...] = tuple(_names())


class _LazyParallelStrategy(ParallelStrategy):
    """Registered constructor: resolves the name at construction, so unsupported names fail with their reason."""

    def __init__(self, preset: str, **kwargs: Any) -> None:
        super().__init__(**{**strategy_kwargs(preset), **kwargs})
        self.registered_name = preset


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register every name in `STRATEGY_NAMES` and the ``deepspeed_*`` names (idempotent)."""
    for name in STRATEGY_NAMES:
        if name in registry:
            continue
        registry.register(name, _LazyParallelStrategy, description=f"lightning_par {name}", preset=name)
    from lightning_par.strategies.deepspeed import register_deepspeed_strategies

    register_deepspeed_strategies(registry)
