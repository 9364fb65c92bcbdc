"""Weights tied across the pipeline's two ends (input embedding = output head), Megatron-LM style.

A parameter used before the trunk and after it (`pipeline.owners.Ownership.tied`) lives on the first stage and on
the last. Where the two stages run on different ranks, each holds its own copy: the last stage's is set equal to
the first stage's at set-up, and after every pipeline step the two copies' gradients are summed over a process
group of the pipeline's first-stage and last-stage ranks (Narayanan et al., arXiv 2104.04473, section 2.4: "the
embedding ... gradients are all-reduced between the first and last stage"). Each copy then has the one-process
gradient, and the same optimizer update keeps them bit-identical. Where one rank runs both (the V schedules put
stage 0 and the last on rank 0), the parameter is simply shared by its two stage modules.

The sum runs on each step's fresh gradients, before anything else reads them: ZeRO 0-2 reduce over data-parallel
ranks afterwards (summing over the tie group commutes with that reduction), gradient clipping and norms come
later still. The gradient norm counts the weight once: the last stage's copy is marked as a replica
(`lightning_par.parallel.grad_norm.mark_replica`). Checkpoints: each copy's values are saved under the names it
has on its rank, so the model state holds every name of the one-process state dict once; its optimizer state is
keyed by the name one process gives the weight (the first in ``named_parameters``), the same on both end stages,
so it is written once and resumes on any layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.parallel.grad_norm import mark_replica
from lightning_par.parallel.param_tree import parameter_tree
from lightning_par.utils import dtensors


class TiedWeights:
    """The tied parameters one end-stage rank holds, and the group that sums their gradients.

    Args:
        module: the rank's cut model.
        tied: each tied parameter's names in the whole model (`Ownership.tied`).
        group: the first-stage and last-stage ranks of this rank's pipeline.
        first_rank: global rank of the first stage (the copy every other copy starts from).
        is_replica: this rank holds the last stage's copy, not the first's (its gradient norm is not counted).
    """

    def __init__(
        self,
        module: nn.Module,
        tied: Sequence[tuple[str, ...]],
        group: dist.ProcessGroup,
        first_rank: int,
        is_replica: bool,
    ) -> None:
        held = dict(module.named_parameters(remove_duplicate=False))
        # The name each parameter has on this rank (a shadow keeps the other names, unregistered).
        self.names = [next(n for n in names if n in held) for names in tied]
        self.module, self.group, self.first_rank, self.is_replica = module, group, first_rank, is_replica
        self._renames = {local: names[0] for local, names in zip(self.names, tied) if local != names[0]}
        self._owners: dict[int, tuple[nn.Module, nn.Module]] = {}

    def optimizer_owner(self, owner: nn.Module) -> nn.Module:
        """``owner`` (the module whose parameter names key the optimizer state) with each tied copy under its
        one-process name. The same object on every call for one ``owner`` (checkpoint code caches by owner)."""
        if not self._renames:
            return owner
        if id(owner) not in self._owners:
            root = parameter_tree((self._renames.get(n, n), p) for n, p in owner.named_parameters())
            self._owners[id(owner)] = (owner, root)  # the owner kept alive: its id stays its own
        return self._owners[id(owner)][1]

    @property
    def renames(self) -> dict[str, str]:
        """This rank's name of each tied copy that one process names differently -> the one-process name."""
        return dict(self._renames)

    def params(self) -> list[nn.Parameter]:
        """The tied parameters as they are now (ZeRO-3 and tensor parallelism replace parameter objects)."""
        return [self.module.get_parameter(n) for n in self.names]

    @torch.no_grad()
    def sync_values(self) -> None:
        """Start both copies equal: the first stage's values to the last stage (collective over the group).

        Nothing to send for a model built on the meta device: both ends initialise the weight from the same unit
        with the same seed (`lightning_par.parallel.materialize`).
        """
        for p in self.params():
            if not p.is_meta:
                dist.broadcast(p.data, src=self.first_rank, group=self.group)

    def mark_replicas(self, masters: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> None:
        """On the last stage's rank, mark its copies (and the ZeRO masters built from them) as replicas, so that
        the global gradient norm counts each tied weight once."""
        if self.is_replica:
            _mark_replicas(self.params(), masters)

    def reduce_grads(self) -> None:
        """Sum the copies' gradients of this step over the group (collective; call after every pipeline step)."""
        _sum_grads(self.params(), self.group)


def _mark_replicas(params: Sequence[nn.Parameter], masters: Optional[dict[nn.Parameter, nn.Parameter]]) -> None:
    for p in params:
        mark_replica(p)
        if masters is not None and p in masters:
            mark_replica(masters[p])


@torch.no_grad()
def _sum_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the copies' gradients over ``group``: one all-reduce per gradient dtype, of every gradient (zeros where
    this rank has none) and a flag each. A copy no rank used this step keeps no gradient, as in one process, where an
    optimizer then leaves it alone; one that some rank used gets the sum."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, group_params in by_dtype.items():
        grads = [dtensors.local(p.grad) for p in group_params]
        held = [g if g is not None else torch.zeros_like(dtensors.local_data(p)) for p, g in zip(group_params, grads)]
        flags = torch.tensor([g is not None for g in grads], dtype=dtype, device=held[0].device)
        flat = torch.cat([*(t.reshape(-1) for t in held), flags])
        dist.all_reduce(flat, group=group)
        sizes = [t.numel() for t in held]
        parts = flat[: sum(sizes)].split(sizes)
        for p, g, part, seen in zip(group_params, grads, parts, flat[sum(sizes) :].tolist()):
            if seen == 0:
                continue
            if g is None:
                p.grad = dtensors.like(part.view_as(dtensors.local_data(p)).clone(), p)
            else:
                g.copy_(part.view_as(g))


