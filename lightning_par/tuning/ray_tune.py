"""The Ray Tune backend of `lightning-par sweep` (``backend: ray`` in the space; docs/tuning.md, "Ray Tune").

The same trials as the Optuna backend (`lightning_par.tuning.sweep`), scheduled by Ray Tune on a Ray cluster: each
trial is a Ray Tune function trainable that runs the trial's own ``lightning_par.tuning.trial`` process
(`sweep.run_trial`: same command, log, metrics file and W&B group) and passes every validation's metric to
``ray.tune.report``. The sampler stays Optuna's (`ray.tune.search.optuna.OptunaSearch` calls `Param.suggest`, so
log, int and step ranges mean what they mean for the Optuna backend, and ``enqueue`` runs first); the pruner is a
Ray scheduler on the number of validations reported: ``median`` is `MedianStoppingRule`, ``asha`` is
`ASHAScheduler`. Each trial asks Ray for one CPU per rank and, on GPU, the recipe's GPUs (or the space's
``resources``), so Ray runs as many trials at once as the cluster holds.

Ray is imported inside the functions: the package imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_par.tuning.space import Space, SpaceError
from lightning_par.tuning.sweep import check_arguments, optuna_sampler, run_trial, write_results

# ASHA stops a trial that reaches max_t; no recipe validates this often, so only its rungs stop trials.
_ASHA_MAX_T = 1_000_000


def require_ray() -> None:
    """Raise `SpaceError` naming the install command when Ray Tune (or Optuna, its searcher here) is missing."""
    try:
        import optuna  # noqa: F401
        import ray.tune  # noqa: F401
    except ImportError as err:
        raise SpaceError(
            f'backend: ray needs Ray Tune and Optuna ({err}); install them with: pip install "lightning-par[tune]"'
        ) from err


def trial_resources(recipe: Path, space: Space) -> dict[str, float]:
    """What Ray reserves for each trial: the space's ``resources``, else one CPU per rank of the recipe's
    ``trainer.devices`` and, when its ``trainer.accelerator`` is a GPU (``auto``: when this machine has one), as
    many GPUs.

    Raises:
        SpaceError: a GPU recipe whose device count is not a number (``auto``, -1), naming ``resources``.
    """
    if space.resources is not None:
        return {k: float(v) for k, v in space.resources.items()}
    try:
        trainer = (yaml.safe_load(Path(recipe).read_text()) or {}).get("trainer") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        trainer = {}
    accelerator = str(trainer.get("accelerator", "auto")) if isinstance(trainer, dict) else "auto"
    devices = trainer.get("devices", "auto") if isinstance(trainer, dict) else "auto"
    if accelerator == "auto":
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    count = _device_count(devices)
    if accelerator in ("gpu", "cuda"):
        if count is None:
            raise SpaceError(
                f"the recipe {recipe} trains on GPUs with trainer.devices={devices!r}, which does not say how many "
                "GPUs a trial needs; set trainer.devices to a number, or 'resources: {cpu: N, gpu: N}' in the space"
            )
        return {"cpu": float(count), "gpu": float(count)}
    return {"cpu": float(count or 1)}  # Lightning's CPU "auto" is one device


def _device_count(devices: Any) -> Optional[int]:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:  # "0,1": device indices
        return len([d for d in devices.split(",") if d.strip()])
    return None


class _DefineByRun:
    """OptunaSearch's define-by-run space: every parameter suggested as the Optuna backend does."""

    def __init__(self, space: Space) -> None:
        self.params = space.params

    def __call__(self, trial: Any) -> None:
        for param in self.params:
            param.suggest(trial)


class _TrialNames:
    """Ray's trial names, ``<study>-<n>`` in the order Ray creates the trials: ``n`` is the trial's number in
    ``out`` (``trial-<n>.log``) and its W&B run's name, as with the Optuna backend."""

    def __init__(self, study: str) -> None:
        self.study = study
        self.numbers: dict[str, int] = {}

    def __call__(self, trial: Any) -> str:
        number = self.numbers.setdefault(trial.trial_id, len(self.numbers))
        return f"{self.study}-{number}"

    def __deepcopy__(self, memo: dict) -> _TrialNames:
        return self  # Tune deep-copies the experiment's spec for every trial it creates: one count for them all


def _number(trial_name: str) -> int:
    return int(trial_name.rsplit("-", 1)[1])


def _trial_dirname(trial: Any) -> str:
    return str(trial)  # the name `_TrialNames` gave it


def _trainable(config: dict[str, Any], *, recipe: Path, space: Space, out: Path, study: str, cwd: Path) -> None:
    """One Ray Tune trial: `run_trial` on the worker Ray placed it on, each validation passed to Ray.

    When the scheduler stops the trial, ``tune.report`` raises SystemExit in here: `run_trial` then ends the
    trial's processes before Ray ends this worker.
    """
    from ray import tune

    def report(row: dict[str, Any]) -> None:
        tune.report({space.metric: row["value"], "step": row["step"]})

    number = _number(tune.get_context().get_trial_name())
    run_trial(recipe, space, out, number, dict(config), study, report, cwd=cwd)


