"""ZeRO-1/2 on one data-parallel rank: the reduction is the identity, so the engine hands each gradient to its
master as it is (`zero.buckets.hand_over`) and skips the gather. Training must stay the one-process training,
through gradient accumulation and with a parameter no step uses (one process leaves its gradient ``None``, so
AdamW's weight decay does not touch it).

Why a separate path: on one H200 the packed path (pack, a reduce-scatter over one rank, divide by one, gather back)
cost zero1/zero2 5 % of the step against ``ddp`` (benchmarks/results/gpu/report.md). Its speed is measured there;
here only that it is exact and that no collective runs.
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.models import Llama
from lightning_par.parallel.zero import replicated as zero_replicated


class _WithUnused(Llama):
    def __init__(self) -> None:
        super().__init__(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16,
                         lr=1e-2, weight_decay=0.1)  # fmt: skip
        self.unused = nn.Parameter(torch.ones(4, 4))  # 2-D: in the weight-decay group


def _fit(strategy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    model = _WithUnused()
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            losses.append(float(outputs["loss"]))

    data = TensorDataset(torch.randint(0, 64, (16, 16)), torch.randint(0, 64, (16, 16)))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[Record()],
                        use_distributed_sampler=False)  # fmt: skip  (the same batches in both: one rank)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=2))
    assert trainer.global_step == 3
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_one_rank_trains_as_one_process_with_no_collective(name, monkeypatch):
    ref_losses, ref_params = _fit("auto")
    calls = {"reduce_scatter": 0, "all_gather": 0}

    def counted(key, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[key] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(zero_replicated, "_reduce_scatter", counted("reduce_scatter", zero_replicated._reduce_scatter))
    monkeypatch.setattr(zero_replicated, "_all_gather", counted("all_gather", zero_replicated._all_gather))
    losses, params = _fit(name)
    assert len(losses) == len(ref_losses) == 6  # 3 steps of 2 accumulated batches
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for n, ref in ref_params.items():
        torch.testing.assert_close(params[n], ref, rtol=1e-6, atol=1e-8, msg=n)
    assert torch.equal(params["unused"], torch.ones(4, 4))  # no gradient, so no decay: as in one process
    assert calls == {"reduce_scatter": 0, "all_gather": 0}
