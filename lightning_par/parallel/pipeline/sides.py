"""Side outputs of the trunk carried down the pipeline with the hidden state (router logits for a load-balancing
loss).

Hugging Face MoE models with ``output_router_logits=True`` record every layer's router logits with forward hooks on
the router modules (transformers' ``OutputRecorder``) and compute a load-balancing loss from all of them after the
trunk. That loss is not a sum over layers (a product of means over all layers' logits), so no stage can compute its
share: the last stage needs every layer's logits, each microbatch its own. `pipeline.owners.find_ownership` names
the producers (`SideSlot`: a tensor a module inside a block returns and code after the trunk reads); here:

- a stage's output is the hidden state followed by the side tensors of every block before its end (the ones it
  received, passed on, then the ones its own blocks made, captured by a forward hook on each producer), and its
  input the same up to its start, so gradients flow back along the same edges as the hidden state's;
- where a block is a pass-through (another stage runs it), each of its producers is *replayed* at the block's place
  in the user's forward: a meta-device copy of it made at the cut (`pipeline.meta.meta_copy`, forward hooks
  included: transformers installs its recorder on the probe's forward) is called with its forward replaced by one
  that returns the received tensors (the output's other leaves ``None``), so that the hooks (the recorder) fire
  with them, in the one-process order. On a rank that does not hold the block the copy also sits under the
  pass-through at the producer's path, where a recorder that installs its hooks later finds it;
- the shapes the schedule allocates receive buffers with come from one forward of each stage, without gradients, on
  zeros of the hidden state's shape (`measure`), gathered over the pipeline group; a microbatch whose side tensor
  has another shape is refused.

A capture hook is registered at the cut; expert parallelism later prepends its gather of router logits over the
token group (`experts.router_stats`: dp, times cp under context parallelism) to the router's hooks, so what is captured
and carried is the gathered tensor, the same on every rank of that group: under cp the whole microbatch's tokens,
never this rank's sequence chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn

from lightning_par import _compat
from lightning_par.blocks.trunk import Trunk
from lightning_par.nn.moe import MoE
from lightning_par.parallel.pipeline.meta import meta_copy
from lightning_par.parallel.pipeline.slots import PipelineError, SideSlot

Meta = tuple[tuple[int, ...], torch.dtype]


@dataclasses.dataclass
class _Run:
    start: int
    end: int
    received: dict[int, Tensor]  # slot index -> tensor from the previous stage
    made: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)  # first-stage module -> its calls so far


class SideCarrier:
    """Captures, sends on and replays the trunk's side outputs for the stages of one rank (module docstring).

    Args:
        slots: the side outputs (`Ownership.sides`).
        trunk: the trunk (its blocks are the original modules, owned or not).
        owned: indices of the blocks this rank holds.
        passthroughs: the pass-through that replaced each block this rank does not hold, by block index.
    """

    def __init__(
        self, slots: Sequence[SideSlot], trunk: Trunk, owned: set[int], passthroughs: dict[int, nn.Module]
    ) -> None:
        self.slots = list(slots)
        self.meta: dict[int, Meta] = {}  # slot index -> (shape, dtype), set by the runner before a schedule runs
        self._run: Optional[_Run] = None
        self._replaying = False
        self._producers: dict[tuple[int, str], nn.Module] = {}
        self._replay_out: Any = None
        # A `lightning_par.nn.MoE` slot: where its received losses are set for moe_loss(model) to read (the layer
        # itself on a rank that holds the block, else a meta copy under the pass-through at the layer's path).
        self._moe_targets: dict[int, MoE] = {}
        for key in dict.fromkeys((s.block, s.path) for s in self.slots if s.kind in ("output", "moe_loss")):
            block, path = key
            original = trunk.blocks[block].get_submodule(path)
            moe = [k for k, s in enumerate(self.slots) if (s.block, s.path) == key and s.kind == "moe_loss"]
            if moe:
                target = original if block in owned else meta_copy(original)
                self._moe_targets[moe[0]] = cast(MoE, target)
                if block in owned:
                    original.register_forward_hook(self._capture_hook(block, path, moe=True))
                else:
                    _attach(passthroughs[block], path, target)
                continue
            # Replays go through a copy made now, with the hooks the probe's forward left (a recorder installs
            # them on the first forward that records), never through the real module, whose later hooks (expert
            # parallelism's gather of router logits) must not run twice.
            stand_in = meta_copy(original)
            object.__setattr__(stand_in, "forward", self._replayed)
            self._producers[key] = stand_in
            if block in owned:
                original.register_forward_hook(self._capture_hook(block, path))
            else:  # where the block was: a recorder that installs its hooks later finds it
                _attach(passthroughs[block], path, stand_in)

    def before(self, end: int) -> list[int]:
        """Indices of the slots a stage ending (starting) at block ``end`` sends (receives): those made by blocks
        before ``end``, what block ``end - 1`` returns besides the hidden state, and the first-stage outputs."""
        return [k for k, s in enumerate(self.slots) if _crosses(s, end)]

    def hook_first_stage(self, root: nn.Module) -> None:
        """Carry the first-stage modules' outputs (``"before"`` slots): on the first stage a hook on each module
        keeps what it returned; on a later stage the same hook (on the module, or on its stand-in where this rank
        does not hold it) replaces that output by the one received, so the code after it computes with the first
        stage's values. Call once the stand-ins are in place."""
        for path in dict.fromkeys(s.path for s in self.slots if s.kind == "before"):
            root.get_submodule(path).register_forward_pre_hook(partial(self._count_call, path))
        for k, slot in enumerate(self.slots):
            if slot.kind == "before":
                root.get_submodule(slot.path).register_forward_hook(partial(self._first_stage_output, k, slot))

    def _count_call(self, path: str, _m: nn.Module, _a: Any) -> None:
        if self._run is not None:  # which call of the module this is, in this run of the stage
            self._run.calls[path] = self._run.calls.get(path, -1) + 1

    def _first_stage_output(self, k: int, slot: SideSlot, _m: nn.Module, _a: Any, out: Any) -> Any:
        run = self._run
        if run is None or run.calls.get(slot.path) != slot.call:
            return None
        leaves, spec = ([out], None) if isinstance(out, Tensor) else _compat.tree_flatten(out)
        if run.start == 0:
            run.made[k] = leaves[slot.leaf]
            return None
        if k not in run.received:
            return None
        leaves = [*leaves[: slot.leaf], run.received[k], *leaves[slot.leaf + 1 :]]
        return leaves[0] if spec is None else _compat.tree_unflatten(leaves, spec)

    def record_returned(self, block: int, out: Any) -> None:
        """The stage's last block ``block`` returned ``out``: keep the tensors besides the hidden state it sends."""
        run = self._run
        if run is None:
            return
        leaves = _compat.tree_flatten(out)[0]
        for k, slot in enumerate(self.slots):
            if slot.kind == "returned" and slot.block == block and isinstance(leaves[slot.leaf], Tensor):
                run.made[k] = leaves[slot.leaf]

    def returned(self, block: int, out: Any) -> Any:
        """What the stand-in for ``block`` (the block before this stage) returns: ``out`` with the tensors it
        returned besides the hidden state replaced by those received."""
        run = self._run
        mine = {s.leaf: k for k, s in enumerate(self.slots) if s.kind == "returned" and s.block == block}
        if run is None or not mine or not isinstance(out, (tuple, list)):
            return out
        leaves, spec = _compat.tree_flatten(out)
        leaves = [run.received[mine[j]] if j in mine and mine[j] in run.received else t for j, t in enumerate(leaves)]
        return _compat.tree_unflatten(leaves, spec)

    # ---- one run of a stage ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, start: int, end: int, received: Sequence[Tensor]) -> Iterator[None]:
        """While a stage over blocks ``[start, end)`` runs a microbatch, with the side tensors it received."""
        ins = self.before(start)
        if received and len(received) != len(ins):
            raise PipelineError(f"a stage starting at block {start} received {len(received)} side tensors, expected "
                                f"{len(ins)}; the pipeline's stages disagree on the trunk's side outputs")  # fmt: skip
        self._run = _Run(start, end, dict(zip(ins, received)))
        try:
            yield
        finally:
            self._run = None

    def outputs(self, end: int, check: bool) -> list[Tensor]:
        """The side tensors a stage ending at block ``end`` sends on, in slot order (``check``: against `meta`)."""
        run = self._run
        assert run is not None
        out = []
        for k in self.before(end):
            slot = self.slots[k]
            received = run.start > 0 if slot.kind == "before" else slot.block < run.start
            t = run.received.get(k) if received else run.made.get(k)
            if t is None:
                raise PipelineError(
                    f"{self.slots[k].name} did not run for this microbatch, but code after the trunk read what it "
                    "returned when the pipeline probed the model; a pipeline needs the trunk's side outputs on every "
                    "forward: train this model without pipeline parallelism (e.g. strategy='moe' or 'zero3')"
                )
            if check and k in self.meta and (tuple(t.shape), t.dtype) != self.meta[k]:
                raise PipelineError(
                    f"{self.slots[k].name} returned a side output of shape {tuple(t.shape)} ({t.dtype}) but "
                    f"{self.meta[k][0]} ({self.meta[k][1]}) when the pipeline measured it; the schedule sends fixed "
                    "shapes, so every microbatch must give the same: use fixed-length sequences and a batch size the "
                    "microbatches divide (drop_last=True), or train without pipeline parallelism"
                )
            # A contiguous copy: the schedule sends it as is, and detaches what a stage returned in place once its
            # backward ran, which must not reach a tensor the stage received (its input) or a view.
            out.append(t.clone(memory_format=torch.contiguous_format))
        return out

    def measured(self) -> dict[int, Meta]:
        """Shapes and dtypes of the side tensors the current run's own blocks made."""
        run = self._run
        assert run is not None
        return {k: (tuple(t.shape), t.dtype) for k, t in run.made.items()}

    def replay(self, block: int) -> None:
        """Block ``block`` is a pass-through in this run: call its producers so that their hooks see what it made."""
        run = self._run
        if run is None or not run.received:
            return
        for k, target in self._moe_targets.items():
            if self.slots[k].block == block:
                unpack_moe(target, run.received[k])
        for (b, path), producer in self._producers.items():
            if b != block:
                continue
            slots = [k for k, s in enumerate(self.slots) if (s.block, s.path) == (b, path)]
            leaves: list[Any] = [None] * _n_leaves(self.slots[slots[0]].spec)
            for k in slots:
                leaves[self.slots[k].leaf] = run.received[k]
            self._replay_out = _compat.tree_unflatten(leaves, self.slots[slots[0]].spec)
            self._replaying = True
            try:
                producer()
            finally:
                self._replaying, self._replay_out = False, None

    def _replayed(self, *_: Any, **__: Any) -> Any:
        return self._replay_out

    def _capture_hook(self, block: int, path: str, moe: bool = False) -> Any:
        mine = [(k, s.leaf) for k, s in enumerate(self.slots) if (s.block, s.path) == (block, path)]

        def capture(_m: nn.Module, _a: Any, out: Any) -> None:  # returning a value would replace the output
            run = self._run
            # Not during a replay, nor outside a stage's run (a backward's recomputation of a checkpointed block).
            if run is None or self._replaying or not run.start <= block < run.end:
                return
            leaves = [pack_moe(cast(MoE, _m))] if moe else _compat.tree_flatten(out)[0]
            for k, leaf in mine:
                if leaf < len(leaves) and isinstance(leaves[leaf], Tensor):
                    run.made[k] = leaves[leaf]

        return capture


