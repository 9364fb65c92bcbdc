"""What gpu_check.py's sections share: seeded synthetic token data, one Trainer fit that records losses and step times,
and section (1), every strategy family at degree 1 against the plain single-device Trainer.

Data: random token windows, the same for every run. A strategy of this suite is "distributed" even at world 1, so
Lightning puts a `DistributedSampler(shuffle=True, seed=0)` in its training loader; the reference Trainer (no
sampler inserted) reads the dataset through a `Subset` in that sampler's epoch-0 order, so both see the same batches.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from lightning_par.models import GPT, Llama, MoEGPT

# ~1.0 B parameters (TinyLlama's width and vocabulary, 18 blocks): 47 M per block, 131 M in embedding and head.
LLAMA_1B = dict(vocab_size=32000, max_seq_len=2048, dim=2048, n_layers=18, n_heads=16, n_kv_heads=8, ffn_hidden=5632)
LLAMA_SMOKE = dict(vocab_size=256, max_seq_len=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)


def tokens(n: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """``n`` windows of ``seq`` inputs and their next-token targets, drawn from a fixed seed."""
    data = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


def loader(dataset: TensorDataset, batch: int, plain: bool) -> DataLoader:
    """The training loader; ``plain``: pre-ordered as the strategies' inserted sampler orders it (module docstring)."""
    if plain:
        order = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
        dataset = Subset(dataset, order)  # type: ignore[assignment]
    return DataLoader(dataset, batch_size=batch, shuffle=False, drop_last=True)


