"""Where the trunk may be cut: what a stage would read that an earlier stage made.

Every stage runs the user's whole forward: blocks other stages own are pass-throughs (they return their first
argument), modules the first stage owns are stand-ins returning zeros (`pipeline.standins.shadow`), and the values that
cross a stage boundary are what the boundary's last block returns (the hidden state, and any other tensor it
returns that later code reads: T5's position bias), the outputs of first-stage modules that code after them reads
past the first stage (an encoder's output that every decoder block reads, an ``x0`` kept from the embedding), and
the side outputs `pipeline.sides` carries to the last stage. So a cut before block ``c`` keeps the one-process
values only if

1. block ``c``'s first argument is the very tensor block ``c - 1`` returned (no code between them changes it: a
   residual added around the blocks, a norm or a skip connection added in the gap), and
2. nothing that runs once block ``c - 1`` has ended (code between later blocks, later blocks, code after the trunk)
   reads a value computed from an earlier stage's work other than through what crosses the boundary: a U-Net's skip
   connections (block ``i``'s output kept and added back after block ``c``), a value computed between two blocks.

`CutRule` follows the ownership probe's forward (`pipeline.owners.find_ownership`) op by op. Each tensor carries the
earliest *position* its value comes from: ``-1`` for what the first stage's modules computed before the trunk,
``i`` for what block ``i`` computed (tensors made from the batch alone, rotary tables and masks, carry none: every
stage recomputes them). An op runs at position ``i`` inside block ``i``, ``i + 1`` between block ``i`` and the next,
and ``n`` after the trunk's ``n`` blocks; reading a value from position ``s`` at position ``p > s`` rules out every
cut in ``(s, p]``. Inside block ``c`` the hidden state it was handed counts as made at ``c`` (a stage starting there
receives it), and so does every other tensor block ``c - 1`` returned, from then on (the stand-in for block
``c - 1`` on that stage returns what it received). A value a first-stage module returned (and what code outside
first-stage modules computes from such values alone) is carried to every stage: reading it rules out no cut. The
reads that make a value travel are recorded: `returned_reads` (block, leaf of its flattened output) and
`carried_reads` (first-stage module, its call, leaf). The rule needs no shapes or values, only the order of calls,
so it runs on meta tensors too.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from torch import Tensor

from lightning_par import _compat

# Calls that read a tensor's metadata, never its values (their outputs depend on no position either).
SHAPE_ONLY = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "data_ptr", "get_device", "__len__", "__hash__", "__repr__",
    "__format__", "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "requires_grad_", "register_hook", "retain_grad",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Origin:
    position: int  # the earliest position the value comes from
    source: str  # what computed the value at that position (for messages)
    maker: str  # what made this very tensor (for messages)
    # At position -1: the first-stage modules' outputs (module, leaf) the value is computed from, when nothing else
    # of the first stage's work went into it (it can then be recomputed on any stage from the carried outputs).
    carried: Optional[frozenset[tuple[str, int, int]]] = None  # (module, call, leaf)


def _carried(origins: list[_Origin]) -> Optional[frozenset[tuple[str, int, int]]]:
    """The carried outputs a value made from ``origins`` (all at position -1) comes from, or ``None``."""
    if any(o.carried is None for o in origins):
        return None
    return frozenset().union(*(o.carried for o in origins if o.carried is not None))


class CutRule:
    """Follows one forward and collects, for each cut position ``1 .. n-1``, the first reason it is not exact.

    The probe calls `enter` / `leave` around each block and `op` for every torch call (module docstring).

    Args:
        names: the trunk blocks' qualified names, in order.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names, self.n = list(names), len(names)
        self.origin: dict[int, _Origin] = {}
        self._held: list[Tensor] = []  # keeps the ids in `origin` unique for the probe's lifetime
        self.position = 0
        self.inside: Optional[int] = None
        self._last: tuple[int, Optional[Tensor]] = (-1, None)  # the last block that returned, and its hidden state
        self._handed: Optional[tuple[Tensor, Optional[_Origin]]] = None  # the hidden state handed to the block running
        self.conflicts: dict[int, str] = {}  # cut (the block a stage would start at) -> why it is not exact
        self._returned: dict[int, list[tuple[int, int]]] = {}  # tensor id -> (block, leaf) of the outputs it was
        self.returned_reads: set[tuple[int, int]] = set()  # (block, leaf): read after the block, so carried
        self.carried_reads: set[tuple[str, int, int]] = set()  # (first-stage module, call, leaf): read past block 0
        self._unit_calls: dict[str, int] = {}

    # ---- blocks ------------------------------------------------------------------------------------------------
    def enter(self, i: int, args: tuple) -> None:
        """Block ``i`` starts with positional arguments ``args``."""
        self.position, self.inside = i, i
        hidden = args[0] if args else None
        if i == 0:  # the trunk's input: what block 0 computes from it is block 0's (for messages)
            if isinstance(hidden, Tensor) and id(hidden) in self.origin:
                self._handed = (hidden, self.origin[id(hidden)])
                self._set(hidden, _Origin(0, self.names[0], self.origin[id(hidden)].maker))
            return
        block, out = self._last
        if block == i - 1 and out is not None and hidden is out:
            self._handed = (hidden, self.origin.get(id(hidden)))
            self._set(hidden, _Origin(i, self.names[i], self.names[i - 1]))  # received by a stage starting at i
            return
        if not isinstance(hidden, Tensor):
            what = "no tensor as its first positional argument"
        elif (made := self.origin.get(id(hidden))) is not None and made.maker:
            what = f"a tensor made by {made.maker}"
        else:
            what = "another tensor"
        # The most direct reason a cut here fails: it replaces any read found earlier in the gap.
        self.conflicts[i] = (
            f"{self.names[i]} is called with {what} instead of what {self.names[i - 1]} returned, and "
            "a stage starting there receives only what the previous stage's last block returned"
        )

    def leave(self, i: int, out: Any) -> None:
        """Block ``i`` returned ``out``."""
        if self._handed is not None:
            hidden, before = self._handed
            self._handed = None
            if before is None:
                self.origin.pop(id(hidden), None)
            else:
                self.origin[id(hidden)] = before
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self._last = (i, first if isinstance(first, Tensor) else None)
        self.position, self.inside = i + 1, None
        if i + 1 < self.n and isinstance(out, (tuple, list)):
            # Its other tensors reach a stage starting at i + 1 through the stand-in for block i (`pipeline.sides`).
            for leaf, t in enumerate(_compat.tree_flatten(out)[0]):
                if leaf and isinstance(t, Tensor) and t is not first:
                    self._returned.setdefault(id(t), []).append((i, leaf))
                    was = self.origin.get(id(t))
                    self._set(t, _Origin(i + 1, was.source if was else self.names[i], self.names[i]))

    def unit_output(self, unit: str, out: Any) -> None:
        """First-stage module ``unit`` returned ``out``: its tensors can be carried to every stage."""
        call = self._unit_calls[unit] = self._unit_calls.get(unit, -1) + 1
        leaves = [out] if isinstance(out, Tensor) else _compat.tree_flatten(out)[0]
        for leaf, t in enumerate(leaves):
            if isinstance(t, Tensor):
                self._set(t, _Origin(-1, unit, unit, frozenset({(unit, call, leaf)})))

    # ---- torch calls -------------------------------------------------------------------------------------------
    def op(self, name: str, reads: Iterable[Tensor], outs: Iterable[Tensor], *, where: str, first_stage: bool) -> None:
        """A torch call ``name`` read ``reads`` and made (or wrote) ``outs``.

        Args:
            where: what ran the call, for messages (the innermost module, or the code between blocks).
            first_stage: the call ran inside a module the first stage owns, or read its parameters, before the
                trunk: other stages compute it from stand-ins.
        """
        if name in SHAPE_ONLY:
            return
        earliest: Optional[_Origin] = None
        carried: list[_Origin] = []  # carried first-stage outputs read: no position (recomputed from them anywhere)
        for t in reads:
            came = self.origin.get(id(t))
            if came is None:
                continue
            if id(t) in self._returned:  # a block's returned tensor, read after it: carried at the boundary
                self.returned_reads.update(r for r in self._returned[id(t)] if r[0] < self.position)
            if came.position == -1 and came.carried is not None:
                if self.position > 0:  # past the first block: a later stage needs it
                    self.carried_reads.update(came.carried)
                carried.append(came)
                continue
            self._read(came, f"{where} reads, in {name}(), a value {came.source} computed")
            if earliest is None or came.position < earliest.position:
                earliest = came
        if first_stage:
            earliest = _Origin(-1, where, where)
        elif self.inside is not None and (earliest is None or self.inside < earliest.position):
            earliest = _Origin(self.inside, where, where)
        elif earliest is None and carried:  # code outside the blocks on carried values alone
            earliest = _Origin(-1, carried[0].source, where, _carried(carried))
        if earliest is None:
            return
        maker = f"{name}() in {where}" if self.inside is None else where
        for t in outs:
            before = self.origin.get(id(t))
            if before is None or earliest.position < before.position:
                self._set(t, dataclasses.replace(earliest, maker=maker))
            elif before.position < earliest.position:
                self._set(t, dataclasses.replace(before, maker=maker))
            else:  # written in place, both at one position: carried only if both are
                both = _carried([before, earliest]) if earliest.position == -1 else None
                self._set(t, _Origin(earliest.position, earliest.source, maker, both))

    def _set(self, t: Tensor, origin: _Origin) -> None:
        if id(t) not in self.origin:
            self._held.append(t)
        self.origin[id(t)] = origin

    def _read(self, came: _Origin, what: str) -> None:
        for cut in range(max(came.position + 1, 1), min(self.position, self.n - 1) + 1):
            self._refuse(
                cut,
                f"{what}, which a stage starting at {self.names[cut]} does not have (it receives only "
                f"what {self.names[cut - 1]} returns, as {self.names[cut]}'s first argument)",
            )

    def _refuse(self, cut: int, why: str) -> None:
        self.conflicts.setdefault(cut, why)


