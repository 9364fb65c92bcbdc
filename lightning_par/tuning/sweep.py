"""`lightning-par sweep --config RECIPE --space SPACE.yaml`: Optuna trials of a recipe, pruned on its validation
metric, logged to W&B as one group.

Each trial is a separate ``lightning_par.tuning.trial`` process (a multi-device recipe starts its other ranks from
it, as ``lightning-par fit`` does), so trials share no state and a crashed trial is recorded as failed without
ending the sweep. The sweep reads the metric the trial's model logs after every validation, reports it to Optuna
and stops the trial's process group when the pruner says so. W&B: every trial's run gets the group
``WANDB_RUN_GROUP`` = the study name and the name ``<study>-<trial>`` (unless the recipe names its runs).
Before the first trial the recipe is parsed once with every searched argument (``--print_config``), so a key the
recipe does not have fails at once, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


class _Objective:
    def __init__(self, recipe: Path, space: Space, out: Path, study_name: str) -> None:
        self.recipe, self.space, self.out, self.study_name = recipe, space, out, study_name

    def __call__(self, trial: Any) -> float:
        import optuna

        values = {p.key: p.suggest(trial) for p in self.space.params}
        metrics = self.out / f"trial-{trial.number}.metrics.jsonl"
        metrics.unlink(missing_ok=True)
        log = self.out / f"trial-{trial.number}.log"
        cmd = [sys.executable, "-m", "lightning_par.tuning.trial", str(metrics), self.space.metric,
               "--config", str(self.recipe), *self.space.overrides(values)]  # fmt: skip
        env = {**os.environ, "WANDB_RUN_GROUP": self.study_name, "WANDB_NAME": f"{self.study_name}-{trial.number}"}
        reported: list[dict[str, Any]] = []
        with log.open("w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                while True:
                    done = proc.poll() is not None
                    for row in _read_new(metrics, len(reported)):
                        reported.append(row)
                        trial.report(row["value"], row["step"])
                        if trial.should_prune():
                            _stop(proc)
                            raise optuna.TrialPruned(f"{self.space.metric}={row['value']:.4g} at step {row['step']}")
                    if done:
                        break
                    time.sleep(_POLL_S)
            finally:
                if proc.poll() is None:
                    _stop(proc)
        if proc.returncode != 0:
            tail = log.read_text()[-2000:]
            raise TrialFailed(f"trial {trial.number} exited with {proc.returncode} ({values}); its log {log}:\n{tail}")
        if not reported:
            raise TrialFailed(
                f"trial {trial.number} logged no {self.space.metric!r} in validation; set 'metric' to a value the "
                "model logs in validation_step, and let the recipe validate (limit_val_batches > 0)"
            )
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
    sampler = (optuna.samplers.TPESampler(seed=space.seed) if space.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=space.seed))  # fmt: skip
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if space.pruner == "median" else optuna.pruners.NopPruner()
    direction: Any = space.direction  # "minimize" or "maximize", checked by load_space
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner,
                                direction=direction, load_if_exists=storage is not None)  # fmt: skip
    for values in space.enqueue:
        study.enqueue_trial(values)
    study.optimize(_Objective(recipe, space, out, name), n_trials=space.trials, catch=(TrialFailed,))
    rows = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
             "steps": sorted(t.intermediate_values)} for t in study.trials]  # fmt: skip
    (out / "results.json").write_text(json.dumps({"study": name, "metric": space.metric, "trials": rows}, indent=1))
    return study


def summary(study: Any, metric: str) -> str:
    """A table of the trials and the best one."""
    lines = [f"| trial | state | {metric} | parameters |", "|---|---|---|---|"]
    for t in study.trials:
        value = f"{t.value:.4g}" if t.value is not None else "-"
        lines.append(f"| {t.number} | {t.state.name.lower()} | {value} | {t.params} |")
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    if complete:
        best = study.best_trial
        lines.append(f"\nbest: trial {best.number}, {metric} {best.value:.4g}, {best.params}")
    return "\n".join(lines)
