"""The GPU check: one script, run once on a machine with one CUDA device, that writes a JSON and a markdown report.

Sections (each is reported even when another fails; a failure is a row with its error, not a crash):

1. ``parity``: every strategy family at degree 1 (world 1, NCCL) against the plain single-device Trainer, 5 steps,
   fp32 and bf16-mixed, and fp16-mixed where a grad scaler runs (``ShardedGradScaler("cuda")``, DeepSpeed's loss
   scaler); ``zero3_offload`` covers FSDP2's pinned ``CPUOffloadPolicy``; implicit host syncs per step are counted
   (MoE's per-layer ``counts.tolist()`` among them).
2. ``throughput``: step time and MFU of a ~1 B-parameter Llama (bf16-mixed, sequence 2048, SDPA's flash kernel)
   under ``zero3``, ``tp`` and ``pipe`` at degree 1, against a hand-written FSDP2 loop and against Lightning's
   ``ModelParallelStrategy`` on the same model (ratios per round; goals: <= 1.03 and <= 1.00); ``zero1`` and
   ``zero2`` against Lightning's ``ddp`` (at world 1 no collective moves data: the ratio is the engine's per-step
   overhead on a GPU; goal <= 1.00).
3. ``activations``: activation bytes of each checkpointing policy, measured and predicted (`_gpu_activations`).
4. ``async_save``: how long a save holds training, asynchronous vs synchronous (goal <= 0.10), and whether each
   checkpoint holds the weights of its save's moment.
5. ``offload``: step time and peak device memory of ``zero3_offload``, of activation offload (every block, the
   first half: ``offload_blocks``) and of full recomputation vs plain ``zero3``.
6. ``fp8``: step time of the 1 B Llama under ``zero3`` (compiled), bf16 against ``fp8=True`` (``"emulate"`` where
   the device has no fp8; `_gpu_fp8`).
7. ``cuda_tests``: ``pytest -m cuda`` (the CUDA-only tests: async staging, resume with CUDA's RNG, the monitor's
   peak table, activation offload).

Launch on the GPU machine from the repository root (the package from this checkout; sized for 8 minutes on an
H200, an estimate until the first run):

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_report

and on any machine, in seconds, with tiny sizes (the suite runs this: tests/test_gpu_check.py):

    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_smoke

Figures from a run go to docs/benchmarks_history.md with the date and the GPU, the current ones to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _section(report: dict[str, Any], name: str, run: Callable[[], Any]) -> None:
    start = time.perf_counter()
    try:
        report["sections"][name] = {"ok": True, "result": run()}
    except Exception as err:  # reported, and the next section still runs
        error = f"{type(err).__name__}: {err}"
        report["sections"][name] = {"ok": False, "error": error, "trace": traceback.format_exc()}
    report["sections"][name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"[gpu_check] {name}: {'ok' if report['sections'][name]['ok'] else 'FAILED'} "
          f"({report['sections'][name]['seconds']} s)", flush=True)  # fmt: skip


# The test files holding `cuda`-marked tests, named so pytest collects nothing else: the GPU machine lacks the test
# extras some other modules import (tests/test_gpu_check.py keeps this list equal to the marked files).
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
CUDA_TEST_FILES = ("tests/test_activation_checkpointing.py", "tests/test_cuda.py", "tests/test_monitor.py")


def _cuda_tests() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *CUDA_TEST_FILES]
    # Without the launcher variables this process's own world-1 fits left behind: a test's fit would take
    # MASTER_PORT, whose store this process still holds (EADDRINUSE).
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"returncode": proc.returncode, "summary": last, "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, (list, tuple)) and all(isinstance(v, float) for v in x):
        return "[" + ", ".join(f"{v:.3g}" for v in x) + "]"
    return str(x)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables: one per section, failures with their error."""
    lines = [f"# GPU check, {report['date']}", "", f"Device: {report['device']}; torch {report['torch']}; "
             f"smoke: {report['smoke']}.", ""]  # fmt: skip
    for name, section in report["sections"].items():
        lines += [f"## {name} ({section['seconds']} s)", ""]
        if not section["ok"]:
            lines += [f"FAILED: {section['error']}", ""]
            continue
        result = section["result"]
        rows = result if isinstance(result, list) else result.get("rows") if isinstance(result, dict) else None
        if isinstance(rows, list) and rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
            rest = {k: v for k, v in result.items() if k != "rows"} if isinstance(result, dict) else {}
        else:
            rest = result if isinstance(result, dict) else {"result": result}
        lines += [""] + [f"- {k}: {_fmt(v)}" for k, v in rest.items() if k != "tail"] + [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json and report.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on whatever device there is (seconds)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of the throughput section")
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    args = parser.parse_args()
    # A world-1 script: a launcher's variables (inherited from a parent that ran a distributed fit) would make
    # Lightning join that world, or reuse a port the parent still holds.
    for name in _LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu" and not args.smoke:
        parser.error("no CUDA device here: run with --smoke (tiny sizes) or on a GPU machine")
    if accelerator == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    from _gpu_activations import activations
    from _gpu_fits import parity
    from _gpu_fp8 import fp8_speed
    from _gpu_speed import async_save, offload, throughput

    import lightning_par  # noqa: F401  (registers the strategy names)

    device = torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
                              "smoke": args.smoke, "sections": {}}  # fmt: skip
    sections: dict[str, Callable[[], Any]] = {
        "parity": lambda: parity(accelerator, args.smoke),
        "throughput": lambda: throughput(accelerator, args.smoke, 1 if args.smoke else args.rounds),
        "activations": lambda: activations(accelerator, args.smoke),
        "async_save": lambda: async_save(accelerator, args.smoke),
        "offload": lambda: offload(accelerator, args.smoke),
        "fp8": lambda: fp8_speed(accelerator, args.smoke, 1 if args.smoke else args.rounds),
    }
    if accelerator == "cuda":  # on a CPU every test it selects is skipped
        sections["cuda_tests"] = _cuda_tests
    args.out.mkdir(parents=True, exist_ok=True)
    for name, run in sections.items():
        if args.only is None or name in args.only:
            _section(report, name, run)
            # What is done so far, in both forms: a run stopped at its limit still returns its finished sections.
            (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
            (args.out / "report.md").write_text(markdown(report))
    print(markdown(report), flush=True)


if __name__ == "__main__":
    main()
