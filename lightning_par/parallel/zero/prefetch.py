"""ZeRO 1-2: the parameter all-gather after the optimizer step, overlapped with the next forward.

After ``optimizer.step()`` each rank holds the updated rows of its own shard only; the other rows arrive by an
all-gather. Done at once (`ReplicatedZero.gather_params`) that all-gather is serial time on every step. Here it is
started instead, in units of the model's trunk blocks (FSDP2's communication units): one for what lies outside
every block (embeddings, head, final norm; needed first), then one per block in execution order. A unit is waited
for where its weights are first needed: the step's start for the outer unit (`wait_first`), a forward pre-hook on
the block for a block's unit, so block k's gather overlaps the forward of blocks 0..k-1 (FSDP2's prefetch
pattern; Zhao et al., "PyTorch FSDP", arXiv 2304.11277, section 4.2).

The contract (docs/strategies.md, "When the weights are complete"): anything that reads weights outside a block's own
forward must call `wait_all` first. The Trainer glue does so before every hook of user code between the step and
the next forward (`lightning_par.strategies._param_window`). A weight read inside the forward but outside its
block (a parent module using a child's parameter) is caught on the first deferred step, which runs under a
`TorchFunctionMode` that sees every op's arguments: such a read waits for everything, warns, and turns the
deferral off for the run, so no op ever computes on stale rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.parallel.zero.buckets import Bucket

Gather = Callable[..., Any]  # collectives.all_gather_single(out, in, group=, async_op=, skip_own=)


class _Unit:
    """The parameters gathered together: a block's, or those outside every block."""

    def __init__(self, params: list[nn.Parameter], masters: dict[nn.Parameter, nn.Parameter], world: int,
                 rank: int) -> None:  # fmt: skip
        self.layout = Bucket(params, world, rank)  # rank-major, the layout the masters' rows were cut by
        self.masters = [masters[p] for p in params]
        self.send: Optional[torch.Tensor] = None  # this rank's rows, packed; kept across steps (1/world of the unit)
        self.ids = frozenset(id(p) for p in params)


class ParamPrefetch:
    """Started all-gathers of a ZeRO 1-2 engine's parameters, waited per trunk block.

    Args:
        params: the engine's trainable parameters (full tensors, or tp-local DTensors), in model order.
        masters: each parameter's master (the view of this rank's rows the optimizer steps).
        blocks: the trunk blocks in execution order (may be empty: one unit, waited at the step's start).
        group: the ``dp_shard`` group; ``world`` and ``rank`` its size and this rank's index.
    """

    def __init__(self, params: Sequence[nn.Parameter], masters: dict[nn.Parameter, nn.Parameter],
                 blocks: Sequence[nn.Module], group: dist.ProcessGroup, world: int, rank: int) -> None:  # fmt: skip
        self.group, self.world = group, world
        wanted = set(params)
        seen: set[nn.Parameter] = set()
        per_block: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for block in blocks:
            # A parameter shared by two blocks belongs to the first: waiting for a later unit waits for earlier ones.
            mine = [p for p in block.parameters() if p in wanted and p not in seen]
            seen.update(mine)
            if mine:
                per_block.append((block, mine))
        outer = [p for p in params if p not in seen]
        groups = ([outer] if outer else []) + [ps for _, ps in per_block]
        self.units = [_Unit(ps, masters, world, rank) for ps in groups]
        self._first = 1 if outer else 0  # units to wait for at the step's start
        self._pending: list[tuple[Any, _Unit, torch.Tensor]] = []
        self._waited = 0  # units of the pending gather already unpacked
        self.enabled = True
        self._check_next = True  # the first deferred step runs under `_StaleReadCheck`
        self.stats = {"deferred": 0, "waited_in_forward": 0, "waited_outside": 0}
        self._hooks = [
            block.register_forward_pre_hook(self._pre_hook(i + self._first)) for i, (block, _) in enumerate(per_block)
        ]

    @property
    def pending(self) -> bool:
        """A gather was started and not all of it has arrived."""
        return self._waited < len(self._pending)

    @torch.no_grad()
    def launch(self, gather: Gather) -> None:
        """Start every unit's all-gather from the masters' current values, outer unit first; return at once.
        ``gather``: the flat all-gather (`collectives.all_gather_single`, looked up per call: byte counters patch
        it); this rank's own rows are in place already and are skipped."""
        self.wait_all()
        self._pending, self._waited = [], 0
        for unit in self.units:
            dtype = unit.layout.params[0].dtype
            if unit.send is None:
                unit.send = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.layout.data[0].device)
            _compat.foreach_copy(unit.layout.shard_views(unit.send), unit.masters)
            recv = torch.empty(self.world, unit.layout.shard_numel, dtype=dtype, device=unit.send.device)
            work = gather(recv.view(-1), unit.send, group=self.group, async_op=True, skip_own=True)
            self._pending.append((work, unit, recv))
        self.stats["deferred"] += 1

    @torch.no_grad()
    def wait_until(self, index: int) -> None:
        """Unpack units ``0 .. index`` of the pending gather (the collectives complete in the order started)."""
        while self._waited <= index and self._waited < len(self._pending):
            work, unit, recv = self._pending[self._waited]
            work.wait()
            unit.layout.unpack(recv)
            self._pending[self._waited] = (None, unit, recv[:0])  # drop the buffer: the unit is in place
            self._waited += 1

    def wait_all(self) -> None:
        """Make every parameter complete (before anything reads weights outside the forward)."""
        if self.pending:
            self.stats["waited_outside"] += 1
            self.wait_until(len(self._pending) - 1)

    def wait_first(self) -> Any:
        """At the step's start: wait for the units outside every block; returns a context to run the step in
        (the stale-read check on the first deferred step, else nothing)."""
        if self.pending:
            self.wait_until(self._first - 1)
        if self._check_next and self.pending:
            self._check_next = False
            return _StaleReadCheck(self)
        return _NoCheck()

    def _pre_hook(self, index: int) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            if self._waited <= index < len(self._pending):
                self.stats["waited_in_forward"] += 1
                self.wait_until(index)

        return hook

    def stale(self, args: Any) -> Optional[int]:
        """The id of a parameter among ``args`` whose rows have not arrived yet, if any."""
        waiting = [u.ids for _, u, _ in self._pending[self._waited :]]
        for a in _compat.tree_leaves(args):
            if isinstance(a, torch.Tensor) and any(id(a) in ids for ids in waiting):
                return id(a)
        return None

    def disable(self, what: str) -> None:
        """Stop deferring for this run, after waiting for what is in flight."""
        self.wait_all()
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"lightning_par: {what} before its block's forward, so ZeRO no longer overlaps the parameter "
                "all-gather with the forward in this run (every step gathers before it continues; results are "
                "unchanged). Read weights inside the forward of the block that holds them, or call "
                "trainer.strategy.wait_for_params() first (docs/strategies.md)",
                stacklevel=2,
            )


class _NoCheck:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _StaleReadCheck(TorchFunctionMode):
    """Sees every op of one step: an op reading a parameter whose rows are still in flight waits for all of them
    first (so it computes on complete weights) and turns the deferral off."""

    def __init__(self, prefetch: ParamPrefetch) -> None:
        super().__init__()
        self.prefetch = prefetch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.prefetch.pending and self.prefetch.stale((args, kwargs)) is not None:
            self.prefetch.disable(f"a parameter was read by {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)
