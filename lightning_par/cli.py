"""``lightning-par``: LightningCLI with lightning_par's strategies registered.

``lightning-par fit --config recipes/demo.yaml``. Any LightningModule / LightningDataModule can be named in a
recipe with ``class_path``; strategies are either a registered name (``strategy: zero2``) or
``class_path: lightning_par.ParallelStrategy`` with explicit degrees.

``lightning-par consolidate CKPT_DIR OUT`` writes a sharded checkpoint folder as one plain Lightning checkpoint
file (`lightning_par.checkpoint.consolidate`); with ``--format hf [--config CONFIG] [--prefix P] [--max-shard-size
5GB]`` as a Hugging Face folder that ``from_pretrained`` loads (`lightning_par.checkpoint.export_hf`).

``lightning-par plan --config RECIPE`` prints the tensor-parallel plan inferred for the recipe's model (with the
strategy's ``tp_plan`` overrides applied, and checked against its ``tp`` when that is set), without training.
With ``--gpu NAME`` it is the planner instead: every layout ranked by predicted step time (`lightning_par.cli_plan`);
``lightning-par estimate`` predicts one layout's memory and step time.

``lightning-par recipes [FOLDER]`` lists the recipes (``./recipes``, else the ones beside this package's source), one
line each: the name and what it trains.

``lightning-par sweep --config RECIPE --space SPACE.yaml`` runs Optuna trials of a recipe (`lightning_par.tuning`),
or Ray Tune trials with ``backend: ray`` in the space (``--ray-address`` names a cluster).

``lightning-par verify --config RECIPE --strategy NAME [--steps N] [--devices D]`` trains the recipe under the layout
and under one process and compares them step by step (`lightning_par.cli_verify`).

``lightning-par check --config RECIPE`` reports, without training, which strategy names can train the recipe's model
and why the others cannot (`lightning_par.analysis.compatibility`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import lightning_par  # registers the strategy names
from lightning_par.cli_recipe import _built, build_cli


def print_plan(args: list[str]) -> str:
    """Build the recipe's model and strategy (no processes, no training) and return its tensor-parallel plan.

    Args:
        args: LightningCLI arguments without a subcommand, e.g. ``["--config", "recipes/tp.yaml"]``.

    Raises:
        TPPlanError: the plan cannot be inferred, or the strategy's tp does not divide what it must.
    """
    from lightning_par.parallel.tensor import format_plan, infer_tp_plan, validate_tp

    cli = build_cli(args, run=False)
    strategy = cli.trainer.strategy
    overrides = getattr(strategy, "_tp_plan", None)
    plan = infer_tp_plan(_built(cli.model), overrides=overrides)
    text = format_plan(plan)
    tp = strategy.config.tp if isinstance(strategy, lightning_par.ParallelStrategy) else 1
    if tp > 1:
        validate_tp(plan, tp)
        text += f"\nvalid for tp={tp}"
    return text


def check_recipe(args: list[str]) -> str:
    """Build the recipe's model (no processes, no training) and return which strategies can train it, and why not.

    Args:
        args: LightningCLI arguments without a subcommand, e.g. ``["--config", "recipes/demo.yaml"]``.
    """
    from lightning_par.analysis.compatibility import check_model, first_optimizer, format_verdicts

    cli = build_cli(args, run=False)
    optimizer = first_optimizer(_built(cli.model).configure_optimizers())
    return format_verdicts(check_model(cli.model, optimizer))


def _recipe_summary(path: Path) -> str:
    # A recipe opens with its launch command (and notes), then a bare "#" line, then the paragraph saying what it
    # trains: its first sentence is the summary.
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "#"), None)
    words: list[str] = []
    for line in lines[start + 1 :] if start is not None else []:
        if not line.startswith("#") or not line.lstrip("#").strip():
            break
        words.append(line.lstrip("#").strip())
    paragraph = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(words))  # a word hyphenated across two lines
    return re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]


def list_recipes(folder: Optional[Path] = None) -> str:
    """One line per recipe in ``folder`` (default ``./recipes``, else the checkout's beside the package).

    Raises:
        FileNotFoundError: no recipe folder was found.
    """
    candidates = [folder] if folder is not None else [Path("recipes"), Path(__file__).resolve().parents[1] / "recipes"]
    found = next((c for c in candidates if c.is_dir() and any(c.glob("*.yaml"))), None)
    if found is None:
        raise FileNotFoundError(
            f"no recipes in {', '.join(map(str, candidates))}: pass the folder (`lightning-par recipes PATH`), or "
            "run from a checkout of lightning_par, whose recipes/ folder holds them"
        )
    paths = sorted(found.glob("*.yaml"))
    width = max(len(p.stem) for p in paths)
    rows = [f"{p.stem:<{width}}  {_recipe_summary(p)}" for p in paths]
    return "\n".join([f"recipes in {found} (launch: each file's first line; train: lightning-par fit --config FILE)",
                      *rows])  # fmt: skip


def sweep_main(argv: list[str]) -> None:
    """``lightning-par sweep --config RECIPE --space SPACE.yaml [--out DIR] [--study-name N] [--storage URL]
    [--ray-address ADDRESS]``."""
    import argparse

    from lightning_par.tuning.space import SpaceError, load_space
    from lightning_par.tuning.sweep import run_sweep, study_results, summary

    parser = argparse.ArgumentParser(prog="lightning-par sweep", description="Optuna or Ray Tune trials of a recipe")
    parser.add_argument("--config", required=True, type=Path, help="the recipe (as for lightning-par fit)")
    parser.add_argument("--space", required=True, type=Path, help="the search space YAML")
    parser.add_argument("--out", type=Path, default=Path("sweeps"), help="trial logs, metrics and results.json")
    parser.add_argument("--study-name", default=None, help="the study and W&B group name")
    parser.add_argument("--storage", default=None, help="Optuna storage URL, e.g. sqlite:///sweep.db (resumable)")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="backend: ray only: the Ray cluster (auto: the running one; default: start a local one)",
    )
    args = parser.parse_args(argv)
    try:
        space = load_space(args.space)
        if space.backend != "ray" and args.ray_address is not None:
            raise SpaceError(f"--ray-address is for Ray Tune; add 'backend: ray' to {args.space}, or drop the flag")
        if space.backend == "ray":
            if args.storage is not None:
                raise SpaceError("--storage is an Optuna storage; Ray Tune keeps its state in OUT/ray: drop --storage")
            from lightning_par.tuning.ray_tune import run_ray_sweep

            results = run_ray_sweep(args.config, space, args.out, args.study_name, args.ray_address)
        elif space.algorithm == "pbt":
            from lightning_par.tuning.pbt import run_pbt

            results = run_pbt(args.config, space, args.out, args.study_name)
            for member in results["members"]:
                print(f"member {member['id']}: " + ", ".join(f"{h['score']:.4g}" for h in member["history"]))
            return
        else:
            study = run_sweep(args.config, space, args.out, args.study_name, args.storage)
            results = study_results(study, space.metric)
    except SpaceError as err:
        sys.exit(f"lightning-par sweep: {err}")
    print(summary(results, space.direction))


def main() -> None:
    """Entry point of the ``lightning-par`` console script."""
    if len(sys.argv) > 1 and sys.argv[1] == "consolidate":  # not a LightningCLI subcommand: no trainer, no model
        from lightning_par.checkpoint.consolidate import main as consolidate_main

        consolidate_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and (sys.argv[1] == "estimate" or (sys.argv[1] == "plan" and "--gpu" in sys.argv)):
        from lightning_par import cli_plan

        try:
            print(cli_plan.run_estimate(sys.argv[2:]) if sys.argv[1] == "estimate" else cli_plan.run_plan(sys.argv[2:]))
        except ValueError as err:  # unknown GPU, a layout that does not divide, a config missing keys
            sys.exit(f"lightning-par {sys.argv[1]}: {err}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "plan":
        print(print_plan(sys.argv[2:]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "recipes":
        print(list_recipes(Path(sys.argv[2]) if len(sys.argv) > 2 else None))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        print(check_recipe(sys.argv[2:]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "verify":
        from lightning_par.cli_verify import main as verify_main

        verify_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "sweep":
        sweep_main(sys.argv[2:])
        return
    build_cli()


if __name__ == "__main__":
    main()
