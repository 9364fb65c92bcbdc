"""4 ranks (dp_shard 2 x tp 2): `lightning_par.checkpoint.full_tensor` of FSDP2-over-tp parameters, against each
parameter's full value before it was laid out, for even and uneven shapes (tests/test_nested_full_tensor.py)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_par import _compat
from lightning_par.checkpoint import full_tensor


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    # Rows 7 (colwise: tp chunks 4 + 3, each split again over dp) and 9; a row-split weight.
    model = nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 9), nn.Linear(9, 10), nn.Linear(10, 4))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel(),
                                           "3": RowwiseParallel()})  # fmt: skip
    fully_shard(model, mesh=mesh["dp_shard"])
    nested = 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        nested += any(isinstance(pl, _compat.StridedShard) for pl in p.placements)
        got = full_tensor(p)
        assert got.shape == want[name].shape and torch.equal(got, want[name]), name
    if dist.get_rank() == 0:
        torch.save({"nested": nested, "params": len(want)}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
