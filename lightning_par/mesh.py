"""One DeviceMesh with named axes for every parallel dimension.

Axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. tp is innermost so its ranks are adjacent
(same node, fast links); pp is outermost because it sends the least data. Every axis exists even at size 1, so
code never has to assume a 1-D mesh. ``ep`` is carved out of the data-parallel ranks when it lands.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_par.config import ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(config: ParallelConfig, device_type: str) -> DeviceMesh:
    """Build the job's mesh from a resolved config.

    Args:
        config: a config returned by `ParallelConfig.resolve` (no ``-1`` degrees left).
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        a 4-D mesh named by `MESH_AXES`, plus the flattened ``dp`` axis (``dp_replicate`` x ``dp_shard``).
    """
    shape = tuple(getattr(config, axis) for axis in MESH_AXES)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    # One "dp" axis for collectives that span all data-parallel ranks (loss averaging, the sampler).
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D (``dp_replicate``, ``dp_shard``) sub-mesh that ZeRO shards over (HSDP when both are > 1)."""
    return mesh[("dp_replicate", "dp_shard")]
