"""What travels down the pipeline besides the hidden state, as slots (`SideSlot`): which tensor of which module's
output, found by the ownership probe (`pipeline.owners.find_ownership`) and carried by `pipeline.sides`.

Four kinds: side outputs of modules inside the trunk that code after it reads (router logits for a load-balancing
loss), the losses a `lightning_par.nn.MoE` layer keeps on itself, tensors a block returns besides the hidden state
that the next stage's code reads (`CutRule.returned_reads`), and outputs of first-stage modules read past the first
block (`CutRule.carried_reads`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from torch import nn

from lightning_par.blocks.trunk import Trunk
from lightning_par.nn.moe import MoE


class PipelineError(ValueError):
    """A model or step the pipeline cannot cut; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class SideSlot:
    """One side output of the trunk: leaf ``leaf`` of the flattened output of module ``path`` of block ``block``.

    Args:
        block: index of the trunk block that runs the producer.
        path: the producer's name inside the block.
        leaf: index of the tensor among the producer output's pytree leaves.
        name: the producer's qualified name in the whole model (for messages).
        spec: the pytree structure of the producer's output (a replay returns the same structure).
        kind: ``"output"`` (a tensor the producer returns, carried to the last stage), ``"moe_loss"``: the aux /
            z-loss and routing statistics a `lightning_par.nn.MoE` producer keeps on itself (`pipeline.sides.pack_moe`),
            ``"returned"``: a tensor block ``block`` itself returns besides the hidden state (``path`` empty), which a
            stage starting at ``block + 1`` reads (T5's position bias), carried across that boundary only, or
            ``"before"``: a tensor first-stage module ``path`` (``block`` -1) returns that code past the first block
            reads (an encoder's output every decoder block reads), carried to every stage.
        call: for ``"before"``: which call of the module in one forward (a shared embedding runs for the encoder
            and again for the decoder).
    """

    block: int
    path: str
    leaf: int
    name: str
    spec: Any
    kind: str = "output"
    call: int = 0


def moe_loss_slots(module: nn.Module, trunk: Trunk) -> tuple[SideSlot, ...]:
    """One side slot per `lightning_par.nn.MoE` layer inside the trunk: ``moe_loss(model)`` (and a model logging
    routing statistics) reads what every layer stored on itself, so it travels down the pipeline like router logits.

    Raises:
        PipelineError: such a layer outside the trunk (the last stage could not read a first-stage layer's loss).
    """
    slots = []
    for name, m in module.named_modules():
        block = next((i for i, b in enumerate(trunk.names) if name.startswith(b + ".")), None)
        if not isinstance(m, MoE) or (block is None and not (m.aux_loss_coef or m.z_loss_coef)):
            continue
        if block is None:
            raise PipelineError(
                f"{name} adds a load-balancing / z-loss but runs outside the trunk's blocks ({trunk.path}), where a "
                "pipeline cannot carry it to the loss; move the MoE layer into a block, set aux_loss_coef=0 and "
                "z_loss_coef=0, or train without pipeline parallelism (strategy='moe' or 'zero3')"
            )
        slots.append(SideSlot(block, name[len(trunk.names[block]) + 1 :], 0, name, None, kind="moe_loss"))
    return tuple(slots)


def side_slots(uses: Any, trunk: Trunk) -> tuple[SideSlot, ...]:
    """The side outputs the stages carry, in the order they were made. (What code after the trunk reads and the
    stages cannot carry, a block's own output or a value computed between blocks, rules out the cuts before it:
    `lightning_par.parallel.pipeline.cuts`.)"""
    order = {k: n for n, k in enumerate(uses.made)}
    slots: dict[tuple[int, str, int], SideSlot] = {}
    first_use = {tid: producer for tid, producer, _ in reversed(uses.side)}
    for tid in sorted(first_use, key=order.__getitem__):
        block, path, leaf, spec = uses.returned_by[tid]
        name = f"{trunk.names[block]}.{path}"
        if (block, path, leaf) in slots:
            raise PipelineError(
                f"{name} runs more than once in one forward and code after the trunk ({trunk.path}) reads what it "
                "returns each time; a pipeline replays one call per producer on the stages that do not run it. "
                "Train this model without pipeline parallelism (e.g. strategy='moe' or 'zero3'), or turn that "
                "output off in the model's config (e.g. output_router_logits=False)"
            )
        slots[(block, path, leaf)] = SideSlot(block, path, leaf, name, spec)
    return tuple(sorted(slots.values(), key=lambda s: s.block))  # stable: within a block, the order made


def carried_slots(
    trunk: Trunk, returned: Collection[tuple[int, int]], before: Collection[tuple[str, int, int]], units: Sequence[str]
) -> tuple[SideSlot, ...]:
    """The slots of the tensors blocks return besides the hidden state (``returned``: (block, leaf)) and of the
    first-stage modules' outputs (``before``: (module, call, leaf)) that code past a boundary reads: first-stage
    outputs by registration order of ``units``, then by block and leaf."""
    order = {u: k for k, u in enumerate(units)}
    ranked = sorted(before, key=lambda u: (order.get(u[0], len(order)), u[1], u[2]))
    early = [SideSlot(-1, unit, leaf, unit, None, kind="before", call=call) for unit, call, leaf in ranked]
    late = [SideSlot(b, "", leaf, trunk.names[b], None, kind="returned") for b, leaf in sorted(returned)]
    return (*early, *late)
