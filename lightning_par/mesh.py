"""One DeviceMesh with named axes for every parallel dimension.

Axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. tp is innermost so its ranks are adjacent
(same node, fast links); pp is outermost because it sends the least data. Every axis exists even at size 1, so
code never has to assume a 1-D mesh. ``ep`` is carved out of the data-parallel ranks when it lands.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_par.config import ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelMesh:
    """The job's meshes.

    Args:
        root: the 4-D mesh named by `MESH_AXES`.
        dp: all data-parallel ranks of this rank's replica group as one flat axis (loss averaging, the sampler,
            metrics); kept here because torch deprecates slicing a flattened axis back out of the root.
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


def build_mesh(config: ParallelConfig, device_type: str) -> ParallelMesh:
    """Build the job's meshes from a resolved config.

    Args:
        config: a config returned by `ParallelConfig.resolve` (no ``-1`` degrees left).
        device_type: ``"cpu"`` or ``"cuda"``.
    """
    shape = tuple(getattr(config, axis) for axis in MESH_AXES)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    dp_2d = root[("dp_replicate", "dp_shard")]
    dp_tp = root[("dp_replicate", "dp_shard", "tp")]
    return ParallelMesh(root=root, dp=dp_2d._flatten("dp"), dp_2d=dp_2d, tp=root["tp"], dp_tp=dp_tp)
