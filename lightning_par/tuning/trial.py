"""One trial of `lightning-par sweep`: the recipe, run by LightningCLI, with a callback that appends every
validation's metric to a file, which the sweep reads to report and prune.

``python -m lightning_par.tuning.trial METRICS_FILE METRIC [LightningCLI arguments, e.g. --config RECIPE --k=v]``.
Lightning's own launcher re-runs this command for the other ranks of a multi-device recipe; rank 0 writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L


class MetricsFile(L.Callback):
    """Append ``{"step": global_step, "value": metric}`` to ``path`` after each validation (rank 0; not in the
    sanity check)."""

    def __init__(self, path: Path, metric: str) -> None:
        self.path, self.metric = Path(path), metric

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if trainer.sanity_checking or not trainer.is_global_zero or value is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "value": float(value)}) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    """Run one trial (module docstring)."""
    from lightning_par.cli_recipe import build_cli

    path, metric, *args = sys.argv[1:] if argv is None else argv
    cli = build_cli(args, run=False)
    cli.trainer.callbacks.append(MetricsFile(Path(path), metric))  # type: ignore[attr-defined]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


if __name__ == "__main__":
    main()
