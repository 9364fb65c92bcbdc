"""Per-rank peak resident memory and set-up time of a Hugging Face Llama, eager vs meta-device construction.

Launch (plain python: the script starts one ``torchrun --standalone --nproc-per-node 4`` job per configuration):

    OMP_NUM_THREADS=1 python benchmarks/meta_memory.py [--quick] [--only zero3,pipe,tp] [--models 1b,mid] [--big] \
        [--rounds 3] [--seq 32]

Configurations, 4 ranks over gloo on CPU, fp32, SGD without momentum, 1 optimizer step:

- ``zero3`` (``make_strategy(zero_stage=3)``: FSDP2 over 4 ranks), ``pipe`` (``make_strategy(pp=4)``: one quarter
  of the blocks per rank; 4 microbatches of 1 sequence) and ``tp`` (``make_strategy(tp=4)``);
- ``eager``: ``LlamaForCausalLM(config)`` on every rank, then the strategy moves, broadcasts and shards it;
  ``meta``: built under ``trainer.init_module(empty_init=True)``; each rank allocates and initialises its share,
  one unit at a time (``lightning_par/parallel/materialize.py``).

Why a fresh process group per configuration, and VmHWM reset at phase boundaries rather than a sampling thread:
a fresh process starts from the same baseline (no allocator leftovers of the previous model), and the kernel's
high-water mark (VmHWM) sees every peak, however short, which a thread sampling VmRSS every few ms can miss.
Writing 5 to ``/proc/self/clear_refs`` resets VmHWM to the current RSS, so each phase between two marks gets its
own exact peak (marks: model built, process group up, each step of ``parallelize`` (wrapped here), strategy set-up
done, each part of the step). ``MALLOC_MMAP_THRESHOLD_=131072`` makes freed tensors go back to the OS, so RSS
follows tensor memory (docs/testing.md).

Reported per rank: peak RSS above the baseline (VmRSS after imports, before the model), against the prediction
"own share + transient": own share = bytes of the storages this rank holds after set-up (parameters, buffers;
after the step also gradients and optimizer state), counted from the tensors; transient = the largest unit's
fp32 bytes (the units of ``materialize``: trunk blocks, embedding, norm, head), measured on a meta copy.
Asserts nothing; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30
# name -> (hidden, layers, intermediate, heads, vocab). "mid" is the largest model whose eager construction fits
# 4 ranks here (4 full copies + shards ~ 10 GB); "1b" and "big" are meta-only (see main()). "big" has a smaller
# vocabulary so that zero3's first-step transient (3 x embedding + head, see summarise) stays small next to its
# 2 x 6.2 GiB of sharded weights and gradients on a shared 23.5 GiB machine.
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "quick": (768, 8, 2048, 12, 32000),  # ~106 M
    "mid": (2048, 6, 5504, 16, 32000),  # 0.43 B, 1.6 GiB fp32
    "1b": (2048, 16, 5504, 16, 32000),  # 0.94 B, 3.5 GiB fp32
    "big": (2048, 32, 5504, 16, 8192),  # ~1.65 B, 6.2 GiB fp32: 4 copies (24.7 GiB) exceed the machine's 23.5 GiB
}
OUTSIDE = "<outside trunk>"
STRATEGIES: dict[str, dict[str, Any]] = {
    "zero3": {"zero_stage": 3},
    "pipe": {"pp": 4, "microbatches": 4},
    "tp": {"tp": 4},
}


# ---- worker (one rank of a torchrun job) ------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class Marks:
    """Peak RSS and wall time of each phase between two marks (VmHWM reset at every mark)."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []
        self._t = time.perf_counter()
        self.reset()

    @staticmethod
    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def mark(self, label: str) -> None:
        """Close the phase that ends here: its peak, the RSS now, its duration."""
        now = time.perf_counter()
        self.phases.append({"phase": label, "peak": _status("VmHWM"), "rss": _status("VmRSS"), "s": now - self._t})
        self.reset()
        self._t = time.perf_counter()


def _wrap(module: Any, name: str, marks: Marks) -> None:
    """Mark before and after ``module.name`` (a step of ``parallelize``), so its peak is its own."""
    original = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        marks.mark(f"setup: before {name}")
        out = original(*args, **kwargs)
        marks.mark(f"setup: {name}")
        return out

    setattr(module, name, wrapped)


