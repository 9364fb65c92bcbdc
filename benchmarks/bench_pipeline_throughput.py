"""Pipeline throughput on real models: samples/s of the Trainer-driven ``pipe`` strategy against one rank.

Reproduce (one driver launches every run itself, one torch thread per process; 23 min on the 2-core machine on
2026-12-02, ~2 min with ``--quick``; results and reading: docs/benchmarks_history.md, "Pipeline throughput"):

    python benchmarks/bench_pipeline_throughput.py                 # GPT and HF Llama, pp 2 and 4, 4 rounds
    python benchmarks/bench_pipeline_throughput.py --quick         # smoke: tiny models, 1 round, pp 2
    python benchmarks/bench_pipeline_throughput.py --profile /tmp/prof --models gpt --pps 2 --rounds 1

Compared, per model: ``pipe`` on pp in {2, 4} ranks (``1f1b`` and ``interleaved_1f1b``, m in {4, 8}
microbatches) against the same model on one rank at the same global batch B = m x ``--mb``. The one-rank baseline
runs the same microbatches: plain Lightning on one device with ``accumulate_grad_batches=m`` over batches of
``--mb`` sequences, so every microbatch is the same computation in both (a CPU runs a bigger batch at a better
rate, which would charge the pipeline for its smaller GEMMs); one optimizer step per global batch in both.
``--whole-batch`` adds the one-forward-per-batch baseline for information. Default size (8 layers x 256, sequence
256, microbatch 2): one microbatch's forward + backward of the whole model is ~330-370 ms on one core, so the
smallest stage here (1/8 of the model: interleaved 1F1B on 4 ranks) does >= 30 ms of work per microbatch.

- Ideal speedup: pp x (1 - bubble), the bubble from torch's own action table replayed with free communication
  (`lightning_par.analysis.pipeline_timeline`): (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) for interleaved 1F1B
  (v = 2 stages per rank). The table reports speedup / ideal.
- Every process runs one torch thread, the baseline included: pp = 2 uses both cores. pp = 4 puts 4 ranks on 2
  cores and cannot reach the ideal physically (at most 2x whatever the schedule).
- Core scaling s: the baseline run twice at once, as two independent processes (t alone / t with the other core
  busy): what one core delivers while the other works, which the ideal assumes is what it delivers alone (shared
  L3 and memory bandwidth, the host's scheduling of this VM's two vCPUs). "here" = min(ideal, 2 cores) x s is what
  this machine allows; speedup / here separates the pipeline's losses from the machine's.
- Rounds alternate the order of the runs (ABBA: baseline, baseline x2, pp 2, pp 4, then reversed) so drift hits
  all alike; each run is a fresh process and Trainer. Per run the median step time (optimizer step to optimizer
  step, after warm-up steps); per round the speedup; reported: the median over rounds and the per-round range,
  the machine's 1-minute load before and after each round.
- From the pipeline's own trace (`PipelineRunner.trace`, rank by rank): the mean time of one action (forward or
  backward of one stage microbatch, host time included), the ranks' waits on peers inside the schedule as a
  fraction of its time (fill before a rank's first action and drain after its last are not in it), the step time
  outside the schedule (Lightning's loop, the optimizer, the last stage's loss and logs sent out), and the work of
  all ranks together over the baseline's step ("work / 1 rank": > 1 is work the pipeline adds; on 4 ranks over 2
  cores it includes time a rank was runnable but had no core).
- ``--profile DIR``: cProfile (main thread's CPU time) of each rank's timed steps, one file per config and rank
  (``pstats`` reads them).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

torch.set_num_threads(1)  # before any op: one core per process, the baseline too

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the strategy names, "pipe" among them)
from lightning_par import _compat  # noqa: E402
from lightning_par.analysis.pipeline_timeline import one_f_one_b_order, replay  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.models._lm import CausalLM  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

SCHEDULES = ("1f1b", "interleaved_1f1b")
CORES = 2


class HFLlama(CausalLM):
    """A Hugging Face ``LlamaForCausalLM`` from a ``LlamaConfig`` (no download) behind the suite's training step
    (``CausalLM``: the GPT's loss, logging and AdamW), so the two models differ only in their networks."""

    def __init__(self, layers: int, dim: int, seq: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__(256, 3e-4, 0.1, 0, 0, (0.9, 0.95))
        # SwiGLU width 8/3 of the model's (Llama's ratio), GQA with 2 query heads per key/value head.
        shape: dict[str, Any] = dict(vocab_size=256, hidden_size=dim, intermediate_size=dim * 8 // 3 // 8 * 8,
                                     num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                     max_position_embeddings=seq, attn_implementation="sdpa")  # fmt: skip
        self.model = LlamaForCausalLM(LlamaConfig(**shape))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


def build(name: str, args: argparse.Namespace) -> L.LightningModule:
    """The model ``name`` at the benchmark's size, seeded alike on every run."""
    L.seed_everything(0, verbose=False)
    if name == "gpt":
        return GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.dim)
    return HFLlama(args.layers, args.dim, args.seq)


def ideal(schedule: str, pp: int, m: int) -> tuple[float, float]:
    """(bubble of torch's action table replayed with F : B = 1 : 2, the textbook closed form)."""
    if schedule == "1f1b":
        return replay(one_f_one_b_order(pp, m), 1, 1, 1).bubble, (pp - 1) / (m + pp - 1)
    table = {r: _compat.schedule_rank_actions(schedule, 2, pp, m, r) for r in range(pp)}
    return replay(table, 1, 1, 1).bubble, (pp - 1) / (2 * m + pp - 1)


class _Steps(L.Callback):
    """Time of each optimizer step (end to end, loop included) and this rank's pipeline trace of each."""

    def __init__(self, warmup: int, profile: str | None) -> None:
        self.warmup, self.ends, self.traces = warmup, [], []  # type: ignore[var-annotated]
        # CPU time of the main thread: what the host spends, not the waits; steady on a shared machine.
        self.prof = cProfile.Profile(time.thread_time) if profile else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if (idx + 1) % trainer.accumulate_grad_batches:
            return
        self.ends.append(time.perf_counter())
        if self.prof is not None and len(self.ends) == self.warmup + 1:
            self.prof.enable()
        run = getattr(trainer.strategy, "parallel_run", None)
        record = run.pipeline.trace.last if run is not None and run.pipeline is not None else None
        if record is not None and len(self.ends) > self.warmup + 1:
            actions = [s.end - s.start for s in record.spans if s.kind != "wait"]
            self.traces.append((sum(actions), len(actions), record.waiting, record.duration))

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.prof is not None:
            self.prof.disable()


def run_config(args: argparse.Namespace, model: str, schedule: str, m: int, whole: bool) -> dict[str, Any]:
    """One fresh Trainer.fit; on rank 0 the median step time and the ranks' trace summary."""
    pp = int(os.environ.get("WORLD_SIZE", "1"))  # the first fit starts the process group (Lightning's launcher)
    batch = m * args.mb
    if pp > 1:
        entry = StrategyRegistry["pipe"]  # the registered name, with its knobs: what strategy="pipe" builds
        strategy: Any = entry["strategy"](**entry["init_params"], pp_schedule=schedule, microbatches=m)
        per_loader, accumulate = batch, 1
    else:
        strategy, per_loader, accumulate = "auto", batch if whole else args.mb, 1 if whole else m
    steps = args.warmup + args.steps + 1  # the first step end starts the clock
    data = ByteTextDataModule(seq_len=args.seq, batch_size=per_loader, num_samples=steps * batch)
    timer = _Steps(args.warmup, args.profile if pp > 1 else None)
    trainer = L.Trainer(accelerator="cpu", devices=pp, strategy=strategy, max_steps=steps, logger=False,
                        accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[timer])  # fmt: skip
    trainer.fit(build(model, args), datamodule=data)
    times = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.warmup :]
    if len(times) != args.steps:
        raise RuntimeError(f"{model} pp={pp} {schedule} m={m}: timed {len(times)} steps, expected {args.steps}")
    out: dict[str, Any] = {"model": model, "pp": pp, "schedule": schedule if pp > 1 else "-", "m": m,
                           "whole": whole, "step": statistics.median(times)}  # fmt: skip
    if pp == 1:
        return out
    if timer.prof is not None:
        os.makedirs(args.profile, exist_ok=True)
        timer.prof.dump_stats(f"{args.profile}/{model}_pp{pp}_{schedule}_m{m}_rank{dist.get_rank()}.prof")
    every: list[Any] = [None] * pp
    dist.all_gather_object(every, timer.traces)
    # Per step: the action mean, the ranks' summed work and their mean wait fraction; then the median over steps.
    per_step = list(zip(*every))
    out["action_ms"] = 1e3 * statistics.median(sum(r[0] for r in s) / sum(r[1] for r in s) for s in per_step)
    out["work"] = statistics.median(sum(r[0] for r in s) for s in per_step)
    out["wait"] = statistics.median(statistics.mean(r[2] / r[3] for r in s) for s in per_step)
    # Step time outside the schedule (Lightning's loop, the optimizer, the loss and logs sent from the last stage).
    out["outside"] = out["step"] - statistics.median(max(r[3] for r in s) for s in per_step)
    return out


