"""Where a layout's step time goes on a GPU: torch.profiler over a few steps of the GPU check's 1 B Llama.

The throughput section of ``gpu_check.py`` gives ratios; this gives the operators behind a ratio, so that a layout
slower than its baseline (``zero1`` / ``zero2`` against ``ddp`` at world 1, say) can be explained before it is
changed. One table per strategy, operators sorted by their own device time, written to ``--out``:

    PYTHONPATH=. python benchmarks/gpu_profile.py --out gpu_profile zero2 ddp

On a CPU (``--smoke``) it profiles the tiny Llama, to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_fits import LLAMA_1B, LLAMA_SMOKE, fit, tokens

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.models import Llama


class _Profiled(L.Callback):
    """Steps the profiler once per training step: ``wait`` steps of warm-up, then ``active`` recorded ones."""

    def __init__(self, prof: profile) -> None:
        self.prof = prof

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.prof.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategies", nargs="+", help="registered strategy names, e.g. zero2 ddp")
    parser.add_argument("--out", type=Path, required=True, help="folder for one table per strategy")
    parser.add_argument("--smoke", action="store_true", help="the tiny Llama, on whatever device there is")
    parser.add_argument("--rows", type=int, default=30, help="operators per table")
    args = parser.parse_args()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    config = LLAMA_SMOKE if args.smoke or accelerator == "cpu" else LLAMA_1B
    wait, active = 3, 3
    batch = 2 if accelerator == "cpu" else 4
    data = tokens(batch * (wait + active + 1), config["max_seq_len"], config["vocab_size"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator == "cuda" else [])
    sort = "self_cuda_time_total" if accelerator == "cuda" else "self_cpu_time_total"
    args.out.mkdir(parents=True, exist_ok=True)
    for strategy in args.strategies:
        with profile(activities=activities, schedule=schedule(wait=wait, warmup=0, active=active)) as prof:
            fit(lambda: Llama(**config), strategy, data, batch=batch, steps=wait + active, accelerator=accelerator,
                precision="bf16-mixed", callbacks=[_Profiled(prof)])  # fmt: skip
        table = prof.key_averages().table(sort_by=sort, row_limit=args.rows)
        (args.out / f"{strategy}.txt").write_text(table)
        print(f"## {strategy} ({active} steps)\n{table}", flush=True)
        del prof
        gc.collect()
        if accelerator == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
