"""The suite's vocabulary, defined once: the parallel axes and their properties, how a world size splits over them
(`split_world`), the pipeline schedules, and the message a degree that does not divide something gets. Config,
mesh, names, planner, monitor and the techniques read these; none restates them (house style: torchtitan's mesh axis
names).

Pure Python, the bottom layer with `config`: no torch, no Lightning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Axis:
    """One parallel dimension.

    Args:
        name: the config field, mesh axis and strategy-name part (``tp``, ...).
        what: what its ranks split, in a few words (error messages, docs).
        in_mesh: a dimension of the device mesh (``ep`` is not: it is carved out of the data-parallel ranks).
        splits_samples: its ranks see different samples (the sampler, loss averaging, metrics run over them).
    """

    name: str
    what: str
    in_mesh: bool
    splits_samples: bool


# Outermost first, the mesh's order (lightning_par.mesh): pp sends the least data, tp the most (adjacent ranks).
AXES: tuple[Axis, ...] = (
    Axis("pp", "pipeline stages", in_mesh=True, splits_samples=False),
    Axis("dp_replicate", "model replicas (HSDP's replicate dimension)", in_mesh=True, splits_samples=True),
    Axis("dp_shard", "data-parallel ranks that shard the model (ZeRO)", in_mesh=True, splits_samples=True),
    Axis("cp", "sequence chunks of the same samples", in_mesh=True, splits_samples=False),
    Axis("ep", "experts, over the data-parallel ranks", in_mesh=False, splits_samples=False),
    Axis("tp", "slices of each weight", in_mesh=True, splits_samples=False),
)
AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
MESH_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.in_mesh)
DATA_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.splits_samples)
# The axes that split the model, not the samples: the degrees a strategy name spells and the monitor logs. ``dp``
# (the data axes' product) goes beside them where a caller speaks of data parallelism as one degree.
MODEL_AXES: tuple[str, ...] = tuple(a.name for a in AXES if not a.splits_samples)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule of this suite (the torch class behind each: `lightning_par.parallel.pipeline.schedule`).

    Args:
        name: the ``pp_schedule`` value.
        virtual: stages per rank.
        style: ``"loop"`` (stage s on rank s mod pp) or ``"v"`` (rank r runs stages r and 2pp-1-r).
        split_backward: input and weight gradients run as separate passes (zero bubble).
        all_forwards_first: every microbatch's forward runs before any backward, so all are in flight at once.
        asynchronous: steps overlap: a step's forwards run beside the previous step's last backwards, whose
            gradient updates the weights one step late (PipeDream-2BW, `lightning_par.parallel.pipeline.two_bw`).
    """

    name: str
    virtual: int
    style: str
    split_backward: bool = False
    all_forwards_first: bool = False
    asynchronous: bool = False


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", 1, "loop", all_forwards_first=True),
        Schedule("1f1b", 1, "loop"),
        Schedule("interleaved_1f1b", 2, "loop"),
        Schedule("looped_bfs", 2, "loop", all_forwards_first=True),
        Schedule("interleaved_zb", 2, "loop", split_backward=True),
        Schedule("zbv", 2, "v", split_backward=True),
        Schedule("dualpipev", 2, "v", split_backward=True),
        Schedule("2bw", 1, "loop", asynchronous=True),
    )
}


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(n: int) -> str:
    """The divisors of ``n`` as a set literal for an error message: ``{1, 2, 3, 6}``."""
    return "{" + ", ".join(str(d) for d in divisors(n)) + "}"


def does_not_divide(degree: str, value: int, what: str, n: int, where: str = "") -> str:
    """The message for a degree that does not divide what it must, naming the values and the fix:
    ``tp=4 does not divide n_heads=6 in blocks.0.attn; choose tp in {1, 2, 3, 6}``."""
    at = f" in {where}" if where else ""
    return f"{degree}={value} does not divide {what}={n}{at}; choose {degree} in {choices(n)}"


def split_world(dims: tuple[str, ...], world_size: int, tp_cap: Optional[int] = None) -> dict[str, int]:
    """Split ``world_size`` over the named dimensions as evenly as possible in powers of two.

    The rule every registered name relies on (docs/strategies.md): factors of two go round-robin to the named
    model dimensions in the order ``tp``, ``cp``, ``pp``, ``dp`` (tp first because it wants the fast intra-node
    links, cp next because it exchanges keys and values every layer); data parallel takes whatever is left over
    (including any odd factor). ``ep`` is carved out of the data-parallel ranks and does not take a share of its
    own, but a name with ``ep`` gets data-parallel ranks as if it named ``dp`` (``tp_moe`` on 4 = tp 2 x dp 2, ep 2;
    ``pipe_moe`` on 4 = pp 2 x dp 2, ep 2, like ``pipe_zero1``).

    Args:
        dims: a subset of ``("pp", "tp", "cp", "dp", "ep")`` named by the strategy.
        world_size: number of processes.
        tp_cap: devices per node: tp grows only while it divides them (a tp group must not span nodes); its
            share goes on round-robin.

    Returns:
        degrees for ``pp``, ``tp`` and ``dp``, and for ``cp`` when it is named (the keys of the names without cp
        stay as they were).
    """
    # ep lives inside dp, so a name with ep asks for data-parallel ranks too (tp_moe on 4 = tp 2 x ep 2 over dp 2).
    order = [d for d in ("tp", "cp", "pp", "dp") if d in dims or (d == "dp" and "ep" in dims)]
    degrees = {"pp": 1, "tp": 1, "dp": 1, **({"cp": 1} if "cp" in dims else {})}
    twos = (world_size & -world_size).bit_length() - 1  # exponent of 2 in world_size
    turn = 0
    for _ in range(twos if order else 0):
        dim = order[turn % len(order)]
        if dim == "tp" and tp_cap is not None and tp_cap % (degrees["tp"] * 2):
            order.remove("tp")  # tp is as large as a node allows; the rest goes to the other dimensions
            if not order:
                break
            dim = order[turn % len(order)]
        degrees[dim] *= 2
        turn += 1
    degrees["dp"] *= world_size // math.prod(degrees.values())
    return degrees
