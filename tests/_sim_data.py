"""What the one-process simulations (`_local_sgd_sim`, `_powersgd_sim`, `_quantized_sim`) share with
`_worker.py`'s runs: the training samples in the order the data-parallel ranks read them, one rank's loss on a
list of samples, and a model's optimizer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_par.data import ByteTextDataModule


def sampler_order(seq_len: int, samples: int) -> tuple[Any, list[int]]:
    """The worker's training dataset of ``samples`` samples, and the order a ``DistributedSampler(shuffle=True,
    seed=0)`` gives at epoch 0: data-parallel rank i of dp reads ``order[i::dp]``, and together the ranks read the
    global batch of step k as ``order[k*B:(k+1)*B]``."""
    data = ByteTextDataModule(seq_len=seq_len, batch_size=1, num_samples=samples, seed=0)
    data.setup()
    dataset = data._train
    return dataset, torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()


def loss_on(model: torch.nn.Module, dataset: Any, rows: list[int]) -> torch.Tensor:
    """The model's mean next-token loss on samples ``rows`` of ``dataset``, as the worker's models compute it."""
    x = torch.stack([dataset[i][0] for i in rows])
    y = torch.stack([dataset[i][1] for i in rows])
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def optimizer_and_scheduler(model: Any) -> tuple[torch.optim.Optimizer, Any]:
    """What ``model.configure_optimizers()`` returns: its optimizer, and its LR scheduler or ``None``."""
    configured = model.configure_optimizers()
    if isinstance(configured, dict):
        return configured["optimizer"], configured.get("lr_scheduler", {}).get("scheduler")
    return configured, None