def _storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard, padding included)."""
    from torch.distributed.tensor import DTensor

    from lightning_par import _compat

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        local = _compat.dtensor_local(t) if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _llama_config(name: str) -> Any:
    from transformers import LlamaConfig

    hidden, layers, inter, heads, vocab = MODELS[name]
    # Passed as a dict: transformers' config classes take their fields as **kwargs, which type checkers cannot see.
    fields: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64,
        attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaConfig(**fields)


def _units_bytes(model_name: str) -> dict[str, int]:
    """Full fp32 bytes of each `materialize` unit, from a meta copy (no storage); key ``"<outside trunk>"``: the
    bytes outside the trunk's blocks (embedding, norm, head: FSDP2's root group under zero3)."""
    import torch

    from lightning_par.blocks.trunk import find_trunk
    from lightning_par.parallel.materialize import capture_init

    with torch.device("meta"):
        twin = _make_module(model_name)
    trunk = find_trunk(twin)
    assert trunk is not None
    units = capture_init(twin, trunk).units
    out = {}
    for name, unit in units.items():
        tensors = [*unit.template.parameters(), *(b for b in unit.template.buffers() if b is not None)]
        out[name] = sum(t.numel() * t.element_size() for t in tensors)
    blocks = {f"{trunk.path}.{n}" for n in trunk.names} | set(trunk.names)
    out[OUTSIDE] = sum(v for k, v in out.items() if k not in blocks)
    return out


def _make_module(model_name: str) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    class HFLlamaLM(L.LightningModule):
        """``LlamaForCausalLM`` from a config (no download), SGD without momentum: memory is the point, not speed."""

        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(_llama_config(model_name))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=idx).logits

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.0)

    return HFLlamaLM()


def worker(args: argparse.Namespace) -> None:
    """One rank: build, set up and train one step under one strategy, recording each phase's peak RSS."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the baseline, as a user's script would)

    import lightning_par.parallel.compose as compose
    from lightning_par.strategies.registry import make_strategy
    from lightning_par.utils import clean_exit

    torch.set_num_threads(1)
    marks = Marks()
    baseline = _status("VmRSS")
    marks.mark("imports (baseline)")
    units = _units_bytes(args.model)
    for name in ("capture_init", "_tp_plan", "_split", "sync_module_states", "apply_tensor_parallel", "apply_fsdp",
                 "materialize", "ReplicatedZero"):  # fmt: skip
        _wrap(compose, name, marks)
    record: dict[str, Any] = {}

    class Probe(L.Callback):
        """Marks Lightning's phases; counts this rank's storages after set-up and after the step."""

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            marks.mark("fit: process group, Lightning set-up")

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks.mark("setup: rest of strategy set-up (optimizer)")

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks.mark("setup: on_fit_start .. on_train_start")
            record["share_setup"] = _storage_bytes([*pl_module.parameters(), *pl_module.buffers()])
            record["setup_s"] = time.perf_counter() - record["fit_t0"]

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: Any) -> None:
            marks.mark("to first batch (data loader)")

        def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
            marks.mark("step: forward")

        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks.mark("step: backward")

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: Any) -> None:
            marks.mark("step: optimizer (and the rest of the step)")
            params = list(pl_module.parameters())
            opt = trainer.optimizers[0]
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            record["share_step"] = _storage_bytes([*params, *pl_module.buffers(), *(p.grad for p in params), *state])

    strategy = make_strategy(**STRATEGIES[args.strategy])
    batch = STRATEGIES[args.strategy].get("microbatches", 1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[Probe()], num_sanity_val_steps=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    with trainer.init_module(empty_init=True) if args.init == "meta" else contextlib.nullcontext():
        module = _make_module(args.model)
    record["build_s"] = time.perf_counter() - t0
    marks.mark("build model")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODELS[args.model][4], (batch * 4, args.seq + 1), generator=gen)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch
    )  # 4 ranks x 1 batch; the strategy's sampler splits over data-parallel ranks only
    record["fit_t0"] = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    marks.mark("end of fit")
    record.update(rank=dist.get_rank(), baseline=baseline, phases=marks.phases, units=units)
    record.pop("fit_t0")
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    clean_exit(0)


# ---- driver (plain python: one torchrun job per configuration) --------------------------------------------------
def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def _full_bytes(model: str) -> int:
    return sum(v for k, v in _units_bytes(model).items() if k != OUTSIDE)


def _wait_for_memory(need: int, patience_s: float) -> bool:
    """Whether ``need`` bytes are available, waiting up to ``patience_s`` (the machine is shared with test runs)."""
    deadline = time.monotonic() + patience_s
    while _available() < need:
        if time.monotonic() > deadline:
            return False
        print(f"  waiting: {_available() / GiB:.1f} GiB available, {need / GiB:.1f} GiB needed", flush=True)
        time.sleep(20)
    return True


