"""``lightning-par verify``: does a layout train the user's own model as a reference does? Step by step.

    lightning-par verify --config RECIPE --strategy NAME [--steps N] [--devices D] [--reference one|zero0|zero3]

The recipe is trained twice for N optimizer steps, each in processes of its own (``lightning-par fit`` with a
second ``--config`` that overrides the strategy, the devices and the steps, switches logging off and adds
`lightning_par.callbacks.StepRecord`): under the layout on D processes, and under the reference (one process by
default; ``zero0`` or ``zero3`` on D processes for a model too large for one device). Both train on the same global
batch from the same seed: the per-process batch of the recipe times D, which each run's strategy reaches through its
``global_batch`` (accumulating where a run has fewer data-parallel ranks), and the distributed sampler gives both
runs the same samples per step. Each run saves its whole state after every step through the strategy's own
checkpointing, in a temporary folder (never the user's checkpoint folder); the states are read back whole and
compared parameter by parameter.

The report has one row per step (loss, gradient norm, the parameters that differ most, relative to the tensor's
largest value, beyond 1 % of the learning rate per step so far when an Adam-style optimizer stepped them: see
``ADAM_ALLOWANCE``) and a verdict against the tolerance of the recipe's precision: 1e-5 relative in fp32 (the test
suite's parity bound), 2e-2 in 16/bf16 (the suite measures its own low-precision bounds per test; this one is a
stated bound, loose enough for rounding and tight enough to catch a dropped gradient reduction). The verdict names
the first parameter that diverged. `verify` is the same as a function.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import yaml

TOLERANCES = {"32": 1e-5, "16": 2e-2}  # by the precision's bits (see the module docstring)
# Adam-style optimizers turn rounding noise on a gradient that is zero in exact arithmetic (attention's key bias)
# into an update of up to lr x |g| / eps: parameters may differ by 1 % of the learning rate per step, absolute (the
# suite's AdamW bound, tests/test_zero.py), on top of the relative tolerance. SGD gets no allowance.
ADAM_ALLOWANCE = 0.01
REFERENCES = ("one", "zero0", "zero3")


class VerifyError(ValueError):
    """``verify`` cannot run as asked; the message names the fix."""


@dataclasses.dataclass
class StepDiff:
    """One step of both runs: their losses and gradient norms, and the parameters that differ most."""

    step: int
    loss: tuple[float, float]
    grad_norm: tuple[float, float]
    worst: list[tuple[str, float]]  # (parameter, max |a - b| / max |reference|), largest first

    def rel(self, pair: tuple[float, float]) -> float:
        return abs(pair[1] - pair[0]) / max(abs(pair[0]), 1e-30)


@dataclasses.dataclass
class VerifyReport:
    """What `verify` found. ``same``: every step within ``tolerance``; ``first``: the first differing quantity."""

    recipe: str
    strategy: str
    reference: str
    devices: int
    global_batch: int
    tolerance: float
    steps: list[StepDiff]
    same: bool
    first: Optional[str]

    def text(self) -> str:
        ref = "one process" if self.reference == "one" else f"{self.reference} on {self.devices} processes"
        lines = [f"lightning-par verify: {self.recipe}, {self.strategy!r} on {self.devices} processes against {ref}; "
                 f"{len(self.steps)} steps of global batch {self.global_batch}; tolerance {self.tolerance:g} relative",
                 "| step | loss: reference | loss: layout | rel | grad norm: reference | grad norm: layout | rel | "
                 "parameters that differ most (rel) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in self.steps:
            worst = ", ".join(f"{n} {e:.1e}" for n, e in s.worst[:3] if e > 0) or "none"
            lines.append(f"| {s.step} | {s.loss[0]:.7g} | {s.loss[1]:.7g} | {s.rel(s.loss):.1e} | {s.grad_norm[0]:.7g} "
                         f"| {s.grad_norm[1]:.7g} | {s.rel(s.grad_norm):.1e} | {worst} |")  # fmt: skip
        verdict = "SAME: the layout trains as the reference within the tolerance" if self.same else (
            f"DIFFERENT: {self.first}")  # fmt: skip
        return "\n".join([*lines, f"verdict: {verdict}"])


def _strategy_spec(name: str) -> tuple[str, dict[str, Any]]:
    """(class path, init args) of a registered name or of a class path (``package.module.Class``)."""
    from lightning_par.names import DEEPSPEED_STRATEGY_NAMES, strategy_kwargs
    from lightning_par.strategies import STRATEGY_NAMES

    if name in DEEPSPEED_STRATEGY_NAMES:  # its engine fixes the accumulation itself: no global_batch to match
        raise VerifyError(
            f"{name!r}: DeepSpeed's engine takes no global_batch, which verify gives both runs the same global batch "
            f"with; verify the native layout of the same ZeRO stage ({name[10:]!r})"
        )
    if name in STRATEGY_NAMES:
        return "lightning_par.ParallelStrategy", strategy_kwargs(name)
    if "." in name:
        return name, {}
    close = difflib.get_close_matches(name, [*STRATEGY_NAMES, *DEEPSPEED_STRATEGY_NAMES], n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else "; see lightning_par.STRATEGY_NAMES"
    raise VerifyError(f"unknown strategy {name!r}{hint} (or give a class path, e.g. my_package.MyStrategy)")


def _per_process_batch(recipe: dict[str, Any]) -> int:
    batch = ((recipe.get("data") or {}).get("init_args") or {}).get("batch_size")
    if not isinstance(batch, int):
        raise VerifyError(
            "verify needs the recipe's per-process batch size as data.init_args.batch_size (an int), to give the "
            "layout and the reference the same global batch; add it to the recipe"
        )
    return batch


def _fits(config: Path, devices: int, memory_gib: Optional[float]) -> tuple[float, Optional[float]]:
    """(GiB one process needs to train the recipe's model with Adam in fp32 state: 16 bytes a parameter, the
    activations aside; the memory of one device, or ``None`` when unknown)."""
    import torch

    from lightning_par.cli_recipe import _built, build_cli

    with warnings.catch_warnings():  # "args and command line arguments": the command line is verify's own
        warnings.simplefilter("ignore")
        cli = build_cli(["--config", str(config)], run=False)
    params = sum(p.numel() for p in _built(cli.model).parameters())
    if memory_gib is None and torch.cuda.is_available():
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    elif memory_gib is None and hasattr(os, "sysconf"):
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / devices  # shared host memory
    return 16 * params / 2**30, memory_gib


def _override(run: Path, spec: tuple[str, dict[str, Any]], devices: int, steps: int, global_batch: int) -> Path:
    class_path, init_args = spec
    trainer = {
        "devices": devices, "num_nodes": 1, "max_steps": steps, "max_epochs": -1, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "limit_val_batches": 0, "num_sanity_val_steps": 0, "accumulate_grad_batches": 1,
        "default_root_dir": str(run),
        "strategy": {"class_path": class_path, "init_args": {**init_args, "global_batch": global_batch}},
        "callbacks": [{"class_path": "lightning_par.callbacks.StepRecord", "init_args": {"out": str(run)}}],
    }  # fmt: skip
    path = run / "override.yaml"
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"trainer": trainer}))
    return path


def _train(config: Path, override: Path, run: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "lightning_par.cli", "fit", "--config", str(config), "--config", str(override)]
    log = run / "log.txt"
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0 or not (run / "steps.json").is_file():
        tail = log.read_text(errors="replace")[-4000:]
        raise VerifyError(f"the run in {run} failed ({done.returncode}); its output ends:\n{tail}")
    return list(json.loads((run / "steps.json").read_text()))


def _weights(folder: Path) -> tuple[dict[str, Any], float]:
    """The whole weights of a saved step, and the learning rate when an Adam-style optimizer (second moments in its
    state) stepped them, else 0."""
    from lightning_par.checkpoint.consolidate import _without_replicas, load_full_state

    state = _without_replicas(load_full_state(folder), folder)
    optimizer = state.get("optimizer_0") or {}
    adam = any("exp_avg_sq" in s for s in (optimizer.get("state") or {}).values() if isinstance(s, dict))
    lr = max((float(g.get("lr", 0.0)) for g in optimizer.get("param_groups", [])), default=0.0) if adam else 0.0
    return dict(state.get("state_dict", {})), lr


def _param_errors(ref: dict[str, Any], got: dict[str, Any], allowance: float) -> list[tuple[str, float]]:
    """Per parameter, ``max |a - b| / max |a|`` after ``allowance`` (absolute) is taken off each element's
    difference; largest first."""
    errors = []
    for name, a in ref.items():
        if not hasattr(a, "is_floating_point") or not a.is_floating_point():
            continue
        b = got.get(name)
        if b is None or getattr(b, "shape", None) != a.shape:  # missing, or another shape: as different as it gets
            errors.append((name, float("inf")))
            continue
        scale = max(float(a.abs().max()), 1e-30)
        excess = ((a.double() - b.double()).abs() - allowance).clamp(min=0)
        errors.append((name, float(excess.max()) / scale))
    return sorted(errors, key=lambda e: -e[1])


def verify(config: str, strategy: str, steps: int = 3, devices: int = 2, reference: str = "one",
           out: Optional[str] = None, memory_gib: Optional[float] = None) -> VerifyReport:  # fmt: skip
    """Train ``config`` under ``strategy`` on ``devices`` processes and under ``reference``, and compare each step.

    Args:
        config: the recipe (as for ``lightning-par fit``).
        strategy: a registered name (``"tp"``, ``"pipe_zero1"``, ...) or a strategy's class path.
        steps: optimizer steps of each run.
        devices: processes of the layout's run (and of a ``zero0`` / ``zero3`` reference).
        reference: ``"one"`` (one process), ``"zero0"`` or ``"zero3"`` (on ``devices`` processes).
        out: where the runs keep their records and checkpoints (default: a new temporary folder, kept).
        memory_gib: one device's memory, for the check that the reference fits (default: measured).

    Raises:
        VerifyError: a bad strategy or reference name, a recipe without its batch size, a model no reference fits,
            or a run that failed (its output's end).
    """
    recipe_path = Path(config)
    recipe = yaml.safe_load(recipe_path.read_text()) or {}
    if reference not in REFERENCES:
        raise VerifyError(f"reference {reference!r}: choose one of {REFERENCES}")
    spec = _strategy_spec(strategy)
    need, have = _fits(recipe_path, devices, memory_gib)
    shares = {"one": 1, "zero0": 1, "zero3": devices}
    if have is not None and need / shares[reference] > have:
        fits = [r for r in REFERENCES if need / shares[r] <= have]
        if fits:  # the first that fits is the closest to one process
            hint = f"use --reference {fits[0]} ({need / shares[fits[0]]:.2f} GiB a process), the closest that fits"
        else:
            hint = (f"no reference fits: even zero3 on {devices} processes needs {need / devices:.2f} GiB a process; "
                    "verify a smaller configuration of the model (fewer layers), or on more devices")  # fmt: skip
        raise VerifyError(f"the reference {reference!r} needs about {need / shares[reference]:.2f} GiB a process "
                          f"(16 bytes a parameter) and a device has {have:.2f} GiB; {hint}")  # fmt: skip
    global_batch = _per_process_batch(recipe) * devices
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="lightning_par_verify_"))
    ref_spec = ("lightning_par.ParallelStrategy", {"zero_stage": 0 if reference != "zero3" else 3})
    ref_devices = 1 if reference == "one" else devices
    ref_steps = _train(recipe_path, _override(root / "reference", ref_spec, ref_devices, steps, global_batch),
                       root / "reference")  # fmt: skip
    got_steps = _train(recipe_path, _override(root / "layout", spec, devices, steps, global_batch), root / "layout")
    precision = str((recipe.get("trainer") or {}).get("precision", "32"))
    tolerance = TOLERANCES["16" if "16" in precision else "32"]
    diffs: list[StepDiff] = []
    first: Optional[str] = None
    allowance = 0.0
    for a, b in zip(ref_steps, got_steps):
        k = a["step"]
        ref_weights, lr = _weights(root / "reference" / f"step={k}")
        allowance += ADAM_ALLOWANCE * lr
        worst = _param_errors(ref_weights, _weights(root / "layout" / f"step={k}")[0], allowance)
        diff = StepDiff(k, (a["loss"], b["loss"]), (a["grad_norm"], b["grad_norm"]), worst)
        diffs.append(diff)
        if first is None:
            if diff.rel(diff.loss) > tolerance:
                first = f"first at step {k}: the loss ({diff.rel(diff.loss):.1e} relative)"
            elif diff.rel(diff.grad_norm) > tolerance:
                first = f"first at step {k}: the gradient norm ({diff.rel(diff.grad_norm):.1e} relative)"
            if worst and worst[0][1] > tolerance:
                over = [n for n, e in worst if e > tolerance]
                what = f"parameter {worst[0][0]} ({worst[0][1]:.1e} relative to its largest value)"
                first = (first + f", and {what}" if first else f"first at step {k}: {what}") + (
                    f"; {len(over) - 1} more over the tolerance" if len(over) > 1 else "")  # fmt: skip
    if len(ref_steps) != len(got_steps):
        first = first or f"the runs trained {len(ref_steps)} and {len(got_steps)} steps"
    return VerifyReport(str(config), strategy, reference, devices, global_batch, tolerance, diffs, first is None,
                        first)  # fmt: skip


def main(argv: list[str]) -> None:
    """``lightning-par verify``: print the report; exit 1 when the layout differs, 2 when it cannot run."""
    parser = argparse.ArgumentParser(prog="lightning-par verify", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the recipe (as for lightning-par fit)")
    parser.add_argument("--strategy", required=True, help="a registered name, or a strategy's class path")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", default="one", choices=REFERENCES)
    parser.add_argument("--out", default=None, help="where the runs keep their records (default: a temporary folder)")
    args = parser.parse_args(argv)
    try:
        report = verify(args.config, args.strategy, args.steps, args.devices, args.reference, args.out)
    except VerifyError as err:  # cannot run as asked (the runs' own failures included)
        print(f"lightning-par verify: {err}", file=sys.stderr)
        sys.exit(2)
    print(report.text())
    sys.exit(0 if report.same else 1)