def allowed_cuts(n_blocks: int, conflicts: Mapping[int, str]) -> list[int]:
    """The block indices a stage may start at (``1 .. n_blocks - 1``, less the conflicting ones)."""
    return [c for c in range(1, n_blocks) if c not in conflicts]


def refused_split(
    conflicts: Mapping[int, str], names: Sequence[str], ranges: Sequence[tuple[int, int]]
) -> Optional[str]:
    """Why a split's stage boundaries are not exact (`CutRule`), naming the reader and a split that is; ``None`` when
    every boundary is."""
    for start, _ in ranges[1:]:
        if start in conflicts:
            return (f"the pipeline cannot cut the trunk before {names[start]}: {conflicts[start]}. "
                    f"{_fix(len(names), conflicts, len(ranges))}")  # fmt: skip
    return None


def _fix(n_blocks: int, conflicts: Mapping[int, str], n_stages: int) -> str:
    allowed = allowed_cuts(n_blocks, conflicts)
    if len(allowed) >= n_stages - 1:
        bounds = [0, *_spread(allowed, n_stages - 1, n_blocks), n_blocks]
        sizes = tuple(b - a for a, b in itertools.pairwise(bounds))
        return (f"Cut only before blocks {allowed} (e.g. pp_split={sizes}; the automatic split does so), or train "
                "without pipeline parallelism (e.g. strategy='zero3')")  # fmt: skip
    if allowed:
        return (f"Only {len(allowed)} cut(s) keep the values (before blocks {allowed}): use at most {len(allowed) + 1} "
                "pipeline stages, or train without pipeline parallelism (e.g. strategy='zero3')")  # fmt: skip
    return "No cut of this trunk keeps the values: train without pipeline parallelism (e.g. strategy='zero3')"


def _spread(allowed: list[int], k: int, n_blocks: int) -> list[int]:
    """``k`` of the ``allowed`` cuts, each the nearest to an even split's that leaves enough for the later ones."""
    picks: list[int] = []
    for j in range(k):
        target = (j + 1) * n_blocks / (k + 1)
        options = [c for i, c in enumerate(allowed) if (not picks or c > picks[-1]) and len(allowed) - i >= k - j]
        picks.append(min(options, key=lambda c: (abs(c - target), c)))
    return picks


def no_split_possible(conflicts: Mapping[int, str], names: Sequence[str], n_stages: int) -> Optional[str]:
    """Why no split of the trunk into ``n_stages`` stages is exact, or ``None`` when one is."""
    if len(allowed_cuts(len(names), conflicts)) >= n_stages - 1:
        return None
    cut = min(conflicts)
    return (f"the pipeline cannot cut the trunk before {names[cut]}: {conflicts[cut]}. "
            f"{_fix(len(names), conflicts, n_stages)}")  # fmt: skip