def _recorder(metric: str) -> Any:
    """A Ray Tune callback (in the driver) that builds the ``results.json`` rows; made here to import Ray lazily."""
    from ray import tune

    class Recorder(tune.Callback):
        def __init__(self) -> None:
            self.rows: dict[str, dict[str, Any]] = {}

        def row(self, trial: Any) -> dict[str, Any]:
            return self.rows.setdefault(trial.trial_id, {
                "number": _number(str(trial)), "state": "RUNNING", "value": None, "params": dict(trial.config),
                "steps": [], "last": None, "trial_id": trial.trial_id,
            })  # fmt: skip

        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            row = self.row(trial)
            row["steps"].append(result["step"])
            row["last"] = result[metric]
            # Tune marks the result its scheduler stopped the trial on as done; a trial that ran to its end has
            # no such result here (its end reaches callbacks as on_trial_complete only).
            if result.get("done"):
                row["state"] = "PRUNED"

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            row = self.row(trial)
            if row["state"] != "PRUNED":
                row["state"], row["value"] = "COMPLETE", row["last"]

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.row(trial)["state"] = "FAIL"

    return Recorder()


def _scheduler(space: Space) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    # Time is the number of validations reported (Ray's training_iteration), so trials that validate at the same
    # interval are compared at the same step.
    if space.pruner == "median":  # as Optuna's MedianPruner here: judged once 2 other trials got as far
        # Never pause a trial "to yield time to others" while too few got as far (an infinite slice; a finite one
        # is exceeded at a trial's first pause): a trial has no checkpoint for Ray, so it would restart at step 0.
        return MedianStoppingRule(time_attr="training_iteration", grace_period=1, min_samples_required=2,
                                  min_time_slice=float("inf"))  # type: ignore[arg-type]  # fmt: skip
    if space.pruner == "asha":
        return ASHAScheduler(time_attr="training_iteration", max_t=_ASHA_MAX_T, grace_period=1)
    return FIFOScheduler()


def run_ray_sweep(recipe: Path, space: Space, out: Path, study_name: Optional[str] = None,
                  address: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    """Run ``space.trials`` trials of ``recipe`` with Ray Tune; write and return ``out/results.json``'s content.

    Args:
        recipe: a LightningCLI recipe (``lightning-par fit --config`` runs it).
        space: the parsed search space, ``backend: ray``.
        out: folder for each trial's log and metrics, ``results.json`` and Ray's experiment folder (``ray/``);
            on a cluster of several machines, a path every machine shares.
        study_name: the study, Ray experiment and W&B group name (default: the recipe's stem + ``-sweep``).
        address: the Ray cluster (``auto``: the one ``ray start`` or ``RAY_ADDRESS`` names; ``ray://host:10001``);
            None starts a local Ray instance for the sweep. Ignored when this process already called ``ray.init``.

    Raises:
        SpaceError: Ray is not installed, or a searched argument the recipe does not have (before any trial runs).
    """
    require_ray()
    import ray
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    recipe, out = Path(recipe).resolve(), Path(out).resolve()  # trials run on Ray's workers, in other folders
    out.mkdir(parents=True, exist_ok=True)
    check_arguments(recipe, space)
    name = study_name or f"{recipe.stem}-sweep"
    resources = trial_resources(recipe, space)
    sampler = optuna_sampler(space)
    mode = "min" if space.direction == "minimize" else "max"
    # A define-by-run space takes its metric and mode here (Tune passes TuneConfig's only to a searcher without one).
    searcher = OptunaSearch(space=_DefineByRun(space), metric=space.metric, mode=mode, sampler=sampler,
                            points_to_evaluate=list(space.enqueue) or None)  # fmt: skip
    recorder = _recorder(space.metric)
    started = not ray.is_initialized()
    if started and address is None:  # a dashboard needs ray[default]; the sweep does not use one
        ray.init(address="local", include_dashboard=False)
    elif started:  # an existing cluster's settings are its own (ray.init refuses include_dashboard there)
        ray.init(address=address)
    try:
        trainable = tune.with_parameters(_trainable, recipe=recipe, space=space, out=out, study=name, cwd=Path.cwd())
        tuner = tune.Tuner(
            tune.with_resources(trainable, resources),
            tune_config=tune.TuneConfig(
                metric=space.metric,
                mode=mode,
                search_alg=searcher,
                scheduler=_scheduler(space),
                num_samples=space.trials,
                max_concurrent_trials=space.max_concurrent,
                trial_name_creator=_TrialNames(name),
                trial_dirname_creator=_trial_dirname,
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=str(out / "ray"),
                callbacks=[recorder],
                failure_config=tune.FailureConfig(max_failures=0),
                verbose=1,
            ),
        )
        tuner.fit()  # a failed trial is recorded (on_trial_error), not raised
    finally:
        if started:
            ray.shutdown()
    rows = sorted(recorder.rows.values(), key=lambda r: r["number"])
    for row in rows:
        row.pop("last")
    results = {"study": name, "metric": space.metric, "backend": "ray", "trials": rows}
    write_results(out, results)
    return results
