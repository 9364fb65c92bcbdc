"""Fewer key/value heads than tp ranks (multi-query attention, grouped-query attention with ``n_kv_heads < tp``):
each key/value head is replicated over the ranks whose query heads read it.

Megatron-LM does the same for grouped-query attention (``num_query_groups`` smaller than the tensor-parallel size:
each rank computes the one group its heads belong to). With ``n_heads % tp == 0`` and ``tp % n_kv_heads == 0``, rank
``r`` holds query heads ``[r * n_heads / tp, (r + 1) * n_heads / tp)``, all of which read key/value head
``g = r // (tp / n_kv_heads)``, so it computes exactly that head's rows of the key and value projections. The weight
is stored as a plain ``Shard`` of the output dim (the model's layout: checkpoints see the full tensor) and each
forward all-gathers it and keeps rows ``g`` (`affine._GatherParts`); its backward reduce-scatters the gradient, which
sums what every rank sharing the head contributed: the exact gradient of the replicated head. The query projection
is split as usual, the output projection by rows as usual.
"""

from __future__ import annotations

import torch

from lightning_par.parallel.tensor.plan_types import HeadInfo, TPPlanError


def kv_replicas(head: HeadInfo, tp: int) -> int:
    """How many tp ranks share each key/value head: 1 when tp divides ``n_kv_heads``.

    Raises:
        TPPlanError: ``n_kv_heads`` and tp divide neither way (no rank's query heads would all read one k/v head).
    """
    if head.n_kv_heads % tp == 0:
        return 1
    grouped = len(head.projections) == 2 and head.projections[0] not in head.fused_split
    if tp % head.n_kv_heads == 0 and head.n_heads % tp == 0 and not grouped:
        return tp // head.n_kv_heads
    if grouped:
        # One projection whose output is laid out group by group (older litgpt, GPT-NeoX): a column split gives each
        # rank whole groups, which needs tp to divide the groups.
        raise TPPlanError(
            f"tp={tp} does not divide n_kv_heads={head.n_kv_heads}, and {head.projections[0]} lays its output out "
            f"one k/v group at a time; choose tp in {{{', '.join(str(t) for t in _divisors(head.n_kv_heads))}}}"
        )
    raise TPPlanError(
        f"tp={tp} with n_heads={head.n_heads}, n_kv_heads={head.n_kv_heads}: each rank needs whole query heads that "
        "all read one key/value head (tp dividing n_kv_heads, or n_kv_heads dividing tp and tp dividing n_heads); "
        f"choose tp in {{{', '.join(str(t) for t in _valid(head))}}}"
    )


def _divisors(n: int) -> list[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


def _valid(head: HeadInfo) -> list[int]:
    return [t for t in range(1, head.n_heads + 1) if head.n_heads % t == 0 and (head.n_kv_heads % t == 0 or
                                                                              t % head.n_kv_heads == 0)]  # fmt: skip


def kv_parts(head: HeadInfo, key: str) -> tuple[bool, ...] | None:
    """For projection ``key`` of ``head``: which parts of its output are key/value heads (``(False, True, True)`` for a
    fused ``[q | k | v]``, ``(True, True)`` for a fused ``[k | v]``, ``(True,)`` for a separate k or v); ``None`` for
    the query and output projections."""
    if key in head.fused_split:
        widths = head.fused_split[key]
        return (False, True, True) if len(widths) == 3 else (True,) * len(widths)
    ins = head.projections[:-1]
    if len(ins) == 3 and key in ins[1:]:  # separate q, k, v (in that order: plan_pairs.by_hint)
        return (True,)
    return None


def part_rows(widths: tuple[int, ...], kv: tuple[bool, ...], tp: int, replicas: int, rank: int) -> torch.Tensor:
    """Indices, in the projection's full output dim, of the rows rank ``rank`` keeps: its slice of each query part,
    and of each key/value part the slice of its head group (``replicas`` ranks per slice)."""
    rows = []
    offset = 0
    for width, is_kv in zip(widths, kv):
        shares, index = (tp // replicas, rank // replicas) if is_kv else (tp, rank)
        step = width // shares
        rows.append(torch.arange(offset + index * step, offset + (index + 1) * step))
        offset += width
    return torch.cat(rows)


def local_width(width: int, kv: tuple[bool, ...], widths: tuple[int, ...], tp: int, replicas: int) -> int:
    """The width of a projection's output on one rank (``width`` its full output)."""
    return sum(w // ((tp // replicas) if is_kv else tp) for w, is_kv in zip(widths or (width,), kv))


def local_count(kind: str, value: int, head: HeadInfo, tp: int) -> int:
    """The per-rank value of a head-count attribute of kind ``kind`` (`HeadInfo.local_attrs`)."""
    replicas = kv_replicas(head, tp)
    if kind == "n_kv_heads":
        return value // tp if replicas == 1 else 1
    if kind == "kv_groups":  # query heads per key/value head: the rank's query heads all read its one k/v head
        return value if replicas == 1 else head.n_heads // tp
    if kind == "split_width" and replicas > 1 and value != head.n_heads * head.head_dim:
        return value // head.n_kv_heads  # a key/value part's width: one head of it
    return value // tp