def tie_group(first_rank: int, last_rank: int, timeout: Optional[timedelta]) -> Optional[dist.ProcessGroup]:
    """The {first stage, last stage} group of this rank's pipeline; ``None`` on ranks in neither.

    Collective over the whole job: every rank creates every pipeline's group, in one order.
    """
    pairs: list[Optional[tuple[int, int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (first_rank, last_rank))
    mine = None
    me = dist.get_rank()
    for pair in sorted({p for p in pairs if p is not None}):
        group = dist.new_group(list(pair), timeout=timeout)
        if me in pair:
            mine = group
    return mine


class OnEveryStage:
    """Parameters directly on a module that contains the trunk (`Ownership.everywhere`), held by every stage.

    Code before, between or after the trunk's blocks may read them (modded-nanoGPT passes ``self.lambdas[i]`` to
    block ``i``; a learned scale multiplies the embedding), so each stage keeps them, starts from the first stage's
    values, and after every pipeline step their gradients (each stage's share: what its own part of the forward
    read) are summed over the pipeline group, as tied weights' are over their two ends. The gradient norm counts them
    on the first stage's rank only. Checkpoints hold them under their own names from every rank, written once (DCP
    keeps one copy of a tensor that several ranks save under one name).

    Args:
        module: the rank's cut model.
        names: the parameters' names (`Ownership.everywhere`).
        group: the pipeline group.
        first: whether this rank runs the first stage.
    """

    def __init__(self, module: nn.Module, names: Sequence[str], group: dist.ProcessGroup, first: bool) -> None:
        self.module, self.names, self.group, self.first = module, list(names), group, first

    def params(self) -> list[nn.Parameter]:
        """The parameters as they are now."""
        return [self.module.get_parameter(n) for n in self.names]

    @torch.no_grad()
    def sync_values(self) -> None:
        """Every stage starts from the first stage's values (collective over the pipeline group)."""
        for p in self.params():
            if not p.is_meta:
                dist.broadcast(p.data, src=dist.get_global_rank(self.group, 0), group=self.group)

    def mark_replicas(self, masters: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> None:
        """Off the first stage's rank, mark them (and their ZeRO masters) as replicas for the gradient norm."""
        if not self.first:
            _mark_replicas(self.params(), masters)

    def reduce_grads(self) -> None:
        """Sum this step's gradients over the pipeline group (collective; after every pipeline step)."""
        _sum_grads(self.params(), self.group)
