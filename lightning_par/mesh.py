"""One DeviceMesh with named axes for every parallel dimension.

Axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``. tp is innermost so its ranks are
adjacent (same node, fast links), cp next to it (keys and values every layer); pp is outermost because it sends the
least data. Every axis exists even at size 1, so
code never has to assume a 1-D mesh. ``ep`` is carved out of the data-parallel ranks: `ExpertMesh` views them as
``(edp, ep) = (dp/ep, ep)``, ep innermost (the ranks that exchange tokens every layer are adjacent). Under cp the
ep groups stay inside the data-parallel ranks of one cp index, and ``edp`` spans cp too: cp ranks hold the same
experts, fed different chunks of the same samples (docs/moe.md, "Under context parallelism").
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_par import _compat
from lightning_par.axes import MESH_AXES
from lightning_par.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class ParallelMesh:
    """The job's meshes.

    Args:
        root: the 5-D mesh named by `MESH_AXES`.
        dp: all data-parallel ranks of this rank's replica group as one flat axis (loss averaging, the sampler,
            metrics; never cp, whose ranks hold the same samples); kept here because torch deprecates slicing a
            flattened axis back out of the root.
        experts: the (``edp``, ``ep``) view of the data-parallel ranks when ``ep > 1``, else ``None``.
        dp_2d: the (``dp_replicate``, ``dp_shard``) sub-mesh ZeRO shards and averages gradients over (HSDP when
            both are > 1); under ``cp > 1`` its second axis is ``dp_shard_cp`` (dp_shard x cp flattened), since
            every cp rank holds a part of each gradient (docs/context_parallel.md).
        tp: the 1-D tensor-parallel axis.
        dp_tp: the (``dp_replicate``, ``dp_shard`` or ``dp_shard_cp``, ``tp``) sub-mesh: where ZeRO 1-2 describe
            the optimizer state of tensor-parallel parameters, and FSDP2 meets tensor parallelism.
        cp: the 1-D context-parallel axis (sequence chunks; size 1 without cp).
        tokens: the ranks whose tokens together make one step's batch: ``dp`` x ``cp`` flattened under
            ``cp > 1`` (capacity, load-balancing statistics, expert loads), else ``None`` (``dp`` then).
    """

    root: DeviceMesh
    dp: DeviceMesh
    dp_2d: DeviceMesh
    tp: DeviceMesh
    dp_tp: DeviceMesh
    cp: Optional[DeviceMesh] = None
    experts: Optional[ExpertMesh] = None
    tokens: Optional[DeviceMesh] = None

    @property
    def token_mesh(self) -> DeviceMesh:
        """The ranks whose tokens together make one step's batch (``dp``, times ``cp`` under context parallelism)."""
        return self.tokens if self.tokens is not None else self.dp


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """The data-parallel ranks viewed as ``(edp, ep)`` for expert parallelism.

    Args:
        ep: ranks holding different experts, exchanging tokens with all-to-all.
        edp: ranks holding the same experts (their gradients are summed over it): ``dp/ep``, times ``cp``.
        dp_size: the ranks gradients are averaged over (``edp * ep``: dp, times cp); expert gradients are divided
            by it.
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
    tokens = None
    if config.cp > 1:
        tokens = _compat.flatten_mesh(root[("dp_replicate", "dp_shard", "cp")], "dp_cp")
        # torchtitan's dp_shard_cp: ZeRO shards (and averages gradients) over dp_shard x cp. Slicing the flattened
        # axis back out of the root is the one way to get a sub-mesh FSDP2 and DTensor accept next to tp (same
        # root); torch 2.13 warns that it will change, so the warning is kept out of users' logs here.
        _compat.flatten_mesh(root[("dp_shard", "cp")], "dp_shard_cp")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            dp_2d = root[("dp_replicate", "dp_shard_cp")]
            dp_tp = root[("dp_replicate", "dp_shard_cp", "tp")]
    experts = _expert_mesh(root, config.ep, device_type) if config.ep > 1 else None
    return ParallelMesh(root=root, dp=dp, dp_2d=dp_2d, tp=root["tp"], dp_tp=dp_tp, cp=root["cp"], experts=experts,
                        tokens=tokens)  # fmt: skip


def _expert_mesh(root: DeviceMesh, ep: int, device_type: str) -> ExpertMesh:
    # Every rank's data-parallel ranks, (pp, tp, cp, dp) -> (pp, tp, cp * dp/ep, ep): a separate mesh over the same
    # ranks (DeviceMesh cannot unflatten an axis of the root), built collectively on every rank. ep stays within
    # one cp index (the ranks holding the same positions of different samples); edp takes cp with dp/ep, since cp
    # ranks hold the same experts and average their gradients like data-parallel ones.
    ranks = root.mesh.permute(0, 4, 3, 1, 2).reshape(root.size(0), root.size(4), -1, ep)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "tp", "edp", "ep"))
    tp_ep = mesh[("tp", "ep")] if root.size(4) > 1 else None
    return ExpertMesh(ep=mesh["ep"], edp=mesh["edp"], dp_size=mesh["edp"].size() * ep, tp_ep=tp_ep)
