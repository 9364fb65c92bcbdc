"""Replica consistency: the parameters several ranks must hold identically, compared by a fingerprint of their bits.

Data-parallel replicas, tensor-parallel ranks holding a replicated norm, context-parallel ranks, the pipeline
stages that each keep a copy of a tied embedding: all of them hold copies that training keeps bit-identical (every
copy receives the same reduced gradient and takes the same optimizer step). A copy that drifts anyway is the mark
of bad hardware (a flipped bit in memory, a faulty GPU) or of a non-deterministic computation inside what should be
replicated, and it trains on silently: large runs compare fingerprints periodically for this reason.

Which ranks must agree is read off each tensor, never from a table of layouts. A DTensor's local tensor is
identified by the parameter's name and this rank's coordinates on the mesh dimensions whose placement is not
``Replicate`` (two ranks with the same coordinates there hold the same shard); a plain tensor is whole, unless
``distribute`` describes it as a DTensor (expert parallelism's shards). Ranks holding the same identity must
hold the same bits.

The fingerprint of a tensor is two integer sums of its elements' bit patterns (every element, and every other
element): exact, so any changed element changes the first (the check never reports rounding), and a swap of two
elements at positions of different parity changes the second. It costs one read of each parameter and one
gather of a few integers per parameter: measured in docs/benchmarks.md ("Replica check").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

Distribute = Callable[[str, Any], Any]  # (name, tensor) -> the tensor as a DTensor, or as it was
Identity = tuple[str, tuple[tuple[str, int], ...]]  # (parameter name, (mesh dim name, coordinate) per sharded dim)

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDiverged(RuntimeError):
    """Copies of parameters that must be identical on several ranks differ; the message names them and the ranks."""


def identity(name: str, tensor: Tensor) -> Optional[Identity]:
    """What makes two ranks' copies of ``tensor`` the same piece of parameter ``name``: the name, plus for a DTensor
    this rank's coordinate on each mesh dimension that splits it. ``None`` for a rank that holds none of it."""
    if not isinstance(tensor, DTensor):
        return (name, ())
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return (name, tuple((names[i], coordinate[i]) for i, p in enumerate(tensor.placements) if not p.is_replicate()))


def fingerprints(named: Iterable[tuple[str, Tensor]], distribute: Optional[Distribute] = None,
                 ) -> dict[Identity, tuple[int, int]]:  # fmt: skip
    """The fingerprint of each tensor this rank holds, by identity (one device-to-host copy in all)."""
    keys: list[Identity] = []
    sums: list[Tensor] = []
    for name, tensor in named:
        if distribute is not None and not isinstance(tensor, DTensor):
            tensor = distribute(name, tensor)
        key = identity(name, tensor)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if key is None or local.is_meta or local.numel() == 0:
            continue
        bits = local.detach().contiguous().view(_BITS[local.element_size()]).reshape(-1)
        keys.append(key)
        sums.append(torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]))
    values = torch.stack(sums).cpu().tolist() if sums else []
    return {key: (int(a), int(b)) for key, (a, b) in zip(keys, values)}


def check_replicas(module: nn.Module, distribute: Optional[Distribute] = None,
                   group: Optional[dist.ProcessGroup] = None, *, names: Optional[Mapping[str, str]] = None,
                   step: Optional[int] = None) -> int:  # fmt: skip
    """Compare every parameter of ``module`` with the copies other ranks of ``group`` (default: all) hold.

    Collective over ``group``: every rank gathers every fingerprint, so every rank reaches the same verdict and
    raises the same error (none waits for a rank that stopped).

    Args:
        module: the parallelized model (parameters as this rank holds them: DTensors, shards or whole tensors).
        distribute: how plain shards are described as DTensors (`ParallelRun.distribute_model`).
        group: the ranks to compare; ``None``: the default group.
        names: parameter names this rank holds under another name than other ranks do -> the common name (a tied
            weight's copy on the last pipeline stage: `ParallelRun.one_process_names`).
        step: the optimizer step, for the message.

    Returns:
        the number of parameter pieces held by more than one rank (and so compared).

    Raises:
        ReplicasDiverged: naming the first parameters (in the model's order) whose copies differ, which ranks hold
            the odd copy, and what to do.
    """
    rename = names or {}
    named = [(rename.get(n, n), p) for n, p in module.named_parameters()]
    mine = fingerprints(named, distribute)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (dist.get_rank(), mine), group=group)
    holders: dict[Identity, dict[tuple[int, int], list[int]]] = {}
    for rank, prints in every:
        for key, value in prints.items():
            holders.setdefault(key, {}).setdefault(value, []).append(rank)
    order = {name: i for i, (name, _) in enumerate(named)}
    compared = [k for k, by_value in holders.items() if sum(len(r) for r in by_value.values()) > 1]
    diverged = sorted((k for k in compared if len(holders[k]) > 1), key=lambda k: (order.get(k[0], len(order)), k))
    if diverged:
        raise ReplicasDiverged(_report(diverged, holders, step))
    return len(compared)


def _report(diverged: list[Identity], holders: dict[Identity, dict[tuple[int, int], list[int]]],
            step: Optional[int]) -> str:  # fmt: skip
    lines = []
    suspects: Counter[int] = Counter()
    for name, shard in diverged[:5]:
        groups = sorted(holders[(name, shard)].values(), key=lambda ranks: (-len(ranks), ranks))
        where = "".join(f" [{dim} {i}]" for dim, i in shard)
        if len(groups[0]) > len(groups[1]):  # a majority: the others hold the odd copies
            odd = sorted(r for ranks in groups[1:] for r in ranks)
            suspects.update(odd)
            lines.append(f"  {name}{where}: rank(s) {odd} differ from rank(s) {sorted(groups[0])}")
        else:
            lines.append(f"  {name}{where}: " + " vs ".join(f"rank(s) {sorted(r)}" for r in groups))
    more = f"\n  ... and {len(diverged) - 5} more" if len(diverged) > 5 else ""
    blame = f"Ranks holding the odd copies most often: {[r for r, _ in suspects.most_common(3)]}. " if suspects else ""
    when = f" after optimizer step {step}" if step is not None else ""
    return (
        f"replica check{when}: {len(diverged)} parameter(s) that must be identical on several ranks differ:\n"
        + "\n".join(lines)
        + more
        + f"\n{blame}This is the mark of failing hardware (memory, a GPU) or of a "
        "non-deterministic operation inside a replicated computation. Resume from the last checkpoint (saved "
        "before the divergence) on other machines; if it recurs on healthy ones, report it with this message."
    )
