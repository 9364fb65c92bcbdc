"""`lightning-par sweep --config RECIPE --space SPACE.yaml`: Optuna trials of a recipe, pruned on its validation
metric, logged to W&B as one group.

Each trial is a separate ``lightning_par.tuning.trial`` process (a multi-device recipe starts its other ranks from
it, as ``lightning-par fit`` does), so trials share no state and a crashed trial is recorded as failed without
ending the sweep. The sweep reads the metric the trial's model logs after every validation, reports it to Optuna
and stops the trial's process group when the pruner says so. W&B: every trial's run gets the group
``WANDB_RUN_GROUP`` = the study name and the name ``<study>-<trial>`` (unless the recipe names its runs).
Before the first trial the recipe is parsed once with every searched argument (``--print_config``), so a key the
recipe does not have fails at once, naming it. `run_trial` (one trial process, its metric reported after each
validation) and `trial_env` are shared with the Ray Tune backend (`lightning_par.tuning.ray_tune`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lightning_par.tuning.space import Space, SpaceError

_POLL_S = 0.5


class TrialFailed(RuntimeError):
    """A trial's process failed or logged no metric; recorded as a failed trial, the sweep goes on."""


def check_arguments(recipe: Path, space: Space) -> None:
    """Parse the recipe with every searched argument set (no training); raise `SpaceError` naming any key it lacks."""
    base = [sys.executable, "-m", "lightning_par.cli", "fit", "--config", str(recipe)]
    values = {p.key: p.example() for p in space.params}
    if _parses(base + space.overrides(values)):
        return
    if not _parses(base):
        raise SpaceError(f"the recipe {recipe} does not parse on its own; check it with `lightning-par fit --config "
                         f"{recipe} --print_config`")  # fmt: skip
    bad = [key for key in values if not _parses(base + space.overrides({key: values[key]}))]
    raise SpaceError(
        f"the recipe {recipe} has no argument {', '.join(bad) or 'named in the space'} (or does not accept "
        f"{values}); name arguments as `lightning-par fit --config {recipe} --print_config` prints them, e.g. "
        "model.init_args.lr"
    )


def _parses(cmd: list[str]) -> bool:
    done = subprocess.run([*cmd, "--print_config"], capture_output=True, text=True, timeout=300)
    return done.returncode == 0


def trial_env(study_name: str, run_name: str) -> dict[str, str]:
    """This process's environment with the W&B group and run name of a trial set.

    Read when the trial starts, in the process that starts it: under Ray that is the trial's worker, whose
    ``CUDA_VISIBLE_DEVICES`` Ray set to the GPUs it gave the trial.
    """
    return {**os.environ, "WANDB_RUN_GROUP": study_name, "WANDB_NAME": run_name}


def run_trial(
    recipe: Path,
    space: Space,
    out: Path,
    number: int,
    values: dict[str, Any],
    study_name: str,
    on_report: Callable[[dict[str, Any]], None],
    cwd: Optional[Path] = None,
) -> list[dict[str, Any]]:
    """Run trial ``number`` (``out/trial-<number>.log`` and ``.metrics.jsonl``) and return what it reported.

    Args:
        recipe: the recipe, ``values`` set on it (LightningCLI arguments).
        on_report: called with ``{"step", "value"}`` after each validation; an exception it raises (a prune)
            stops the trial's processes and propagates.
        cwd: where the trial runs (the recipe's relative paths are from there); this process's by default.

    Raises:
        TrialFailed: the trial's process failed, or reported no metric.
    """
    metrics = out / f"trial-{number}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log = out / f"trial-{number}.log"
    cmd = [sys.executable, "-m", "lightning_par.tuning.trial", str(metrics), space.metric,
           "--config", str(recipe), *space.overrides(values)]  # fmt: skip
    env = trial_env(study_name, f"{study_name}-{number}")
    reported: list[dict[str, Any]] = []
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                for row in _read_new(metrics, len(reported)):
                    reported.append(row)
                    on_report(row)
                if done:
                    break
                time.sleep(_POLL_S)
        finally:  # also when on_report raised, or Ray ended the trial (SystemExit): no rank may outlive it
            if proc.poll() is None:
                _stop(proc)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        raise TrialFailed(f"trial {number} exited with {proc.returncode} ({values}); its log {log}:\n{tail}")
    if not reported:
        raise TrialFailed(
            f"trial {number} logged no {space.metric!r} in validation; set 'metric' to a value the "
            "model logs in validation_step, and let the recipe validate (limit_val_batches > 0)"
        )
    return reported


