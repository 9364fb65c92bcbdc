"""The optimizer step under tensor parallelism at ZeRO-0: DTensor parameters against the plain views that
`lightning_par.parallel.zero.local_views` hands element-wise optimizers.

Launch (one process, one thread; a 1-rank mesh, where DTensor's dispatch costs what it costs on any mesh):

    OMP_NUM_THREADS=1 python benchmarks/bench_tp_optimizer.py [--quick]

The model is `bench_overhead.py`'s tiny GPT (2 layers, n_embd 64, 29 parameters). Its trunk blocks' matrices become
``Shard(0)`` DTensors (what a tp plan makes of them), everything else stays plain, in AdamW's two usual param groups
(decay / no decay), each parameter with a gradient. Configurations, each a fresh AdamW:

- ``dtensor``: the groups hold the DTensors next to plain tensors, as before; torch's foreach kernels refuse such
  lists, so this is the single-tensor loop, every op of it on a DTensor dispatched through DTensor;
- ``views``: the same groups over plain tensors (the views), single-tensor loop (torch's CPU default);
- ``views_foreach``: the same with ``foreach=True`` (torch's CUDA default, which ``dtensor`` cannot run).

Rounds alternate the order (ABBA); per round the mean ms of ``--steps`` steps after 3 warm-up steps; reported: the
median over rounds with the range. A hand-run benchmark: it asserts nothing. Results: docs/benchmarks_history.md
(per-step overhead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

torch.set_num_threads(1)  # before any op

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from lightning_par.models import GPT  # noqa: E402


def _optimizer(model: torch.nn.Module, mesh: object, dtensors: bool, foreach: bool | None) -> torch.optim.Optimizer:
    params = []
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if dtensors and ".h." in name and t.dim() == 2:  # a trunk block's matrix: split by the tp plan
            t = distribute_tensor(t, mesh, [Shard(0)])  # type: ignore[arg-type]
        q = torch.nn.Parameter(t)
        q.grad = torch.randn_like(q)
        params.append(q)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=1e-3, foreach=foreach)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 3 steps")
    parser.add_argument("--rounds", type=int, default=6, help="even, so ABBA order balances")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 3
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    configs = {
        "dtensor": _optimizer(model, mesh, dtensors=True, foreach=None),
        "views": _optimizer(model, mesh, dtensors=False, foreach=None),
        "views_foreach": _optimizer(model, mesh, dtensors=False, foreach=True),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            opt = configs[name]
            for _ in range(3):
                opt.step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / args.steps)
    print(f"\nAdamW over the tiny GPT's {sum(1 for _ in model.parameters())} parameters; {args.rounds} rounds x "
          f"{args.steps} steps; 1-min load {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")  # fmt: skip
    print("| configuration | ms per step: median [min, max] over rounds |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} [{min(ts) * 1e3:.2f}, {max(ts) * 1e3:.2f}] |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
