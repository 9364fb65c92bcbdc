"""Checkpoints of local SGD / DiLoCo (`lightning_par.parallel.local_sgd.outer`): what a save holds, what a load
restores.

Between synchronisations every ``dp_replicate`` replica has weights and inner optimizer state of its own, while the
anchor theta (the weights of the last synchronisation) and the outer SGD's momentum are the same on all replicas.
DCP writes a key once, from one rank, however many ranks hold it (it de-duplicates replicated state), so what
differs per replica is saved under keys of its own. A checkpoint holds:

- ``state_dict``: theta for every trained parameter (each replica holds it; written once), with replica 0's buffers
  and frozen parameters: the model of the last synchronisation, which `lightning-par consolidate`, the Hugging Face
  export and a load of the weights alone read;
- ``local_sgd.replica_<r>``: replica ``r``'s ``state_dict`` and ``optimizer_<i>``, in the layout they have without
  local SGD (under ZeRO 1-2 sharded over the replica's ``dp_shard`` ranks);
- ``local_sgd.outer_momentum``: the outer SGD's momentum, per trained parameter (laid out like theta; only with
  ``outer_momentum > 0``);
- in ``meta.pt``, under ``lightning_par.local_sgd``: the layout and the inner step and synchronisation counts (the
  position in the cycle is ``steps % sync_every``).

A load puts each piece back where it was taken from, so a run saved inside a cycle continues exactly. Rules, checked
before any tensor is read: ``dp_replicate`` must be the checkpoint's (each replica's state has one place to go);
``dp_shard`` and the ZeRO stage inside a replica may change (DCP reshards each replica's state over its ranks), with
a warning, because the replicas then read other samples than in the uninterrupted run; a run without local SGD
refuses such a checkpoint; a checkpoint without local SGD state starts every replica from its weights and optimizer
state, theta from those weights, with no outer momentum and a new cycle.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.checkpoint.dcp import LOCAL_SGD
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.reader import CheckpointError
from lightning_par.checkpoint.resume_state import KEY
from lightning_par.parallel.local_sgd.outer import LocalSGD, OuterSync
from lightning_par.utils import dtensors


class ReplicatedZero(Protocol):
    """What this module reads of the ZeRO 0-2 engine that runs local SGD (`lightning_par.parallel.zero.replicated`;
    a protocol, so that local SGD does not import the engine that imports it)."""

    stage: int
    mesh: DeviceMesh
    names: dict[nn.Parameter, str]
    outer: Optional[OuterSync]
    local_sgd: Optional[LocalSGD]

    def distribute_state(self, name: str, value: Any) -> Any: ...


MOMENTUM = "outer_momentum"


def active(zero: Optional[ReplicatedZero]) -> bool:
    """Whether ``zero`` trains its replicas apart (``sync_every``)."""
    return zero is not None and zero.local_sgd is not None


def _replica(zero: ReplicatedZero) -> str:
    return f"replica_{zero.mesh.get_local_rank(0)}"


def _for_dcp(zero: ReplicatedZero, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """This rank's anchor-shaped tensors (theta, momentum) as DCP sees their parameters, by checkpoint name.

    ZeRO 1-2: a master's rows are the ``Shard(0)`` DTensor of the full parameter, replicated over the replicas (the
    engine's optimizer-state wrapping); whole parameters stay plain on their owner. ZeRO-0: the full (tp-local)
    parameter, a DTensor again where the parameter is one.
    """
    params = {n: p for p, n in zero.names.items()}
    out: dict[str, Any] = {}
    for name, t in zip(names, tensors):
        p = params[name]
        if zero.stage:
            value = zero.distribute_state(name, t)
        else:
            value = dtensors.like(t, p)
        out[clean_name(name)] = value
    return out


def save_layout(zero: ReplicatedZero, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (``state_dict`` and ``optimizer_<i>``, as saved without local SGD) in the layout of the module
    docstring.

    Raises:
        ValueError: no optimizer was set up (nothing to tell where the replicas are in their cycle).
    """
    sync = zero.outer
    if sync is None:
        raise ValueError(
            "saving a checkpoint under sync_every (local SGD) needs the optimizer of the run; save during or after "
            "Trainer.fit, where the replicas' cycle exists"
        )
    sync.anchor_once()
    theta = _for_dcp(zero, sync.names, [a.detach() for a in sync.anchor])
    trained = {clean_name(n) for n in zero.names.values()}
    first = zero.mesh.get_local_rank(0) == 0  # replica 0's buffers stand for the model's (they are not synchronised)
    shared = {k: v for k, v in tensors["state_dict"].items() if first and k not in trained}
    own: dict[str, Any] = {_replica(zero): tensors}
    if zero.local_sgd is not None and zero.local_sgd.momentum > 0:
        own[MOMENTUM] = _for_dcp(zero, sync.names, sync.momentum())
    return {"state_dict": {**shared, **theta}, LOCAL_SGD: own}


