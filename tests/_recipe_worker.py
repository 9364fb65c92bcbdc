"""Train recipes for a few steps, one after another, in the ranks torchrun started: ``_recipe_worker.py SPEC``.

SPEC is a JSON file ``{"out": PATH, "runs": [[name, [cli args...]], ...]}``; each run is ``lightning-par fit`` with
those arguments, in this process (the strategies see torchrun's ranks, so Lightning starts no processes). Rank 0
writes, per recipe, the steps trained, the last training loss, the strategy's class and its layout.
"""

from __future__ import annotations

import json
import math
import sys
import warnings

import torch
import torch.distributed as dist

from lightning_par.cli import build_cli


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    warnings.filterwarnings("ignore")
    results = {}
    for name, args in spec["runs"]:
        cli = build_cli(["fit", *args])
        trainer = cli.trainer
        loss = trainer.callback_metrics.get("train_loss")
        layout = getattr(trainer.strategy, "parallel_layout", None) or {}
        results[name] = {
            "steps": trainer.global_step,
            "loss": float(loss) if loss is not None else math.nan,
            "strategy": type(trainer.strategy).__name__,
            "layout": {k: v for k, v in layout.items() if isinstance(v, (int, str))},
            "trainable": sum(p.numel() for p in cli.model.parameters() if p.requires_grad),
            "params": sum(p.numel() for p in cli.model.parameters()),
        }
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, spec["out"])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
