"""fp8 training under ZeRO-3 (``fp8="emulate"`` on CPU): all-gather bytes per step against the formula and the bf16
run, and the loss curve against the bf16 run.

Launch (2 ranks):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_fp8.py [--quick]

Both configurations train the same GPT from the same seed on the same batches (AdamW, ``bf16-mixed``): the blocks'
linear layers in fp8 (torchao's tensor-wise recipe, emulated: the same casts, multiplied in bf16) against plain
bf16. Every collective after the first step is counted by `lightning_par.parallel.comm_counter.CommCounter` (ring
convention, bytes per rank); the formula is the planner's (`lightning_par.planner.comm.comm_bytes` with the fp8
weights marked by `lightning_par.planner.fp8.mark_fp8`). Step time on CPU says nothing about fp8 (the emulation
only adds casts): the GPU check measures it. A hand-run benchmark: it asserts nothing. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from bench_zero3_int8 import _model, arguments, loss_gap, run  # noqa: E402  (the same fit, counter, model)

from lightning_par.planner.comm import comm_bytes  # noqa: E402
from lightning_par.planner.fp8 import mark_fp8  # noqa: E402
from lightning_par.planner.layout import Layout  # noqa: E402
from lightning_par.planner.params import specs_from_module  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


def main() -> None:
    args = arguments(__doc__)
    bf16_bytes, bf16 = run({}, args)
    fp8_bytes, fp8 = run({"fp8": "emulate"}, args)
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        model = _model(args)
        specs = mark_fp8(specs_from_module(model), model)
        layout = Layout(dp_shard=n, zero_stage=3, fp8=True, micro_batch_size=args.batch)
        formula = comm_bytes(specs, layout, args.batch * n, args.seq, args.embd, rank=0)["all_gather"] / 2**20
        share = sum(s.numel for s in specs if s.fp8) / sum(s.numel for s in specs)
        size = f"GPT n_layer={args.layers} n_embd={args.embd} ({sum(s.numel for s in specs) / 1e6:.2f} M parameters)"
        print(f"\n{size}, {share:.2f} of them in fp8 layers, {n} ranks, ZeRO-3, bf16-mixed, AdamW; {args.steps} "
              "steps; MiB per step after the first\n")  # fmt: skip
        print("| config | all-gather MiB / step | formula | measured / formula | / bf16 | reduce-scatter MiB / step |")
        print("|---|---|---|---|---|---|")
        ag, rs = bf16_bytes.get("all_gather", 0.0), bf16_bytes.get("reduce_scatter", 0.0)
        print(f"| bf16 | {ag:.3f} | | | 1.000 | {rs:.3f} |")
        fag, frs = fp8_bytes.get("all_gather", 0.0), fp8_bytes.get("reduce_scatter", 0.0)
        print(f"| fp8 | {fag:.3f} | {formula:.3f} | {fag / formula:.4f} | {fag / ag:.3f} | {frs:.3f} |")
        loss_gap(fp8, bf16, args.steps, "bf16")
    clean_exit()


if __name__ == "__main__":
    main()
