"""One DeviceMesh with named axes for every parallel dimension.

Axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. tp is innermost so its ranks are adjacent
(same node, fast links); pp is outermost because it sends the least data. Every axis exists even at size 1, so
code never has to assume a 1-D mesh. ``ep`` is carved out of the data-parallel ranks: `ExpertMesh` views them as
``(edp, ep) = (dp/ep, ep)``, ep innermost (the ranks that exchange tokens every layer are adjacent).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_par import _compat
from lightning_par.config import ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelMesh:
    """The job's meshes.

    Args:
        root: the 4-D mesh named by `MESH_AXES`.
        dp: all data-parallel ranks of this rank's replica group as one flat axis (loss averaging, the sampler,
            metrics); kept here because torch deprecates slicing a flattened axis back out of the root.
        experts: the (``edp``, ``ep``) view of the data-parallel ranks when ``ep > 1``, else ``None``.
        dp_2d: the (``dp_replicate``, ``dp_shard``) sub-mesh ZeRO shards over (HSDP when both are > 1).
        tp: the 1-D tensor-parallel axis.
        dp_tp: the (``dp_replicate``, ``dp_shard``, ``tp``) sub-mesh: where ZeRO 1-2 describe the optimizer
            state of tensor-parallel parameters, and FSDP2 meets tensor parallelism.
    """

    root: DeviceMesh
    dp: DeviceMesh
    dp_2d: DeviceMesh
    tp: DeviceMesh
    dp_tp: DeviceMesh
    experts: Optional[ExpertMesh] = None


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """The data-parallel ranks viewed as ``(edp, ep)`` for expert parallelism.

    Args:
        ep: ranks holding different experts, exchanging tokens with all-to-all.
        edp: ranks holding the same experts (their gradients are summed over it).
        dp_size: all data-parallel ranks (``edp * ep``); expert gradients are divided by it.
        tp_ep: the (``tp``, ``ep``) view, for experts also split over tp (``etp > 1``); ``None`` when ``tp == 1``.
    """

    ep: DeviceMesh
    edp: DeviceMesh
    dp_size: int
    tp_ep: Optional[DeviceMesh] = None


def build_mesh(config: ParallelConfig, device_type: str) -> ParallelMesh:
    """Build the job's meshes from a resolved config.

    Args:
        config: a config returned by `ParallelConfig.resolve` (no ``-1`` degrees left).
        device_type: ``"cpu"`` or ``"cuda"``.
    """
    shape = tuple(getattr(config, axis) for axis in MESH_AXES)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    dp_2d = root[("dp_replicate", "dp_shard")]
    dp = _compat.flatten_mesh(dp_2d, "dp")
    dp_tp = root[("dp_replicate", "dp_shard", "tp")]
    experts = _expert_mesh(root, dp, config.ep, device_type) if config.ep > 1 else None
    return ParallelMesh(root=root, dp=dp, dp_2d=dp_2d, tp=root["tp"], dp_tp=dp_tp, experts=experts)


def _expert_mesh(root: DeviceMesh, dp: DeviceMesh, ep: int, device_type: str) -> ExpertMesh:
    # Every rank's data-parallel ranks, (pp, tp, dp) -> (pp, tp, dp/ep, ep): a separate mesh over the same ranks
    # (DeviceMesh cannot unflatten an axis of the root), built collectively on every rank.
    ranks = root.mesh.permute(0, 3, 1, 2).reshape(root.size(0), root.size(3), -1)
    ranks = ranks.reshape(*ranks.shape[:2], -1, ep)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "tp", "edp", "ep"))
    tp_ep = mesh[("tp", "ep")] if root.size(3) > 1 else None
    return ExpertMesh(ep=mesh["ep"], edp=mesh["edp"], dp_size=dp.size(), tp_ep=tp_ep)