def run_job(model: str, strategy: str, init: str, seq: int, timeout_s: float) -> list[dict[str, Any]]:
    """One 4-rank torchrun job; the records of its ranks, by rank."""
    with tempfile.TemporaryDirectory() as out:
        job = ["--model", model, "--strategy", strategy, "--init", init, "--seq", str(seq), "--out", out]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", __file__,
               "--worker", *job]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        files = sorted(Path(out).glob("rank*.json"))
        if len(files) != 4:
            tail = (done.stdout + done.stderr)[-3000:]
            rc = done.returncode
            raise RuntimeError(f"{model} {strategy} {init}: {len(files)} of 4 ranks reported (rc {rc})\n{tail}")
        return [json.loads(f.read_text()) for f in files]


SETUP_PHASES = ("build model", "fit:", "setup:")
STEP_PHASES = ("to first batch", "step:")


def _peak(rec: dict[str, Any], prefixes: tuple[str, ...]) -> tuple[int, str]:
    phases = [p for p in rec["phases"] if p["phase"].startswith(prefixes)]
    top = max(phases, key=lambda p: p["peak"])
    return top["peak"] - rec["baseline"], top["phase"]


def summarise(model: str, strategy: str, init: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank figures of one job: peaks above baseline, own shares, predictions, ratios, the phase of each peak."""
    units = {k: v for k, v in recs[0]["units"].items() if k != OUTSIDE}
    largest = max(units.values())
    # The first step's transient. zero3: FSDP2's root group (everything outside the blocks) is all-gathered for
    # forward and kept to the end of backward, where its full gradients and the reduce-scatter input that copies
    # them are alive at once: 3 x its bytes. pipe and tp: one unit is the yardstick.
    step_transient = 3 * recs[0]["units"][OUTSIDE] if strategy == "zero3" else largest
    rows = []
    for r in recs:
        setup, setup_at = _peak(r, SETUP_PHASES)
        step, step_at = _peak(r, STEP_PHASES)
        rows.append({
            "setup": setup, "setup_at": setup_at, "step": step, "step_at": step_at,
            "share_setup": r["share_setup"], "share_step": r["share_step"],
            "pred_setup": r["share_setup"] + largest, "pred_step": r["share_step"] + step_transient,
            "build_s": r["build_s"], "setup_s": r["setup_s"], "baseline": r["baseline"],
            "materialize_s": sum(p["s"] for p in r["phases"] if p["phase"] == "setup: materialize"),
            "phases": [(p["phase"], p["peak"] - r["baseline"], p["s"]) for p in r["phases"]],
        })  # fmt: skip
    return {"model": model, "strategy": strategy, "init": init, "largest_unit": largest, "units": len(units),
            "full": sum(units.values()), "step_transient": step_transient, "ranks": rows}  # fmt: skip


def _mib(values: Iterable[float]) -> str:
    return " / ".join(f"{v / MiB:.0f}" for v in values)


def print_memory(results: list[dict[str, Any]]) -> None:
    """The memory table: one row per configuration, ranks 0 / 1 / 2 / 3 in each cell."""
    print("\n| model | strategy | init | set-up peak above baseline, MiB | own share after set-up, MiB | "
          "predicted set-up (share + largest unit), MiB | set-up ratio (max) | step peak above baseline, MiB | "
          "own share after step (+ grads), MiB | predicted step (share + step transient), MiB | step ratio (max) | "
          "phase of the peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        ranks = res["ranks"]
        ratio_setup = max(r["setup"] / r["pred_setup"] for r in ranks)
        ratio_step = max(r["step"] / r["pred_step"] for r in ranks)
        worst = max(ranks, key=lambda r: max(r["setup"], r["step"]))
        at = worst["setup_at"] if worst["setup"] >= worst["step"] else worst["step_at"]
        cells = [
            res["model"], res["strategy"], res["init"], _mib(r["setup"] for r in ranks),
            _mib(r["share_setup"] for r in ranks), _mib(r["pred_setup"] for r in ranks), f"{ratio_setup:.2f}",
            _mib(r["step"] for r in ranks), _mib(r["share_step"] for r in ranks), _mib(r["pred_step"] for r in ranks),
            f"{ratio_step:.2f}", at,
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def print_phases(res: dict[str, Any]) -> None:
    """Every phase's peak above baseline on each rank: where a rank's memory goes."""
    print(
        f"\n{res['model']} {res['strategy']} {res['init']}: peak above baseline per phase, MiB (ranks 0 / 1 / 2 / 3)"
        "; "
        f"largest unit {res['largest_unit'] / MiB:.0f} MiB of {res['units']} units, model {res['full'] / MiB:.0f} "
        f"MiB, step transient {res['step_transient'] / MiB:.0f} MiB",
        flush=True,
    )
    names = [p[0] for p in res["ranks"][0]["phases"]]
    for i, name in enumerate(names):
        peaks = [r["phases"][i][1] for r in res["ranks"] if i < len(r["phases"])]
        secs = max(r["phases"][i][2] for r in res["ranks"] if i < len(r["phases"]))
        print(f"  {name:<48} {_mib(peaks):>28}   {secs:6.2f} s")


def print_times(times: dict[tuple[str, str, str], list[dict[str, Any]]]) -> None:
    """Set-up time per configuration, median over rounds of the slowest rank, and meta / eager."""
    print("\n| model | strategy | init | rounds | build, s | fit start .. train start, s | of which materialize, s | "
          "build + set-up, s | meta / eager |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    med: dict[tuple[str, str, str], float] = {}
    for key, runs in times.items():

        def m(f: Callable[[dict[str, Any]], float], runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(max(f(r) for r in run["ranks"]) for run in runs)

        med[key] = m(lambda r: r["build_s"] + r["setup_s"])
        eager = med.get((key[0], key[1], "eager"))
        ratio = f"{med[key] / eager:.2f}" if key[2] == "meta" and eager else ""
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(runs)} | {m(lambda r: r['build_s']):.1f} | "
            f"{m(lambda r: r['setup_s']):.1f} | {m(lambda r: r['materialize_s']):.1f} | {med[key]:.1f} | {ratio} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="1b", choices=sorted(MODELS))
    parser.add_argument("--strategy", default="zero3", choices=sorted(STRATEGIES))
    parser.add_argument("--init", default="meta", choices=("eager", "meta"))
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--only", default="zero3,pipe,tp", help="strategies to run")
    parser.add_argument("--rounds", type=int, default=3, help="alternated eager / meta rounds for set-up time (zero3)")
    parser.add_argument("--quick", action="store_true", help="the ~100 M model only, eager and meta, 1 round")
    parser.add_argument("--big", action="store_true", help="also the ~1.65 B model under zero3, meta only")
    parser.add_argument("--models", default="1b,mid", help="1b (meta only) and / or mid (eager and meta)")
    parser.add_argument("--patience", type=float, default=300.0, help="seconds to wait for free memory per job")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # --quick: zero3 alone unless --only says otherwise (a 4-rank job of the ~100 M model takes ~45 s here).
    strategies = ["zero3"] if args.quick and args.only == parser.get_default("only") else args.only.split(",")
    # (model, init): the eager comparison runs on the largest model 4 eager ranks fit; 1b and big are meta-only.
    plan = [("quick", "eager"), ("quick", "meta")] if args.quick else []
    if not args.quick:
        plan += [("1b", "meta")] if "1b" in args.models.split(",") else []
        plan += [("mid", "eager"), ("mid", "meta")] if "mid" in args.models.split(",") else []
    rounds = 1 if args.quick else args.rounds
    start = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.2f}, {_available() / GiB:.1f} GiB available", flush=True)
    results: list[dict[str, Any]] = []
    times: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    jobs: list[tuple[str, str, str, int]] = []
    for strategy in strategies:
        for model in dict.fromkeys(m for m, _ in plan):
            inits = [i for m, i in plan if m == model]
            # Set-up time: alternated rounds under zero3, the order reversed every round (ABBA), so a drift cancels.
            for rnd in range(rounds if strategy == "zero3" and len(inits) > 1 else 1):
                jobs += [(model, strategy, init, rnd) for init in (inits if rnd % 2 == 0 else inits[::-1])]
    for model, strategy, init, rnd in jobs:
        full = _full_bytes(model)
        need = (int(1.4 * 4 * full) if init == "eager" else 2 * full) + 3 * GiB
        if not _wait_for_memory(need, args.patience):
            print(f"skipped {model} {strategy} {init}: {need / GiB:.1f} GiB needed", flush=True)
            continue
        t0 = time.perf_counter()
        res = summarise(model, strategy, init, run_job(model, strategy, init, args.seq, 600))
        print(f"  {model} {strategy} {init} round {rnd}: {time.perf_counter() - t0:.0f} s", flush=True)
        times.setdefault((model, strategy, init), []).append(res)
        if rnd == 0:
            results.append(res)
            print_phases(res)
    if args.big:
        full = _full_bytes("big")
        if _wait_for_memory(2 * full + 4 * GiB, args.patience):
            res = summarise("big", "zero3", "meta", run_job("big", "zero3", "meta", args.seq, 900))
            results.append(res)
            times.setdefault(("big", "zero3", "meta"), []).append(res)
            print_phases(res)
        else:
            print(f"skipped big: {(2 * full + 4 * GiB) / GiB:.1f} GiB needed, {_available() / GiB:.1f} available")
    print_memory(results)
    print_times(times)
    print(f"\n{time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
