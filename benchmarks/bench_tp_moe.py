"""Expert parallelism under tensor parallelism: all-to-all bytes per MoE layer under ``tp_moe`` against the formula.

Launch (4 ranks):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_tp_moe.py [--quick]

Under ``tp_moe`` (tp 2 x dp 2, ep 2 over the dp ranks of each tp index) both tp ranks of a data-parallel rank hold
its T tokens, and each takes 1/tp of every expert's rows before the ep exchange (parallel/experts/with_tp.py). So a rank
sends ``k * T * d * bytes * (ep-1)/ep / tp`` per all-to-all under uniform routing (dropless), the same as a rank of
plain ``moe`` with T/tp tokens: the second run, ep 2 over dp 4 at the same global batch, is that layout. Both are
measured on the same step with the all-to-all counter of ``bench_moe.py``; four row all-to-alls per layer and step
(dispatch and combine, and their transposes in backward). Step time: median of alternated rounds, as a ratio.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rounds import finish, ratio_line  # noqa: E402
from bench_moe import BATCH, SEQ, _Counter, _model  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp_moe": {"tp": 2, "ep": 2},  # dp 2 from the world of 4
    "moe_dp4": {"ep": 2},  # ep 2 over dp 4: T/2 tokens per rank
}


class _Bytes(L.Callback):
    def __init__(self, counter: _Counter, measure_step: int) -> None:
        self.counter, self.measure_step = counter, measure_step
        self.rows: list[int] = []
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counter.on = batch_idx == self.measure_step
        self.counter.calls.clear()
        self._t = _now()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(_now() - self._t)
        if batch_idx == self.measure_step:
            self.counter.on = False
            self.rows = [b for kind, b in self.counter.calls if kind == "rows"]


def _now() -> float:
    import time

    return time.perf_counter()


def _run(layout: dict[str, Any], steps: int, counter: _Counter) -> tuple[_Bytes, int]:
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])  # the process group starts inside fit
    dp = world // layout.get("tp", 1)
    probe = _Bytes(counter, measure_step=steps - 1)
    data = ByteTextDataModule(seq_len=SEQ, batch_size=BATCH // dp, num_samples=BATCH * steps, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(**layout),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe])  # fmt: skip
    trainer.fit(_model(None), datamodule=data)
    return probe, dp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    steps, rounds, warm = (4, 1, 1) if args.quick else (10, 3, 2)
    model = _model(None)
    k, d, layers = 2, model.hidden_size, 4
    out: list[str] = []
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with _Counter() as counter:
        for r in range(rounds):
            for name, layout in LAYOUTS.items():
                probe, dp = _run(layout, steps, counter)
                times[name].append(statistics.median(probe.times[warm:]) * 1e3)
                if r:
                    continue
                tokens = BATCH // dp * SEQ  # this rank's data-parallel batch
                tp, ep = layout.get("tp", 1), layout["ep"]
                formula = k * tokens * d * 4 * (ep - 1) / ep / tp
                per = torch.tensor([sum(probe.rows) / layers / 4], dtype=torch.float64)
                every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
                dist.all_gather(every, per)
                got = [float(x) for x in every]
                out.append(
                    f"{name}: row all-to-alls per layer {len(probe.rows) / layers:.0f}; KiB per all-to-all per layer, "
                    f"ranks 0-3 {[round(g / 2**10, 2) for g in got]}, mean {statistics.mean(got) / 2**10:.2f}; "
                    f"formula k*T*d*4*(ep-1)/ep/tp {formula / 2**10:.2f} KiB (mean measured/formula "
                    f"{statistics.mean(got) / formula:.3f})"
                )
    out.append(ratio_line("tp_moe", times["tp_moe"], times["moe_dp4"], "moe ep 2 over dp 4"))
    finish(out)


if __name__ == "__main__":
    main()