class Recorder(L.Callback):
    """Losses of every step, and wall time from one step's end to the next (synchronized with the device): the whole
    loop, the next batch's fetch and Lightning's hooks included, as the hand-written loop's times include its own."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self._last: Optional[float] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._last is None:  # the first step is timed from its start
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = float(outputs["loss"])  # the hand-written loop reads its loss too
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        assert self._last is not None
        self.step_s.append(now - self._last)
        self._last = now
        self.losses.append(loss)


def fit(
    make: Callable[[], L.LightningModule],
    strategy: Any,
    data: TensorDataset,
    *,
    batch: int,
    steps: int,
    accelerator: str,
    precision: str = "32-true",
    callbacks: Optional[list[L.Callback]] = None,
) -> tuple[Recorder, L.LightningModule, L.Trainer]:
    """Seed, build the model, and train ``steps`` steps on one device; returns the recorder, the model, the trainer."""
    L.seed_everything(0, verbose=False)
    model = make()
    record = Recorder()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[record, *(callbacks or [])],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(data, batch, plain=strategy == "auto"))
    return record, model, trainer


@contextmanager
def host_syncs(accelerator: str) -> Iterator[list[warnings.WarningMessage]]:
    """Records a warning per implicit host-device synchronization on CUDA (``.item()``, ``.tolist()``, ...): MoE's
    per-layer ``counts.tolist()`` among them. Explicit ``torch.cuda.synchronize()`` calls are not counted."""
    with warnings.catch_warnings(record=True) as caught:
        if accelerator != "cuda":
            yield caught
            return
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (DTensors and DeepSpeed ZeRO-3's partitions gathered), in fp32 on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3 leaves an empty placeholder between its gathers
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().cpu().clone()
            continue
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.float().cpu().clone()  # a copy: .float().cpu() of an fp32 CPU tensor is the tensor itself
    return out


# (strategy, model) rows of section (1). Degree 1 everywhere: one device. The MoE rows use the MoE GPT.
FAMILIES = [
    ("zero1", "gpt"), ("zero2", "gpt"), ("zero3", "gpt"), ("zero3_offload", "gpt"), ("tp", "llama"),
    ("tp_zero3", "llama"), ("pipe", "gpt"), ("pipe_zero3", "llama"), ("cp", "llama"), ("3d", "llama"),
    ("moe", "moe"), ("moe_zero3", "moe"), ("tp_moe", "moe"), ("deepspeed_zero2", "gpt"), ("deepspeed_zero3", "gpt"),
]  # fmt: skip
# Tolerances (loss rel, parameter rtol, parameter atol) after the steps, the suite's (tests/test_deepspeed.py) for
# the models' lr 1e-3: fp32 atol 0.01 lr (AdamW turns a tiny gradient difference on a near-zero gradient into an
# O(lr) move; DeepSpeed's ZeRO-3 measured 1.5e-6 here), mixed precision 2 lr per step (rounding flips such a
# gradient's sign).
TOLERANCE = {"32-true": (1e-5, 1e-5, 1e-5), "bf16-mixed": (1e-2, 1e-2, 1e-2), "16-mixed": (1e-3, 1e-2, 1e-2)}


def _models(small: bool) -> dict[str, Callable[[], L.LightningModule]]:
    width = 64 if small else 256
    return {
        "gpt": lambda: GPT(n_layer=2, n_embd=width, n_head=4, block_size=64),
        "llama": lambda: Llama(dim=width, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=2 * width, max_seq_len=64),
        "moe": lambda: MoEGPT(n_layer=2, n_embd=width, n_head=4, block_size=64),
    }


def parity(accelerator: str, smoke: bool) -> list[dict[str, Any]]:
    """Section (1): 5 steps of every family at degree 1 vs the plain Trainer, per precision."""
    precisions = ["32-true", "bf16-mixed"] + (["16-mixed"] if accelerator == "cuda" else [])
    if smoke:  # every family in fp32, one in bf16: the code paths, in seconds
        precisions = ["32-true", "bf16-mixed"]
    models, data = _models(smoke), tokens(40, 64, 256)
    rows: list[dict[str, Any]] = []
    for precision in precisions:
        refs: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
        for strategy, name in FAMILIES:
            row: dict[str, Any] = {"strategy": strategy, "model": name, "precision": precision}
            if smoke and precision != "32-true" and strategy != "zero3":
                continue
            if precision == "16-mixed" and strategy not in ("zero2", "zero3", "deepspeed_zero2"):
                continue  # the grad-scaler paths: ShardedGradScaler("cuda") and DeepSpeed's loss scaler
            if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
                rows.append({**row, "ok": None, "note": "deepspeed not installed"})
                continue
            try:
                if name not in refs:
                    rec, model, _ = fit(models[name], "auto", data, batch=8, steps=5, accelerator=accelerator,
                                        precision=precision)  # fmt: skip
                    refs[name] = (rec.losses, full_params(model))
                with host_syncs(accelerator) as syncs:
                    rec, model, _ = fit(models[name], strategy, data, batch=8, steps=5, accelerator=accelerator,
                                        precision=precision)  # fmt: skip
                ref_losses, ref_params = refs[name]
                got = full_params(model)
                if len(rec.losses) != len(ref_losses) or set(got) != set(ref_params):
                    raise AssertionError(f"{len(rec.losses)} losses and {sorted(set(got) ^ set(ref_params))} "
                                         f"parameters apart from the reference's {len(ref_losses)}")  # fmt: skip
                loss_rel = max(abs(a - b) / abs(b) for a, b in zip(rec.losses, ref_losses, strict=True))
                tol_loss, rtol, atol = TOLERANCE[precision]
                diffs = {k: (got[k] - v).abs() for k, v in ref_params.items()}
                params_ok = all(bool((d <= atol + rtol * ref_params[k].abs()).all()) for k, d in diffs.items())
                worst = max(float(d.max()) for d in diffs.values())
            except Exception as err:  # a report row, not a crash: the other rows still run
                rows.append({**row, "ok": False, "note": f"{type(err).__name__}: {err}"[:400]})
                continue
            ok = len(rec.losses) == 5 and loss_rel <= tol_loss and params_ok
            tolerance = TOLERANCE[precision]
            rows.append({**row, "ok": ok, "loss_rel": loss_rel, "param_max_abs": worst, "tolerance": tolerance})
            if accelerator == "cuda":  # the whole fit's, set-up included, per step: a comparison between rows
                rows[-1]["host_syncs_per_step"] = sum("synchroniz" in str(w.message) for w in syncs) / 5
    return rows
