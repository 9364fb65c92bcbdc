"""Local SGD / DiLoCo: model replicas train on their own for ``H`` optimizer steps, then synchronise.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105,
Algorithm 1): every replica keeps the parameters of the last synchronisation ``theta`` and runs ``H`` inner steps
(the user's optimizer) on its own data. Then the outer gradient, the mean over replicas of ``theta - theta_replica``,
is all-reduced, and an outer optimizer (SGD with Nesterov momentum; the paper's lr 0.7, momentum 0.9) steps
``theta`` with it; every replica continues from the new ``theta``.

Here the replicas are the ``dp_replicate`` groups of the data-parallel mesh (`ParallelConfig.sync_every`): inside a
replica (``dp_shard``) gradients are still reduced every step, by the ZeRO 0-2 engine, which composes with it; across
replicas nothing is sent between synchronisations. With ZeRO 1-2 each rank synchronises only its shard of the
parameters (its masters) with the same shard of the other replicas, so the outer all-reduce moves ``1/dp_shard`` of
the parameters. Per optimizer step that is ``1/H`` of the bytes plain data parallelism over the replicas sends.

With ``sync_every=1``, ``outer_lr=1`` and ``outer_momentum=0`` the outer step sets ``theta`` to the mean of the
replicas' parameters after one inner step. For an inner optimizer linear in the gradient (SGD, with or without
momentum and weight decay) that is exactly plain data parallelism; Adam's update is not linear, so it differs.

Checkpoints save the anchor, the outer momentum and the step count besides each replica's own weights and optimizer
state (`lightning_par.parallel.local_sgd.state`), so a run saved inside a cycle resumes exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par import _compat


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """The outer loop's settings (module docstring).

    Args:
        every: inner optimizer steps between synchronisations (``H``).
        lr: the outer SGD's learning rate.
        momentum: its momentum (Nesterov's when > 0).
    """

    every: int
    lr: float = 0.7
    momentum: float = 0.9


class OuterSync:
    """The outer loop over this rank's part of the parameters.

    Args:
        parts: what this rank holds of the parameters and steps (full parameters at ZeRO-0, masters at ZeRO 1-2),
            each with its parameter's name, read when the first inner step starts (the optimizer's layout is
            settled then, and a loaded checkpoint is in place) or when a checkpoint is saved or loaded.
        group: the ranks holding the same part in the other replicas.
        settings: `LocalSGD`.
    """

    def __init__(self, parts: Callable[[], Sequence[tuple[str, torch.Tensor]]], group: dist.ProcessGroup,
                 settings: LocalSGD) -> None:  # fmt: skip
        self.parts, self.group, self.settings = parts, group, settings
        self.replicas = dist.get_world_size(group)
        self.names: list[str] = []  # the parameter of each tensor (checkpoint keys)
        self.tensors: list[torch.Tensor] = []
        self.anchor: list[nn.Parameter] = []  # theta: the parameters of the last synchronisation
        self.outer: Optional[torch.optim.SGD] = None
        self.steps = 0  # inner optimizer steps since the run started
        self.syncs = 0

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, parts: Callable[[], Sequence[tuple[str, torch.Tensor]]],
               group: dist.ProcessGroup, settings: LocalSGD, post_hook: bool, existing: Optional[OuterSync],
               ) -> OuterSync:  # fmt: skip
        """The outer loop of ``optimizer``'s steps: built (anchored) in a step pre-hook of its first step, and run
        after each step by a post-hook put first (``post_hook``) or by the caller (`after_inner_step`).

        Raises:
            ValueError: a second optimizer (``existing``): the loop counts the steps of one.
        """
        if existing is not None:
            raise ValueError(
                "local SGD (sync_every > 1) counts the steps of one optimizer; return a single optimizer from "
                "configure_optimizers (param groups for different settings), or use sync_every=1"
            )
        sync = cls(parts, group, settings)
        optimizer.register_step_pre_hook(lambda *_: sync.anchor_once())
        if post_hook:
            _compat.run_step_post_hook_first(optimizer, optimizer.register_step_post_hook(
                lambda *_: sync.after_inner_step()))  # fmt: skip
        return sync

    @torch.no_grad()
    def anchor_once(self) -> None:
        """Before the first inner step: theta is the parameters as they are now."""
        if self.outer is not None:
            return
        named = list(self.parts())
        self.names = [name for name, _ in named]
        self.tensors = [t.detach() for _, t in named]
        self.anchor = [nn.Parameter(t.clone()) for t in self.tensors]
        momentum = self.settings.momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.settings.lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def after_inner_step(self) -> None:
        """Count an inner step; every ``every``-th, synchronise the replicas."""
        self.steps += 1
        if self.steps % self.settings.every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """All-reduce the outer gradient, step the anchor with the outer optimizer, and continue from it."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(self.tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for indices in by_dtype.values():  # one all-reduce per dtype
            deltas = [self.anchor[i].detach() - self.tensors[i] for i in indices]
            flat = torch.cat([d.reshape(-1) for d in deltas])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.replicas)
            offset = 0
            for i, d in zip(indices, deltas):
                self.anchor[i].grad = flat[offset : offset + d.numel()].view_as(d)
                offset += d.numel()
        assert self.outer is not None, "anchor_once runs before the first inner step"
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        _compat.foreach_copy(self.tensors, [a.detach() for a in self.anchor])
        self.syncs += 1

    # ---- checkpoints (`lightning_par.parallel.local_sgd.state`) --------------------------------------------------
    def momentum(self) -> list[torch.Tensor]:
        """The outer SGD's momentum buffers, one per anchor tensor (zeros before the first synchronisation)."""
        self.anchor_once()
        assert self.outer is not None
        return [self._buffer(a) for a in self.anchor]

    def _buffer(self, anchor: nn.Parameter) -> torch.Tensor:
        assert self.outer is not None
        buf = self.outer.state.get(anchor, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(anchor.detach())

    @torch.no_grad()
    def load(self, anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], steps: int, syncs: int) -> None:
        """Continue from a checkpoint: the anchor, the outer momentum, and the step and synchronisation counts.

        Args:
            anchor: theta, one tensor per `names`, shaped like `tensors`.
            momentum: the momentum buffers (ignored without momentum, or before the first synchronisation, where
                torch's SGD has none: its first step then starts the buffer from the gradient, as uninterrupted).
            steps: inner steps since the run started (the position in the cycle is ``steps % every``).
            syncs: synchronisations so far.
        """
        self.anchor_once()
        assert self.outer is not None
        _compat.foreach_copy([a.detach() for a in self.anchor], list(anchor))
        self.outer.state.clear()
        if self.settings.momentum > 0 and syncs > 0:
            for a, buf in zip(self.anchor, momentum):
                self.outer.state[a]["momentum_buffer"] = buf.detach().clone()
        self.steps, self.syncs = steps, syncs