def worker(args: argparse.Namespace) -> None:
    """Every (schedule, m) of one model on this process group (or one process): ``RESULT {json}`` lines."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    pp = int(os.environ.get("WORLD_SIZE", "1"))
    configs = [(s, m, False) for s in (SCHEDULES if pp > 1 else ("-",)) for m in args.ms]
    if pp == 1 and args.whole_batch:
        configs += [("-", m, True) for m in args.ms]
    for schedule, m, whole in configs[::-1] if args.reverse else configs:
        result = run_config(args, args.model, schedule, m, whole)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    clean_exit()


def launch(args: argparse.Namespace, model: str, unit: str, reverse: bool) -> list[dict[str, Any]]:
    """Run the worker for ``model`` on ``unit``: "1" one process, "1x2" two independent single-process runs at once
    (both cores busy; their mean), "2" / "4" torchrun with that many ranks. Returns its results."""
    flags = ["--worker", "--model", model, "--ms", *map(str, args.ms), "--mb", str(args.mb), "--seq",
             str(args.seq), "--layers", str(args.layers), "--dim", str(args.dim), "--warmup", str(args.warmup),
             "--steps", str(args.steps)] + (["--reverse"] if reverse else [])  # fmt: skip
    if unit == "1":
        flags += ["--whole-batch"] if args.whole_batch else []
    elif unit != "1x2":
        flags += ["--profile", args.profile] if args.profile else []
    cmd = [sys.executable, __file__, *flags]
    if unit not in ("1", "1x2"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={unit}", *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2 if unit == "1x2" else 1)]  # fmt: skip
    outs = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}{err[-3000:]}")
        outs.append([json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")])
    for a, b in zip(*outs) if unit == "1x2" else ():
        a["step"], a["pp"] = (a["step"] + b["step"]) / 2, 0  # pp 0 marks the both-cores-busy baseline
    return outs[0]


def _median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def report(args: argparse.Namespace, runs: list[list[dict[str, Any]]], loads: list[float], wall: float) -> None:
    """The table: per model, pp, schedule and m, the speedup over one rank per round, against the ideal."""
    base: dict[tuple, list[float]] = {}  # (model, m, whole, alone) -> step time per round
    pipe: dict[tuple, list[dict[str, Any]]] = {}
    for rnd in runs:
        for r in rnd:
            if r["pp"] <= 1:
                base.setdefault((r["model"], r["m"], r["whole"], r["pp"] == 1), []).append(r["step"])
            else:
                pipe.setdefault((r["model"], r["pp"], r["schedule"], r["m"]), []).append(r)
    print(f"\n{args.layers} layers x {args.dim}, seq {args.seq}, microbatch {args.mb} sequences; {args.rounds} "
          f"rounds x {args.steps} timed steps (+{args.warmup} warm-up); took {wall / 60:.1f} min; 1-min load "
          f"average before {loads[0]:.2f}, after each round {[round(x, 2) for x in loads[1:]]}\n")  # fmt: skip
    print("| model | pp | schedule | m | B | 1 rank ms/step | pipe ms/step | speedup: median [round range] | bubble "
          "| ideal pp(1-b) | **speedup / ideal** | core scaling s | here: min(ideal, 2) s | speedup / here | ms per "
          "action | waits | work / 1 rank | outside schedule ms |")  # fmt: skip
    print("|" + "---|" * 18)
    for (model, pp, schedule, m), rs in sorted(pipe.items()):
        one = base[(model, m, False, True)]
        speed = [b / r["step"] for b, r in zip(one, rs)]
        busy = base.get((model, m, False, False))
        scaling = [a / b for a, b in zip(one, busy)] if busy else [1.0]
        bubble, closed = ideal(schedule, pp, m)
        best = pp * (1 - bubble)
        here = min(best, CORES) * statistics.median(scaling)
        mid = statistics.median(speed)
        print(f"| {model} | {pp} | {schedule} | {m} | {m * args.mb} | {statistics.median(one) * 1e3:.0f} | "
              f"{statistics.median(r['step'] for r in rs) * 1e3:.0f} | {_median_range(speed)} | {bubble:.3f}"
              f"{'' if abs(bubble - closed) < 5e-4 else f' (closed form {closed:.3f})'} | "
              f"{best:.3f} | **{mid / best:.3f}** | {_median_range(scaling)} | {here:.3f} | {mid / here:.3f} | "
              f"{statistics.median(r['action_ms'] for r in rs):.1f} | {statistics.median(r['wait'] for r in rs):.3f} "
              f"| {statistics.median(r['work'] for r in rs) / statistics.median(one):.3f} | "
              f"{statistics.median(r['outside'] for r in rs) * 1e3:.0f} |")  # fmt: skip
    for (model, m, whole, _), ts in sorted(base.items()):
        if whole:
            acc = statistics.median(base[(model, m, False, True)])
            print(
                f"\n{model} m={m}: one rank, whole batch in one forward {statistics.median(ts) * 1e3:.0f} ms/step "
                f"against {acc * 1e3:.0f} ms accumulating {m} microbatches ({acc / statistics.median(ts):.3f}x)"
            )
    if 4 in args.pps:
        print(f"\npp = 4 runs 4 ranks on {CORES} cores: no schedule passes {CORES}x there, whatever its bubble.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke: tiny models, 1 round, pp 2, 2 timed steps")
    parser.add_argument("--models", nargs="*", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--pps", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--ms", nargs="*", type=int, default=[4, 8], help="microbatches per step")
    parser.add_argument("--mb", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help=">= 8: interleaved pp 4 needs a block per stage")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4, help="even, so the ABBA order balances")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--whole-batch", action="store_true", help="also the one-forward-per-batch baseline")
    parser.add_argument(
        "--no-core-scaling",
        dest="core_scaling",
        action="store_false",
        help="skip the baseline run twice at once (what a core gives while the other is busy)",
    )
    parser.add_argument("--profile", default=None, help="folder for cProfile files of the pipe runs' timed steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup, args.pps, args.dim, args.seq = 1, 2, 1, [2], 64, 64
    loads, runs = [os.getloadavg()[0]], []
    start = time.perf_counter()
    units = ["1", *(["1x2"] if args.core_scaling else []), *map(str, args.pps)]
    for r in range(args.rounds):
        results = []
        for model in args.models:
            for unit in units if r % 2 == 0 else units[::-1]:
                t0, load = time.perf_counter(), os.getloadavg()[0]
                results += launch(args, model, unit, reverse=r % 2 == 1)
                print(f"round {r + 1}/{args.rounds} {model} {unit}: {time.perf_counter() - t0:.0f} s, load "
                      f"{load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        runs.append(results)
        loads.append(os.getloadavg()[0])
    report(args, runs, loads, time.perf_counter() - start)


if __name__ == "__main__":
    main()