def describe(zero: ReplicatedZero) -> dict[str, int]:
    """The non-tensor part, for ``meta.pt``: the layout, and where the replicas are in the cycle."""
    assert zero.outer is not None and zero.local_sgd is not None, "save_layout checked it"
    return {"replicas": zero.mesh.size(0), "shards": zero.mesh.size(1), "every": zero.local_sgd.every,
            "momentum": int(zero.local_sgd.momentum > 0), "steps": zero.outer.steps,
            "syncs": zero.outer.syncs}  # fmt: skip


class LoadLayout:
    """`lightning_par.checkpoint.dcp.load_sharded`'s ``layout`` for a run that may train with local SGD: checks the
    checkpoint against the run, points each replica at its own state, and (`finish`) restores the outer loop.

    Args:
        zero: the run's ZeRO 0-2 engine, or ``None`` (ZeRO-3).
    """

    def __init__(self, zero: Optional[ReplicatedZero]) -> None:
        self.zero = zero if active(zero) else None
        self._finish: Optional[Callable[[], None]] = None

    def elsewhere(self, module: nn.Module) -> frozenset[str]:
        """Model keys not loaded from the checkpoint's ``state_dict`` under local SGD (only theta is: each replica
        reads its weights and buffers from its own entry), so not unexpected there."""
        if self.zero is None:
            return frozenset()
        return frozenset(f"state_dict.{clean_name(k)}" for k in module.state_dict())

    def __call__(self, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        entry = meta.get(KEY)
        saved = entry.get(LOCAL_SGD) if isinstance(entry, dict) else None
        zero = self.zero
        if saved is None:
            return state  # every replica starts from the same state; theta is taken at the first step
        if zero is None:
            raise CheckpointError(
                f"the checkpoint was saved under local SGD (sync_every={saved['every']}, dp_replicate="
                f"{saved['replicas']}): its replicas' weights and optimizer states differ. Resume it with "
                f"sync_every and dp_replicate={saved['replicas']}, or write its anchor weights (the last "
                "synchronisation) with `lightning-par consolidate CKPT OUT` and start from those"
            )
        replicas, shards = zero.mesh.size(0), zero.mesh.size(1)
        if saved["replicas"] != replicas:
            raise CheckpointError(
                f"the checkpoint holds {saved['replicas']} local SGD replicas (dp_replicate={saved['replicas']}) and "
                f"this run has dp_replicate={replicas}: each replica's weights and optimizer state need a replica to "
                f"go to. Resume with dp_replicate={saved['replicas']} (dp_shard may change), or start a new run "
                "from its anchor weights (`lightning-par consolidate CKPT OUT`)"
            )
        if saved["shards"] != shards and dist.get_rank() == 0:
            warnings.warn(
                f"local SGD checkpoint of {saved['shards']} rank(s) per replica resumed on {shards}: each replica "
                "continues from its own weights, optimizer state and the outer state, but its ranks now read other "
                "samples of each global batch than in the uninterrupted run, so the run continues differently",
                stacklevel=2,
            )
        on_disk: dict[str, Any] = {LOCAL_SGD: {_replica(zero): state}}
        sync = zero.outer
        if sync is None:  # no optimizer (validate / test): the replica's weights alone
            return on_disk
        sync.anchor_once()
        # Copies, put into the outer loop only once everything was read (`finish`); a key the checkpoint lacks
        # (strict_loading=False) keeps the current value.
        theta = _for_dcp(zero, sync.names, [a.detach().clone() for a in sync.anchor])
        momentum = _for_dcp(zero, sync.names, [torch.zeros_like(a.detach()) for a in sync.anchor])
        on_disk["state_dict"] = theta
        if zero.local_sgd is not None and zero.local_sgd.momentum > 0 and saved.get("momentum", True):
            on_disk[LOCAL_SGD][MOMENTUM] = momentum
        keys = [clean_name(n) for n in sync.names]

        def finish() -> None:
            anchor = [dtensors.local(theta[k]) if k in theta else a.detach() for k, a in zip(keys, sync.anchor)]
            sync.load(anchor, [dtensors.local(momentum[k]) for k in keys], int(saved["steps"]), int(saved["syncs"]))

        self._finish = finish
        return on_disk

    def finish(self) -> None:
        """After the load: the anchor, the outer momentum and the step counts into the outer loop."""
        if self._finish is not None:
            self._finish()
            self._finish = None
