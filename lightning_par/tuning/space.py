"""The search space of `lightning-par sweep`: a YAML file naming recipe arguments and their ranges.

```yaml
metric: val_loss          # logged by the model in validation; the objective and what pruning watches
direction: minimize       # or maximize
trials: 8
sampler: tpe              # tpe (Bayesian, Optuna's TPESampler) | random
pruner: median            # median (Optuna's MedianPruner) | asha (successive halving) | none
seed: 0
backend: optuna           # optuna (trials one after another here) | ray (Ray Tune: trials on a Ray cluster)
resources: {cpu: 2, gpu: 2}  # ray only, optional: per trial (default: one CPU per rank, the recipe's GPUs)
max_concurrent: 4         # ray only, optional: trials at once (default: as many as the cluster's resources hold)
parameters:               # LightningCLI keys of the recipe, as on its command line without the leading "--"
  model.init_args.lr: {low: 1.0e-4, high: 1.0e-2, log: true}     # floats: a float range
  model.init_args.n_layer: {low: 1, high: 4}                      # ints: an int range (step: optional)
  trainer.strategy: {choices: [zero1, zero2]}                     # any values: a categorical choice
enqueue:                  # optional: trials to run first, with these values (the rest still sampled)
  - {model.init_args.lr: 0.003}
```

Population-based training instead (`lightning_par.tuning.pbt`): ``algorithm: pbt``, ``population``,
``generations``, ``steps_per_generation``, ``quantile`` (the share exploited each generation, default 0.25) and
``perturb`` (factors for numeric values, default [0.8, 1.2]).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "asha", "none")
BACKENDS = ("optuna", "ray")


class SpaceError(ValueError):
    """A search space that cannot run, with the fix in the message."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One recipe argument and its range: ``choices``, or ``low`` / ``high`` (``log``, ``step``)."""

    key: str
    choices: Optional[tuple[Any, ...]] = None
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None

    @property
    def is_int(self) -> bool:
        return self.choices is None and isinstance(self.low, int) and isinstance(self.high, int)

    def suggest(self, trial: Any) -> Any:
        """The value an Optuna trial samples for it."""
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        assert self.low is not None and self.high is not None
        if self.is_int:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def example(self) -> Any:
        """A value inside the range (checks that the recipe accepts the argument)."""
        return self.choices[0] if self.choices is not None else self.low