def pack_moe(layer: MoE) -> Tensor:
    """What a `lightning_par.nn.MoE` layer's slot carries after its forward: ``[aux_loss, z_loss, dropped_fraction,
    *tokens_per_expert]`` in fp32 (the two losses with their gradients; the statistics are for the model's logs)."""
    stats = layer.stats
    return torch.cat([layer.aux_loss.float().reshape(1), layer.z_loss.float().reshape(1),
                      stats["dropped_fraction"].float().reshape(1), stats["tokens_per_expert"].float()])  # fmt: skip


def unpack_moe(layer: MoE, carried: Tensor) -> None:
    """Set what `pack_moe` carried on ``layer``, as its own forward would have (``moe_loss(model)`` reads it); the
    per-token statistics (``expert_index``, ``kept``) stay on the stage that routed the tokens."""
    layer.aux_loss, layer.z_loss = carried[0], carried[1]
    layer.stats = {"tokens_per_expert": carried[3:].detach(), "dropped_fraction": carried[2].detach()}


def _crosses(slot: SideSlot, end: int) -> bool:
    """Whether ``slot`` crosses the stage boundary before block ``end`` (`SideCarrier.before`)."""
    if slot.kind == "before":
        return end > 0
    if slot.kind == "returned":
        return slot.block == end - 1
    return slot.block < end


def _n_leaves(spec: Any) -> int:
    return int(spec.num_leaves)


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` under ``root`` at ``path``, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    # By the registry, not getattr: a stand-in reads attributes it lacks from a meta copy of its block
    # (stages._PassThrough), which must not count as a module already there.
    for name in parents:
        child = dict(root.named_children()).get(name)
        if child is None:
            child = nn.Module()
            setattr(root, name, child)
        root = child
    setattr(root, leaf, module)
