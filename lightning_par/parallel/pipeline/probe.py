"""The ownership probe: one forward of the whole model, recording what each torch call reads and where it runs.

`pipeline.owners.find_ownership` reads its record: which units ran before, inside or after the trunk, the call order
of the blocks, what each block was called with and returned, the tensors made inside the trunk and read after it,
and (through `pipeline.cuts.CutRule`) which cuts keep the one-process values. A block may stand at several places of
the trunk (`Trunk.calls`: a block that runs more than once); each call is then recorded at its own place.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.blocks._probe import eval_mode, writes_in_place
from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.pipeline.cuts import CutRule

__all__ = ["Units", "Uses", "probe_forward"]

Units = list[tuple[str, nn.Module]]


class Uses(TorchFunctionMode):
    """Records which units' parameters each torch call reads, and in which phase (before / in / after the trunk).

    A use inside a unit's forward counts for that unit alone: a tied weight is read by the embedding before the
    trunk and by the head after it, and each of the two units is placed by its own calls.
    """

    def __init__(self, unit_of: dict[int, set[str]], trunk: Trunk) -> None:
        super().__init__()
        self.unit_of, self.phase = unit_of, "pre"
        self.cuts = CutRule(trunk.names)  # which cuts keep the one-process values
        self.seen: dict[str, set[str]] = {}
        self.running: list[str] = []
        # Side outputs: tensors computed inside the trunk (by the module named) and read after it, other than
        # what the last block returns. The pipeline hands on only the hidden state, so the last stage would not
        # have them (router logits collected for a load-balancing loss, every layer's hidden states).
        self.made: dict[int, tuple[Tensor, str]] = {}  # the tensors are held so that their ids stay unique
        self.handed_on: set[int] = set()
        self.makers: list[str] = []
        self.side: list[tuple[int, str, str]] = []  # (tensor id, producer, consumer)
        # The innermost module inside a block that returned each tensor: (block, path in it, leaf, output spec).
        self.returned_by: dict[int, tuple[int, str, int, Any]] = {}
        self.calls: dict[int, tuple[tuple, dict, Any]] = {}  # block -> its first call's (args, kwargs, output)
        self.order: list[int] = []  # the blocks, in the order the forward calls them
        self.block = -1  # the block running now, or the last one that ran
        self.paused = False  # the probe's own tensor work (`_record_inputs`), not the model's

    def mark(self, unit: str) -> None:
        self.seen.setdefault(unit, set()).add(self.phase)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = getattr(func, "__name__", str(func))
        # Reading an attribute that is not a tensor (shape, dtype, device) uses no values; `.T` does.
        if name != "__get__" or isinstance(out, Tensor):
            reads = [t for t in _compat.tree_flatten((args, kwargs or {}))[0] if isinstance(t, Tensor)]
            for t in reads:
                self._used(t, name)
            self._follow(name, args, reads, out)
        if self.phase == "trunk":
            for t in _compat.tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.made.setdefault(id(t), (t, self.makers[-1] if self.makers else "the trunk"))
        return out

    def _follow(self, name: str, args: Any, reads: list[Tensor], out: Any) -> None:
        outs = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, Tensor)]
        if args and isinstance(args[0], Tensor) and writes_in_place(name):
            outs.append(args[0])
        else:  # a call that hands back a tensor it read (`.to()` the device it is on, Llama-4's rotary table in
            # every attention) makes nothing: the tensor keeps where it came from
            outs = [t for t in outs if not any(t is r for r in reads)]
        if self.phase == "post":  # side outputs are carried to the last stage (`_side_slots`)
            reads = [t for t in reads if not self.carried(t)]
        first_stage = self.phase == "pre" and (bool(self.running) or any(id(t) in self.unit_of for t in reads))
        where = self.running[-1] if self.running else self._where()
        self.cuts.op(name, reads, outs, where=where, first_stage=first_stage)

    def _where(self) -> str:
        cuts = self.cuts
        if cuts.inside is not None:
            return self.makers[-1] if self.makers else cuts.names[cuts.inside]
        if self.phase == "pre":
            return "the code before the trunk"
        if self.phase == "post":
            return "the code after the trunk"
        return f"the code between {cuts.names[cuts.position - 1]} and {cuts.names[cuts.position]}"

    def carried(self, t: Tensor) -> bool:
        """Whether ``t`` (read after the trunk) is a side output the stages carry: made inside the trunk, not handed
        on by the last block, and returned by a module inside a block (the module a stage replays)."""
        where = self.returned_by.get(id(t))
        return id(t) in self.made and id(t) not in self.handed_on and where is not None and where[1] != ""

    def _used(self, t: Tensor, by: str) -> None:
        holders = self.unit_of.get(id(t), ())
        inside = self.running[-1] if self.running and self.running[-1] in holders else None
        for unit in (inside,) if inside is not None else holders:
            self.mark(unit)
        if self.phase == "post" and self.carried(t):
            self.side.append((id(t), self.made[id(t)][1], by))

    def left(self, block: int, path: str, out: Any) -> None:
        """A module inside block ``block`` returned ``out`` (inner modules return first: the first record stays)."""
        self.makers.pop()
        if self.phase != "trunk":
            return
        leaves, spec = _compat.tree_flatten(out)
        for j, t in enumerate(leaves):
            if isinstance(t, Tensor) and id(t) in self.made:
                self.returned_by.setdefault(id(t), (block, path, j, spec))


def _leaver(uses: Uses, path: str) -> Callable[..., None]:
    def leave(_m: nn.Module, _a: Any, out: Any) -> None:  # returning a value would replace the module's output
        uses.left(uses.block, path, out)

    return leave


def _record_call(
    calls: dict[int, tuple[tuple, dict, Any]], i: int, _m: nn.Module, args: tuple, kwargs: dict, out: Any
) -> None:
    if i in calls and calls[i][2] is None:  # the inputs as the block got them (`_record_inputs`), then its output
        calls[i] = (*calls[i][:2], out)  # returns nothing: a forward hook's result would replace the output


def _record_inputs(uses: Uses, i: int, _m: nn.Module, args: tuple, kwargs: dict) -> None:
    if i in uses.calls:
        return
    # An object the block changes in place (a key/value cache that Hugging Face T5 passes to every block even in
    # training) is kept as it was before the call: what a stand-in for the block is called with in a stage.
    plain = (Tensor, type(None), bool, int, float, str)
    if not all(isinstance(x, plain) for x in _compat.tree_flatten((args, kwargs))[0]):
        uses.paused = True  # the copy is the probe's, not the model's: no reads for the cut rule
        try:
            args, kwargs = copy.deepcopy((args, kwargs))
        except Exception:  # not copyable: as it is
            pass
        finally:
            uses.paused = False
    uses.calls[i] = (args, kwargs, None)


def probe_forward(module: nn.Module, trunk: Trunk, units: Units, run: Callable[[], Any]) -> Uses | str:
    unit_of: dict[int, set[str]] = {}
    for name, m in units:
        for p in m.parameters():
            unit_of.setdefault(id(p), set()).add(name)
    uses = Uses(unit_of, trunk)

    # A block may stand at several places of the trunk (a trunk of calls, `Trunk.calls`): each call is the next of
    # its places after the last call's (the forward runs them in order; a place reached again shows in the order).
    places: dict[int, list[int]] = {}
    for v, block in enumerate(trunk.blocks):
        places.setdefault(id(block), []).append(v)
    last = len(trunk.blocks) - 1
    handles = []

    def block_in(m: nn.Module, args: tuple, kwargs: dict) -> None:
        mine = places[id(m)]
        v = next((p for p in mine if p > uses.order[-1]), mine[0]) if uses.order else mine[0]
        uses.block = v
        if v == 0 and uses.phase == "pre":
            uses.phase = "trunk"
        uses.cuts.enter(v, args)  # where each torch call runs, for the cut rule
        uses.order.append(v)
        # What each block was called with and returned: what a stage that does not run it must hand on.
        _record_inputs(uses, v, m, args, kwargs)

    def block_out(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        v = uses.block
        if v == last:
            uses.phase = "post"
            uses.handed_on.update(id(t) for t in _compat.tree_flatten(out)[0] if isinstance(t, Tensor))
        uses.cuts.leave(v, out)
        _record_call(uses.calls, v, m, args, kwargs, out)

    unique = {id(b): (n, b) for n, b in zip(trunk.names, trunk.blocks)}
    for _, block in unique.values():
        handles.append(block.register_forward_pre_hook(block_in, with_kwargs=True))
        handles.append(block.register_forward_hook(block_out, with_kwargs=True))
    for prefix, block in unique.values():  # which module inside made each tensor
        for sub_name, sub in block.named_modules():
            where = f"{prefix}.{sub_name}" if sub_name else prefix
            handles.append(sub.register_forward_pre_hook(lambda *_, w=where: uses.makers.append(w)))
            handles.append(sub.register_forward_hook(_leaver(uses, sub_name)))

    def called(name: str) -> None:  # a unit called without touching its parameters still runs where it is called
        uses.mark(name)
        uses.running.append(name)

    def returned(name: str, _m: nn.Module, _a: Any, out: Any) -> None:
        uses.running.pop()
        if uses.phase == "pre":  # what a first-stage module returns can be carried to every stage
            uses.cuts.unit_output(name, out)

    for name, m in units:
        handles.append(m.register_forward_pre_hook(lambda *_, n=name: called(n)))
        handles.append(m.register_forward_hook(partial(returned, name)))
    device = next(module.parameters()).device
    try:
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with eval_mode(module), torch.no_grad(), rng, uses:
            run()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        for h in handles:
            h.remove()
    if uses.phase != "post":
        return "the forward did not run the trunk to its last block"
    return uses
