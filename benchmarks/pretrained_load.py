"""Starting from pretrained weights: per-rank peak memory, set-up time and bytes read, eager vs meta + sharded load.

Launch (plain python: it writes the checkpoint once, then starts one ``torchrun --standalone --nproc-per-node 4``
job per configuration and round):

    OMP_NUM_THREADS=1 python benchmarks/pretrained_load.py [--model mid] [--only zero3,pipe] [--rounds 3] \
        [--dir /tmp] [--seq 32]

Configurations, 4 ranks over gloo on CPU, fp32, SGD without momentum, 1 optimizer step (as in ``meta_memory.py``,
whose model shapes, strategies and VmHWM phase marks this script imports):

- ``eager`` (what a user does today): ``LlamaForCausalLM.from_pretrained(folder)`` in the LightningModule's
  ``__init__`` on every rank, then the strategy moves, broadcasts and shards it;
- ``meta``: the model built in ``configure_model()`` (on the meta device under every lightning_par strategy) and
  ``make_strategy(..., pretrained=folder)``: once the model is laid out, each rank allocates its share and reads
  only its region of each tensor from the folder (``lightning_par/checkpoint/pretrained/load.py``).

The folder is ``LlamaForCausalLM(config).save_pretrained(...)`` (one ``model.safetensors``), written on local disk
in a child process before the first job and deleted at the end. It is then in the page cache: every job reads
memory, not the disk, so times are those of a warm cache (a cold read adds the file's size / disk bandwidth to
eager, and a quarter of it to meta under zero3).

Set-up time: from before the module's construction (eager: ``from_pretrained``) to ``on_train_start``, slowest
rank; rounds alternate eager and meta, the order reversed every round (ABBA), so a drift of the machine's load
cancels. The first round of each configuration trains one step (its memory); later rounds end at
``on_train_start`` (a 0.43 B step takes ~60 s here, the set-up ~10 s).

Memory: each phase's VmHWM above the baseline (``meta_memory.Marks``). VmHWM counts the file pages a rank has
mapped and touched (safetensors reads through ``mmap``) as well as its own memory, so the script also records
RssAnon (the rank's own memory) and RssFile (mapped file pages: shared page cache, clean, reclaimable) after every
tensor ``load_pretrained`` fills. Bytes read: ``PretrainedReport.bytes_read`` (meta), the file's size (eager:
``from_pretrained`` reads every tensor); ``read_bytes`` of ``/proc/self/io`` (what reached the disk) is recorded too.
Asserts nothing; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meta_memory import (
    MODELS,
    STRATEGIES,
    GiB,
    Marks,
    MiB,
    _available,
    _llama_config,
    _mib,
    _status,
    _storage_bytes,
    _wait_for_memory,
    _wrap,
)

WRAPPED = ("capture_init", "_split", "sync_module_states", "apply_fsdp", "materialize", "load_pretrained",
           "ReplicatedZero")  # fmt: skip


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def write_folder(model: str, folder: str) -> None:
    """The checkpoint every job reads: a freshly initialised model, saved as Hugging Face does (safetensors)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(model)).save_pretrained(folder)


def _make_module(model: str, init: str, folder: str) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    class PretrainedLlamaLM(L.LightningModule):
        """eager: ``from_pretrained`` in ``__init__``; meta: built in ``configure_model``, weights from the strategy."""

        def __init__(self) -> None:
            super().__init__()
            if init == "eager":
                self.model = LlamaForCausalLM.from_pretrained(folder)

        def configure_model(self) -> None:
            if not hasattr(self, "model"):  # on the meta device under every lightning_par strategy
                self.model = LlamaForCausalLM(_llama_config(model))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=idx).logits

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.0)

    return PretrainedLlamaLM()


def _track_fills(record: dict[str, Any]) -> None:
    """After every tensor `load_pretrained` fills: the highest RssAnon and RssFile so far, and the largest read."""
    import lightning_par.checkpoint.pretrained.load as pretrained

    original = pretrained._fill
    record.update(fill_anon=0, fill_file=0, fill_largest=0)

    def fill(source: Any, key: str, view: Any) -> int:
        read = original(source, key, view)
        record["fill_anon"] = max(record["fill_anon"], _status("RssAnon"))
        record["fill_file"] = max(record["fill_file"], _status("RssFile"))
        record["fill_largest"] = max(record["fill_largest"], read)
        return read

    pretrained._fill = fill