@dataclasses.dataclass(frozen=True)
class Space:
    """A parsed search-space file (module docstring)."""

    params: tuple[Param, ...]
    metric: str = "val_loss"
    direction: str = "minimize"
    trials: int = 8
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int = 0
    enqueue: tuple[dict[str, Any], ...] = ()
    algorithm: str = "optuna"
    backend: str = "optuna"
    resources: Optional[dict[str, float]] = None
    max_concurrent: Optional[int] = None
    population: int = 4
    generations: int = 3
    steps_per_generation: int = 0
    quantile: float = 0.25
    perturb: tuple[float, ...] = (0.8, 1.2)

    def overrides(self, values: dict[str, Any]) -> list[str]:
        """LightningCLI arguments setting ``values`` (``--key=value``; YAML for lists and mappings)."""
        return [f"--{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in values.items()]  # fmt: skip


def load_space(path: Path) -> Space:
    """Read and check a search-space file.

    Raises:
        SpaceError: a missing or malformed entry, naming it and the fix.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SpaceError(f"search space {path}: cannot be read as YAML ({err})") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("parameters"), dict) or not raw["parameters"]:
        raise SpaceError(
            f"search space {path}: needs a 'parameters' mapping of recipe keys to ranges, e.g. "
            "'parameters: {model.init_args.lr: {low: 1.0e-4, high: 1.0e-2, log: true}}'"
        )
    known = {f.name for f in dataclasses.fields(Space)} | {"parameters"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpaceError(f"search space {path}: unknown entries {unknown}; the entries are {sorted(known)}")
    params = tuple(_param(path, key, spec) for key, spec in raw["parameters"].items())
    settings = {k: v for k, v in raw.items() if k not in ("parameters", "enqueue", "perturb")}
    space = Space(params=params, enqueue=tuple(raw.get("enqueue") or ()),
                  perturb=tuple(raw.get("perturb") or (0.8, 1.2)), **settings)  # fmt: skip
    if space.direction not in ("minimize", "maximize"):
        raise SpaceError(f"search space {path}: direction={space.direction!r}; use minimize or maximize")
    if space.sampler not in SAMPLERS or space.pruner not in PRUNERS:
        raise SpaceError(f"search space {path}: sampler must be one of {SAMPLERS} and pruner one of {PRUNERS}")
    if not isinstance(space.trials, int) or space.trials < 1:
        raise SpaceError(f"search space {path}: trials={space.trials!r} must be an int >= 1")
    if space.algorithm not in ("optuna", "pbt"):
        raise SpaceError(f"search space {path}: algorithm={space.algorithm!r}; use optuna (default) or pbt")
    _check_backend(path, space)
    if space.algorithm == "pbt" and (space.steps_per_generation < 1 or space.population < 2 or
                                     space.generations < 1 or not 0 < space.quantile <= 0.5):  # fmt: skip
        raise SpaceError(
            f"search space {path}: pbt needs steps_per_generation >= 1 (optimizer steps between exploit/explore), "
            "population >= 2, generations >= 1 and 0 < quantile <= 0.5"
        )
    names = {p.key for p in params}
    for queued in space.enqueue:
        extra = sorted(set(queued) - names) if isinstance(queued, dict) else ["(not a mapping)"]
        if extra:
            raise SpaceError(f"search space {path}: enqueue names {extra}, which are not in 'parameters'")
    return space


def _check_backend(path: Path, space: Space) -> None:
    if space.backend not in BACKENDS:
        raise SpaceError(f"search space {path}: backend={space.backend!r}; use one of {BACKENDS}")
    if space.backend == "ray" and space.algorithm == "pbt":
        raise SpaceError(
            f"search space {path}: algorithm: pbt runs on backend: optuna only (its members resume this suite's "
            "checkpoints one generation at a time); remove 'backend: ray', or drop 'algorithm: pbt' for Ray Tune"
        )
    ray_only = [k for k in ("resources", "max_concurrent") if getattr(space, k) is not None]
    if ray_only and space.backend != "ray":
        raise SpaceError(
            f"search space {path}: {ray_only} set how Ray schedules trials; add 'backend: ray' or remove them "
            "(backend: optuna runs one trial at a time, which may use all of this machine)"
        )
    mc = space.max_concurrent
    if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or mc < 1):
        raise SpaceError(f"search space {path}: max_concurrent={mc!r} must be an int >= 1 (or absent: no limit)")
    if space.resources is None:
        return
    res = space.resources
    numbers = isinstance(res, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in res.values())
    if not numbers or not res or set(res) - {"cpu", "gpu"} or not res.get("cpu", 1) > 0:
        raise SpaceError(f"search space {path}: resources={res!r}; give numbers per trial, e.g. {{cpu: 2, gpu: 2}}")


def _param(path: Path, key: str, spec: Any) -> Param:
    if not isinstance(spec, dict):
        raise SpaceError(f"search space {path}: {key}: give {{choices: [...]}} or {{low: L, high: H}}, not {spec!r}")
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices or set(spec) - {"choices"}:
            raise SpaceError(f"search space {path}: {key}: 'choices' must be a non-empty list, alone")
        return Param(key, choices=tuple(choices))
    low, high = spec.get("low"), spec.get("high")
    extra = sorted(set(spec) - {"low", "high", "log", "step"})
    if extra or not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or not low < high:
        raise SpaceError(
            f"search space {path}: {key}: a range needs numbers low < high (and optionally log, step); got {spec!r}"
        )
    if spec.get("log") and low <= 0:
        raise SpaceError(f"search space {path}: {key}: a log range needs low > 0; got low={low}")
    return Param(key, low=low, high=high, log=bool(spec.get("log")), step=spec.get("step"))
