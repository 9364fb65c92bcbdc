"""Expert-parallel dispatch/combine with uneven counts, under torchrun (2 ranks): ``python _moe_a2a_worker.py OUT``.

Each round gives every rank a hand-picked count of rows per expert, including experts that receive no rows, a
rank that sends nothing, and a rank that receives nothing. The sharded experts (E/ep per rank, behind the
dispatch hooks) must return what the full experts return on the same rows, and give the same gradients: for the
rows, and for each expert the sum over ranks of the full experts' gradients. Rank 0 writes the max errors.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from lightning_par.nn import Experts  # noqa: E402
from lightning_par.parallel.experts.dispatch import ExpertDispatch  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

E, D, F = 4, 6, 10
# ROUNDS[round][rank] = rows per expert that rank routes (sums: rank 0 -> experts 0 and 3, ...).
ROUNDS = [
    [[3, 0, 0, 2], [0, 0, 0, 0]],  # rank 1 sends nothing; experts 1 and 2 get nothing
    [[0, 0, 0, 0], [1, 0, 5, 0]],  # rank 0 sends nothing
    [[0, 0, 4, 1], [0, 0, 2, 0]],  # rank 0's experts get nothing from anyone
    [[0, 0, 0, 0], [0, 0, 0, 0]],  # no rows at all
    [[2, 1, 1, 3], [1, 2, 3, 1]],
]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = Experts(E, D, F, activation="silu", gated=True)
    n_local = E // world
    local = Experts(n_local, D, F, activation="silu", gated=True)
    with torch.no_grad():
        for name, p in local.named_parameters():
            p.copy_(getattr(full, name)[rank * n_local : (rank + 1) * n_local])
    hooks = ExpertDispatch(dist.group.WORLD, world, n_local)
    local.register_forward_pre_hook(hooks.dispatch)
    local.register_forward_hook(hooks.combine)
    errors: list[float] = []
    for r, counts_per_rank in enumerate(ROUNDS):
        counts = torch.tensor(counts_per_rank[rank])
        gen = torch.Generator().manual_seed(100 * r + rank)
        x = torch.randn(int(counts.sum()), D, generator=gen, requires_grad=True)
        weight = torch.randn(int(counts.sum()), D, generator=gen)
        x_ref = x.detach().clone().requires_grad_(True)
        full.zero_grad()
        local.zero_grad()
        out = local(x, counts)
        ref = full(x_ref, counts)
        (out * weight).sum().backward()
        (ref * weight).sum().backward()
        errors.append((out - ref).abs().max().item() if out.numel() else 0.0)
        errors.append((x.grad - x_ref.grad).abs().max().item() if x.numel() else 0.0)
        for name, p in local.named_parameters():
            want = getattr(full, name).grad
            want = torch.zeros_like(getattr(full, name)) if want is None else want.clone()
            dist.all_reduce(want)  # each expert's gradient sums the rows of every rank
            got = torch.zeros_like(p) if p.grad is None else p.grad
            errors.append((got - want[rank * n_local : (rank + 1) * n_local]).abs().max().item())
        assert out.shape == x.shape, (out.shape, x.shape)
    all_errors: list = [None] * world
    dist.all_gather_object(all_errors, errors)
    if rank == 0:
        torch.save({"errors": all_errors, "rounds": len(ROUNDS)}, sys.argv[1])
    clean_exit()


if __name__ == "__main__":
    main()