def worker(args: argparse.Namespace) -> None:
    """One rank: build (or load), set up and train one step, recording each phase's peak and the load's reads."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the baseline, as a user's script would)

    import lightning_par.parallel.compose as compose
    from lightning_par.strategies.registry import make_strategy
    from lightning_par.utils import clean_exit

    torch.set_num_threads(1)
    marks = Marks()
    baseline, baseline_anon, baseline_file = _status("VmRSS"), _status("RssAnon"), _status("RssFile")
    marks.mark("imports (baseline)")
    for name in WRAPPED:
        _wrap(compose, name, marks)
    record: dict[str, Any] = {}
    io0 = _io_read_bytes()
    _track_fills(record)
    load = compose.load_pretrained

    def load_and_keep(*a: Any, **k: Any) -> Any:
        report = load(*a, **k)
        record.update(bytes_read=report.bytes_read, load_s=report.seconds, report=str(report))
        return report

    compose.load_pretrained = load_and_keep  # type: ignore[assignment]

    def finish() -> None:
        record.update(rank=dist.get_rank(), baseline=baseline, baseline_anon=baseline_anon,
                      baseline_file=baseline_file, phases=marks.phases, io_read=_io_read_bytes() - io0)  # fmt: skip
        record.pop("t0")
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
        clean_exit(0)

    class Probe(L.Callback):
        """Marks Lightning's phases; this rank's storages after set-up and after the step."""

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            marks.mark("fit: process group, Lightning set-up")
            record["anon_built"] = _status("RssAnon") - baseline_anon

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks.mark("setup: rest of strategy set-up (optimizer)")

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            record["setup_s"] = time.perf_counter() - record["t0"]
            marks.mark("setup: on_fit_start .. on_train_start")
            record["share_setup"] = _storage_bytes([*pl_module.parameters(), *pl_module.buffers()])
            record["dtype"] = str(next(pl_module.parameters()).dtype)
            if args.setup_only:  # a timing round: the step's memory was measured in the first round
                finish()

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: Any) -> None:
            marks.mark("to first batch (data loader)")

        def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
            marks.mark("step: forward")

        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks.mark("step: backward")

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: Any) -> None:
            marks.mark("step: optimizer (and the rest of the step)")
            params = list(pl_module.parameters())
            record["share_step"] = _storage_bytes([*params, *pl_module.buffers(), *(p.grad for p in params)])

    knobs = dict(STRATEGIES[args.strategy], pretrained=args.folder if args.init == "meta" else None)
    batch = STRATEGIES[args.strategy].get("microbatches", 1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=make_strategy(**knobs), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[Probe()], num_sanity_val_steps=0,
    )  # fmt: skip
    record["t0"] = time.perf_counter()
    module = _make_module(args.model, args.init, args.folder)
    record["build_s"] = time.perf_counter() - record["t0"]
    marks.mark("build model" if args.init == "meta" else "build model: from_pretrained")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODELS[args.model][4], (batch * 4, args.seq + 1), generator=gen)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    trainer.fit(module, train_dataloaders=data)
    marks.mark("end of fit")
    finish()


# ---- driver -----------------------------------------------------------------------------------------------------
def run_job(args: argparse.Namespace, strategy: str, init: str, setup_only: bool) -> list[dict[str, Any]]:
    """One 4-rank torchrun job; its ranks' records, by rank."""
    with tempfile.TemporaryDirectory() as out:
        job = ["--model", args.model, "--strategy", strategy, "--init", init, "--seq", str(args.seq),
               "--folder", args.folder, "--out", out, *(["--setup-only"] if setup_only else [])]  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", __file__,
               "--worker", *job]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        files = sorted(Path(out).glob("rank*.json"))
        if len(files) != 4:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"{strategy} {init}: {len(files)} of 4 ranks reported (rc {done.returncode})\n{tail}")
        return [json.loads(f.read_text()) for f in files]


def _peak(rec: dict[str, Any], prefixes: tuple[str, ...]) -> tuple[int, str]:
    phases = [p for p in rec["phases"] if p["phase"].startswith(prefixes)]
    top = max(phases, key=lambda p: p["peak"])
    return top["peak"] - rec["baseline"], top["phase"]


