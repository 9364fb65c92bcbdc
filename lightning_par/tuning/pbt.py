"""Population-based training (Jaderberg et al., "Population Based Training of Neural Networks", arXiv 1711.09846)
over this suite's checkpoints: `lightning-par sweep` with ``algorithm: pbt`` in the space.

A population of members, each with values sampled from the space, trains ``steps_per_generation`` optimizer steps
per generation; each run is a `lightning_par.tuning.trial` process that resumes its member's checkpoint and saves
a new one at the end. After each generation the members are ranked on the metric of their last validation. Each
member in the worst ``quantile`` **exploits** a member of the best ``quantile`` (chosen at random): its next run
resumes that member's checkpoint (weights, optimizer state, step; resharded, so the members may use different
layouts), and **explores**: numeric values are the winner's times a factor drawn from ``perturb`` (kept in the
range), categorical ones redrawn with probability 1/4. The resumed run applies the new values to the restored
optimizer (`trial.NewHyperparameters`). Every run is a W&B run of the study's group, named
``<study>-m<member>-g<generation>``.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_par.tuning.space import Param, Space
from lightning_par.tuning.sweep import TrialFailed, check_arguments


def _sample(param: Param, rng: random.Random) -> Any:
    if param.choices is not None:
        return rng.choice(param.choices)
    assert param.low is not None and param.high is not None
    if param.log:
        value = math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    else:
        value = rng.uniform(param.low, param.high)
    return round(value) if param.is_int else value


def _explore(param: Param, value: Any, rng: random.Random, factors: tuple[float, ...]) -> Any:
    if param.choices is not None:
        return rng.choice(param.choices) if rng.random() < 0.25 else value
    assert param.low is not None and param.high is not None
    moved = min(max(value * rng.choice(factors), param.low), param.high)
    return round(moved) if param.is_int else moved


def run_pbt(recipe: Path, space: Space, out: Path, study_name: Optional[str] = None) -> dict[str, Any]:
    """Run the population (module docstring); returns and writes ``out/results.json``: per member, every
    generation's values, score, start step and lr, and which checkpoint it resumed.

    Raises:
        SpaceError: a searched argument the recipe does not have (before any run).
        TrialFailed: a run failed or logged no metric (the population cannot go on without it).
    """
    out.mkdir(parents=True, exist_ok=True)
    check_arguments(recipe, space)
    name = study_name or f"{recipe.stem}-pbt"
    rng = random.Random(space.seed)
    members: list[dict[str, Any]] = [
        {"id": i, "values": {p.key: _sample(p, rng) for p in space.params}, "resume": None, "history": []}
        for i in range(space.population)
    ]
    sign = 1.0 if space.direction == "minimize" else -1.0
    cut = max(1, math.floor(space.population * space.quantile))
    for generation in range(space.generations):
        for member in members:
            _run(recipe, space, out, name, member, generation)
        ranked = sorted(members, key=lambda m: sign * m["history"][-1]["score"])
        best, worst = ranked[:cut], ranked[-cut:]
        for member in members:
            member["resume"] = member["history"][-1]["saved"]
        if generation == space.generations - 1:
            break
        for loser in worst:
            winner = rng.choice(best)
            loser["resume"] = winner["history"][-1]["saved"]
            loser["exploited"] = winner["id"]
            loser["values"] = {p.key: _explore(p, winner["values"][p.key], rng, space.perturb) for p in space.params}
    results = {"study": name, "metric": space.metric, "algorithm": "pbt",
               "members": [{"id": m["id"], "history": m["history"]} for m in members]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def _run(recipe: Path, space: Space, out: Path, name: str, member: dict[str, Any], generation: int) -> None:
    tag = f"m{member['id']}-g{generation}"
    metrics, log, saved = out / f"{tag}.metrics.jsonl", out / f"{tag}.log", out / "ckpts" / f"{tag}.ckpt"
    metrics.unlink(missing_ok=True)
    resume = member["resume"]
    cmd = [sys.executable, "-m", "lightning_par.tuning.trial", str(metrics), space.metric,
           *(["--resume", resume] if resume else []), "--save", str(saved), "--config", str(recipe),
           *space.overrides(member["values"]),
           f"--trainer.max_steps={space.steps_per_generation * (generation + 1)}"]  # fmt: skip
    env = {**os.environ, "WANDB_RUN_GROUP": name, "WANDB_NAME": f"{name}-{tag}"}
    with log.open("w") as sink:
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    scores = [r for r in rows if "value" in r]
    if done.returncode != 0 or not scores:
        why = f"exited with {done.returncode}" if done.returncode else f"logged no {space.metric!r} in validation"
        raise TrialFailed(f"pbt run {tag} {why}; its log {log}:\n{log.read_text()[-2000:]}")
    start: dict[str, Any] = next((r for r in rows if "start_step" in r), {})
    member["history"].append({
        "generation": generation, "values": dict(member["values"]), "score": scores[-1]["value"],
        "resumed": resume, "exploited": member.pop("exploited", None), "start_step": start.get("start_step"),
        "lr_at_start": start.get("lr"), "saved": str(saved),
    })  # fmt: skip