class _Objective:
    def __init__(self, recipe: Path, space: Space, out: Path, study_name: str) -> None:
        self.recipe, self.space, self.out, self.study_name = recipe, space, out, study_name

    def __call__(self, trial: Any) -> float:
        import optuna

        def report(row: dict[str, Any]) -> None:
            trial.report(row["value"], row["step"])
            if trial.should_prune():
                raise optuna.TrialPruned(f"{self.space.metric}={row['value']:.4g} at step {row['step']}")

        values = {p.key: p.suggest(trial) for p in self.space.params}
        reported = run_trial(self.recipe, self.space, self.out, trial.number, values, self.study_name, report)
        return float(reported[-1]["value"])


def _read_new(path: Path, seen: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    complete = lines if path.read_text().endswith("\n") else lines[:-1]  # a line being written waits a poll
    return [row for row in map(json.loads, complete) if "value" in row][seen:]


def _stop(proc: subprocess.Popen) -> None:
    """End a trial and every process it started (its ranks): SIGTERM to its group, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_sweep(recipe: Path, space: Space, out: Path, study_name: Optional[str] = None,
              storage: Optional[str] = None) -> Any:  # fmt: skip
    """Run ``space.trials`` trials of ``recipe`` and return the Optuna study (its ``best_trial``, ``trials``).

    Args:
        recipe: a LightningCLI recipe (``lightning-par fit --config`` runs it).
        space: the parsed search space (`lightning_par.tuning.space.load_space`).
        out: folder for each trial's log and metrics, and ``results.json``.
        study_name: the study and W&B group name (default: the recipe's stem + ``-sweep``).
        storage: an Optuna storage URL (``sqlite:///sweep.db``) to resume or share a study; in memory by default.

    Raises:
        SpaceError: a searched argument the recipe does not have (before any trial runs).
    """
    import optuna

    out.mkdir(parents=True, exist_ok=True)
    check_arguments(recipe, space)
    name = study_name or f"{recipe.stem}-sweep"
    sampler = optuna_sampler(space)
    pruner: Any = optuna.pruners.NopPruner()
    if space.pruner == "median":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2)
    elif space.pruner == "asha":  # asynchronous successive halving, as the Ray backend's ASHAScheduler
        pruner = optuna.pruners.SuccessiveHalvingPruner()
    direction: Any = space.direction  # "minimize" or "maximize", checked by load_space
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner,
                                direction=direction, load_if_exists=storage is not None)  # fmt: skip
    for values in space.enqueue:
        study.enqueue_trial(values)
    study.optimize(_Objective(recipe, space, out, name), n_trials=space.trials, catch=(TrialFailed,))
    write_results(out, study_results(study, space.metric))
    return study


def optuna_sampler(space: Space) -> Any:
    """The space's Optuna sampler (TPE or random, seeded): the Optuna backend's, and the Ray backend's searcher's."""
    import optuna

    if space.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=space.seed)
    return optuna.samplers.RandomSampler(seed=space.seed)


def study_results(study: Any, metric: str) -> dict[str, Any]:
    """An Optuna study's trials in the form of ``results.json`` (`write_results`)."""
    rows = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
             "steps": sorted(t.intermediate_values)} for t in study.trials]  # fmt: skip
    return {"study": study.study_name, "metric": metric, "trials": rows}


def write_results(out: Path, results: dict[str, Any]) -> None:
    """Write ``out/results.json``: ``study``, ``metric`` and ``trials``, one row per trial with its ``number``,
    ``state`` (COMPLETE, PRUNED or FAIL), ``value`` (the last validation's; None unless complete), ``params`` and
    the ``steps`` it reported at. Both backends write this form."""
    (out / "results.json").write_text(json.dumps(results, indent=1))


def summary(results: dict[str, Any], direction: str) -> str:
    """A table of the trials of ``results`` (`write_results`) and the best complete one."""
    metric, rows = results["metric"], results["trials"]
    lines = [f"| trial | state | {metric} | parameters |", "|---|---|---|---|"]
    for t in rows:
        value = f"{t['value']:.4g}" if t["value"] is not None else "-"
        lines.append(f"| {t['number']} | {t['state'].lower()} | {value} | {t['params']} |")
    complete = [t for t in rows if t["state"] == "COMPLETE" and t["value"] is not None]
    if complete:
        pick = min if direction == "minimize" else max
        best = pick(complete, key=lambda t: t["value"])
        lines.append(f"\nbest: trial {best['number']}, {metric} {best['value']:.4g}, {best['params']}")
    return "\n".join(lines)