def print_phases(strategy: str, init: str, recs: list[dict[str, Any]]) -> None:
    """Every phase's peak above baseline and duration: where each rank's memory and time go."""
    print(f"\n{strategy} {init}: peak above baseline per phase, MiB (ranks 0 / 1 / 2 / 3), slowest rank's s")
    for i, p in enumerate(recs[0]["phases"]):
        peaks = [r["phases"][i]["peak"] - r["baseline"] for r in recs]
        print(f"  {p['phase']:<48} {_mib(peaks):>28}   {max(r['phases'][i]['s'] for r in recs):6.2f} s")
    if "fill_anon" in recs[0] and recs[0]["fill_largest"]:
        anon = _mib(r["fill_anon"] - r["baseline_anon"] for r in recs)
        file = _mib(r["fill_file"] - r["baseline_file"] for r in recs)
        print(
            f"  load: highest RssAnon {anon}, RssFile {file} MiB above baseline; disk reads "
            f"{_mib(r['io_read'] for r in recs)} MiB; rank 0: {recs[0].get('report', '')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--init", default="meta", choices=("eager", "meta"), help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="zero3", choices=sorted(STRATEGIES), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mid", choices=sorted(MODELS), help="mid: 0.43 B (eager fits 4 ranks)")
    parser.add_argument("--only", default="zero3,pipe", help="strategies to run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated eager / meta rounds per strategy; only the first trains a step")  # fmt: skip
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the checkpoint (local disk)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--patience", type=float, default=300.0, help="seconds to wait for free memory per job")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.write:
        write_folder(args.model, args.folder)
        return
    start = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.2f}, {_available() / GiB:.1f} GiB available", flush=True)
    args.folder = tempfile.mkdtemp(prefix="pretrained_load_", dir=args.dir)
    try:
        # In a child process: the driver's RSS stays small, and the model's memory goes back before the first job.
        write = [sys.executable, __file__, "--write", "--model", args.model, "--folder", args.folder]
        subprocess.run(write, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        size = sum(f.stat().st_size for f in Path(args.folder).glob("*.safetensors"))
        print(f"wrote {args.folder}: {size / MiB:.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
        runs: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
        for strategy in args.only.split(","):
            for rnd in range(args.rounds):
                for init in ("eager", "meta") if rnd % 2 == 0 else ("meta", "eager"):
                    need = (int(1.4 * 4 * size) if init == "eager" else size) + 3 * GiB
                    if not _wait_for_memory(need, args.patience):
                        print(f"skipped {strategy} {init} round {rnd}: {need / GiB:.1f} GiB needed", flush=True)
                        continue
                    t0 = time.perf_counter()
                    recs = run_job(args, strategy, init, setup_only=bool(runs.get((strategy, init))))
                    print(f"  {strategy} {init} round {rnd}: {time.perf_counter() - t0:.0f} s", flush=True)
                    if not runs.get((strategy, init)):
                        print_phases(strategy, init, recs)
                    runs.setdefault((strategy, init), []).append(recs)
        print_table(runs, size)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    print(f"\n{time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.2f} after")


def print_table(runs: dict[tuple[str, str], list[list[dict[str, Any]]]], size: int) -> None:
    """One row per configuration: memory of the first round per rank, set-up time median over rounds, ratios."""
    print("\n| strategy | init | rounds | set-up peak above baseline, MiB | own share after set-up, MiB | "
          "load: RssAnon / RssFile above baseline (max rank), MiB | first-step peak, MiB | read per rank, MiB | "
          "build, s | set-up (build .. train start), s | of which load, s | meta / eager |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, str], float] = {}
    for (strategy, init), rounds in runs.items():
        first = rounds[0]
        medians[(strategy, init)] = statistics.median(max(r["setup_s"] for r in recs) for recs in rounds)
        eager = medians.get((strategy, "eager"))
        ratio = f"{medians[(strategy, init)] / eager:.2f}" if init == "meta" and eager else ""
        build = statistics.median(max(r["build_s"] for r in recs) for recs in rounds)
        loads = [max(r.get("load_s", 0.0) for r in recs) for recs in rounds]
        read = [r.get("bytes_read", size) for r in first]
        fills = (
            f"{max(r['fill_anon'] - r['baseline_anon'] for r in first) / MiB:.0f} / "
            f"{max(r['fill_file'] - r['baseline_file'] for r in first) / MiB:.0f}"
            if first[0].get("fill_largest")
            else ""
        )
        cells = [strategy, init, str(len(rounds)), _mib(_peak(r, ("build", "fit:", "setup:"))[0] for r in first),
                 _mib(r["share_setup"] for r in first), fills, _mib(_peak(r, ("to first", "step:"))[0] for r in first),
                 _mib(read), f"{build:.1f}", f"{medians[(strategy, init)]:.1f}",
                 f"{statistics.median(loads):.1f}" if init == "meta" else "-", ratio]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
