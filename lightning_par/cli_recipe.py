"""Build a recipe's LightningCLI objects without running them, and its model on the meta device: what the
``lightning-par`` subcommands that inspect a recipe (``plan``, ``check``, ``estimate --config``) share."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.pytorch.cli import LightningCLI

import lightning_par  # noqa: F401  (registers the strategy names a recipe may use)


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


def _built(model: Any) -> Any:
    # A model built in configure_model() (Lightning's hook for models larger than one device) has no layers until
    # the hook runs: run it on the meta device, as the strategies do, so that inspecting it allocates nothing.
    with torch.device("meta"):
        model.configure_model()
    return model
