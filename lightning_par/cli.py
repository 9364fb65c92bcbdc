"""``lightning-par``: LightningCLI with lightning_par's strategies registered.

``lightning-par fit --config recipes/demo.yaml``. Any LightningModule / LightningDataModule can be named in a
recipe with ``class_path``; strategies are either a registered name (``strategy: zero2``) or
``class_path: lightning_par.ParallelStrategy`` with explicit degrees.

``lightning-par consolidate CKPT_DIR OUT`` writes a sharded checkpoint folder as one plain Lightning checkpoint
file (`lightning_par.checkpoint.consolidate`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

import lightning_par  # noqa: F401  (registers the strategy names)


def _default_wandb_mode() -> None:
    # W&B runs offline unless the user has a key or chose a mode: the demo must work on a machine with no network.
    if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
        os.environ["WANDB_MODE"] = "offline"


def build_cli(args: Optional[list[str]] = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` into a LightningCLI (and run the subcommand unless ``run=False``).

    Args:
        args: command-line arguments (default ``sys.argv[1:]``).
        run: ``False`` only parses and instantiates model, data and trainer (tests use it to check recipes).
    """
    _default_wandb_mode()
    kwargs: dict[str, Any] = {"save_config_kwargs": {"overwrite": True}}
    return LightningCLI(args=args, run=run, **kwargs)


def main() -> None:
    """Entry point of the ``lightning-par`` console script."""
    if len(sys.argv) > 1 and sys.argv[1] == "consolidate":  # not a LightningCLI subcommand: no trainer, no model
        from lightning_par.checkpoint.consolidate import main as consolidate_main

        consolidate_main(sys.argv[2:])
        return
    build_cli()


if __name__ == "__main__":
    main()
