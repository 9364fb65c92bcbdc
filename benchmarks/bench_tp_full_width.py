"""Tensor parallelism on code that sizes its tensors from the full width: what the gathered fallback costs against
the same attention written to run on its heads' slices.

Launch (2 ranks = tp 2, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp_full_width.py [--quick]

Two GPTs with the same weights and the same math, differing only in how their attention reads sizes:

- ``full_width``: nanoGPT's code (``B, T, C = x.size()``, ``split(self.n_embd)``, ``view(B, T, C)``). tp keeps its
  projections split and runs the attention on their gathered outputs (`lightning_par.parallel.tensor.full_width`):
  per layer an all-gather of the ``3 x n_embd`` q/k/v forward and of the ``n_embd`` attention output's gradient
  backward, and the attention itself computed on every rank;
- ``heads``: ``chunk(3)`` and ``view(B, T, self.n_head, -1)``, which tp rewrites to this rank's heads (the usual
  path: no extra collective, the attention split over the ranks).

Both are laid out by `infer_tp_plan` / `check_local_shapes` / `apply_tensor_parallel` (sequence parallelism on),
then timed forward + backward (no optimizer) on the same batch, alternated ABBA per round; reported per model the
median over rounds of the mean step time, and the per-round ratio full_width / heads with its median. The losses of
the two must agree (checked), so the ratio compares equal work. A hand-run benchmark: results in
docs/benchmarks.md ("Tensor parallelism").
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from lightning_par.parallel.tensor import infer_tp_plan  # noqa: E402
from lightning_par.parallel.tensor.apply import apply_tensor_parallel  # noqa: E402
from lightning_par.parallel.tensor.check import check_local_shapes  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class Attention(nn.Module):
    def __init__(self, e: int, heads: int, full_width: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(e, 3 * e), nn.Linear(e, e)
        self.n_head, self.n_embd, self.full_width = heads, e, full_width

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        if self.full_width:  # nanoGPT's
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        else:  # sizes from the head count tp rewrites
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.c_proj(y.reshape(B, T, C) if self.full_width else y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, e: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(e, 4 * e), nn.Linear(4 * e, e)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, e: int, heads: int, full_width: bool) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(e), Attention(e, heads, full_width)
        self.ln_2, self.mlp = nn.LayerNorm(e), MLP(e)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, e: int, heads: int, layers: int, length: int, full_width: bool) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, e), nn.Embedding(length, e)
        self.h = nn.ModuleList([Block(e, heads, full_width) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(e), nn.Linear(e, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def build(full_width: bool, args: argparse.Namespace, mesh: object) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(256, args.n_embd, args.n_head, args.layers, args.seq, full_width)
    plan = check_local_shapes(model, infer_tp_plan(model), mesh.size())  # type: ignore[attr-defined]
    assert bool(plan.gathered) == full_width, plan.gathered
    apply_tensor_parallel(model, mesh, plan)  # type: ignore[arg-type]
    return model


def step(model: nn.Module, batch: tuple[Tensor, Tensor]) -> float:
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return float(loss.detach())


def timed(model: nn.Module, batch: tuple[Tensor, Tensor], steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, batch)
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2 steps, small sizes")
    parser.add_argument("--rounds", type=int, default=6, help="even, so ABBA order balances")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.n_embd, args.seq, args.layers = 2, 2, 64, 32, 2
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    models = {name: build(name == "full_width", args, mesh) for name in ("full_width", "heads")}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (args.batch, args.seq), generator=g),
             torch.randint(0, 256, (args.batch, args.seq), generator=g))  # fmt: skip
    losses = {name: step(m, batch) for name, m in models.items()}  # also the warm-up
    assert math.isclose(losses["full_width"], losses["heads"], rel_tol=1e-5), losses
    times: dict[str, list[float]] = {"full_width": [], "heads": []}
    for r in range(args.rounds):
        order = ("full_width", "heads") if r % 2 == 0 else ("heads", "full_width")
        for name in order:
            times[name].append(timed(models[name], batch, args.steps))
    if dist.get_rank() == 0:
        ratios = [a / b for a, b in zip(times["full_width"], times["heads"])]
        print(f"tp={dist.get_world_size()} n_embd={args.n_embd} heads={args.n_head} layers={args.layers} "
              f"batch={args.batch} seq={args.seq}; losses agree ({losses['full_width']:.6f})")  # fmt: skip
        print(f"forward+backward median ms: full_width {statistics.median(times['full_width']):.1f}, heads "
              f"{statistics.median(times['heads']):.1f}; full_width / heads per round {[round(x, 3) for x in ratios]}, "
              f"median {statistics.median(ratios):.3f}")  # fmt: skip
    clean_exit()


if __name__ == "__main__":
    main()
