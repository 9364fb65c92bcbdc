"""The strategy names: their grammar, and the constructor arguments each one stands for.

A name lists the dimensions it uses, joined by ``_`` in the order ``pipe``, ``tp``, ``cp``, ``moe``, ``zero1|2|3``,
with an optional ``_offload`` suffix; ``3d`` is an alias of ``pipe_tp_zero1``, and every ZeRO name also exists with a
``deepspeed_`` prefix (the same layout run by DeepSpeed's engine). A name fixes which dimensions are used, not their
degrees: those come from the world size (`lightning_par.config.ParallelConfig.resolve`, docs/strategies.md).
Pure data, no Lightning: `lightning_par.strategies.registry` registers these names with Lightning.
"""

from __future__ import annotations

import itertools
from typing import Any

# The name part of each model dimension, in the order names list them, and the axis it stands for (lightning_par.axes).
_MODEL_DIMS = (("pipe", "pp"), ("tp", "tp"), ("cp", "cp"), ("moe", "ep"))
_AXIS_OF = dict(_MODEL_DIMS)
_ZERO = ("", "zero1", "zero2", "zero3")
ALIASES = {"3d": "pipe_tp_zero1"}
DEEPSPEED_STRATEGY_NAMES = (
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
    "deepspeed_zero3_offload",
    "deepspeed_zero3_nvme",
)


def strategy_kwargs(name: str) -> dict[str, Any]:
    """Constructor arguments of `lightning_par.ParallelStrategy` for a registered name.

    Args:
        name: e.g. ``"zero3"``, ``"pipe_tp_zero1"``, ``"zero3_offload"`` or an alias.

    Raises:
        ValueError: a part of the name is not a dimension.
        NotImplementedError: the name combines dimensions that are not implemented together (the reason is named).
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
        elif part in _AXIS_OF:
            # moe: ep = every data-parallel rank, at start-up (docs/strategies.md: moe on 2 = ep 2 / dp 2)
            dims.append(_AXIS_OF[part])
        else:
            raise ValueError(f"unknown strategy part {part!r} in {name!r}; see lightning_par.STRATEGY_NAMES")
    kwargs["auto_dims"] = tuple(dims)
    return kwargs


def name_of(degrees: dict[str, int], zero_stage: int, offload: bool = False) -> str:
    """The registered name for a layout: each model dimension whose degree (``degrees[axis]``) is above 1, in the
    grammar's order, then the ZeRO stage (the inverse of `strategy_kwargs` up to degrees; ``""`` for plain data
    parallel)."""
    parts = [part for part, axis in _MODEL_DIMS if degrees.get(axis, 1) > 1]
    parts += [f"zero{zero_stage}"] if zero_stage else []
    return "_".join(parts) + ("_offload" if offload and parts else "")


def deepspeed_strategy_kwargs(name: str) -> dict[str, Any]:
    """Constructor arguments of `lightning_par.strategies.deepspeed.DeepSpeedParallelStrategy` for a name in
    `DEEPSPEED_STRATEGY_NAMES`."""
    if name not in DEEPSPEED_STRATEGY_NAMES:
        raise ValueError(f"unknown DeepSpeed strategy {name!r}; choose one of {DEEPSPEED_STRATEGY_NAMES}")
    base = name[len("deepspeed_") :]
    nvme = base.endswith("_nvme")
    kwargs = strategy_kwargs(base[: -len("_nvme")] + "_offload" if nvme else base)
    if nvme:
        kwargs["offload_device"] = "nvme"
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
# The planner's name (`lightning_par.strategies.auto`): a layout chosen at start-up, not a fixed combination.
AUTO_NAME = "auto_parallel"


def check_native_backend(backend: str) -> None:
    """Refuse a ``backend`` other than ``"native"`` for `lightning_par.ParallelStrategy`, naming where it went."""
    if backend == "deepspeed":
        raise ValueError(
            "ParallelStrategy(backend='deepspeed') is DeepSpeedParallelStrategy now: use "
            "lightning_par.DeepSpeedParallelStrategy(...) with the same arguments, strategy='deepspeed_zero2' "
            "(and the other deepspeed_* names), or lightning_par.strategies.registry.make_strategy(backend="
            "'deepspeed', ...)"
        )
    if backend != "native":
        raise ValueError(f"backend={backend!r} is unknown; choose 'native' or 'deepspeed'")
