"""Context parallelism: communication bytes per layer against the ring-attention formula (all-gather mode) and the
Ulysses formula (all-to-all mode), and the activation memory a rank keeps for backward under cp 1, 2 and 4 at the
same sequence length, in both modes.

Launch (4 ranks; every layout runs in the same script, alternated over rounds):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_context_parallel.py [--quick]

Model: the reference `Llama` (8 layers, dim 128, 8 heads, 4 key/value heads, vocabulary 256), fp32, sequence S=512,
B=2 samples per rank in every layout (global batch 2 x dp, dp = 4 / cp), so each rank sees the same samples'
worth of tokens and only the split differs.

- Bytes: every all-gather of the cp mechanism (`lightning_par._compat.all_gather_single`) is counted in the forward
  of the measured step: bytes a rank receives from the other cp ranks. Per layer that is the keys and the values;
  once per forward the trunk's output is gathered too (subtracted, reported apart). Ring attention's forward moves
  ``2 * (cp-1)/cp`` of the whole sequence's K and V per layer per rank (each rank receives every other rank's
  chunk of K and of V), and an all-gather moves the same bytes; the ratio measured / formula is reported. K and V
  are what the model passes to `scaled_dot_product_attention`: the reference Llama repeats its key/value heads to
  the query heads before the call, so they travel repeated (a model passing grouped K/V with `enable_gqa` sends
  `n_kv_heads / n_heads` of that). Backward gathers them again (the attention is recomputed, so a layer keeps only
  its local K and V for backward) and all-reduces their gradients; not counted here.
- Ulysses bytes (``cp_mode="ulysses"``): every all-to-all (`torch.distributed.all_to_all_single`) in the forward of
  the measured step, bytes received from the other ranks. Per layer: q, k and v to head groups, the output back:
  ``(cp-1)/cp`` of this rank's local q, k, v and output each, i.e. ``4 (cp-1)/cp^2 |K|`` with ``|K|`` the whole
  sequence's keys (q, k, v and the output have the same size here). Backward runs the transposed all-to-alls.
- Activation memory: bytes of the distinct storages autograd saves for backward during the forward
  (`torch.autograd.graph.saved_tensors_hooks`; parameters excluded), in total and inside the trunk's blocks only;
  the goal is 1/cp of cp 1's inside the trunk. What runs outside the trunk (embedding, head, loss) runs on the
  whole sequence on every cp rank, by design (docs/context_parallel.md), and is reported separately.
- Step time: median ms per step after warm-up, per layout, alternated over rounds (ratios to cp 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rounds import finish, ratio_line  # noqa: E402
from torch.autograd.graph import saved_tensors_hooks  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par import _compat  # noqa: E402
from lightning_par.blocks.trunk import find_trunk  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import Llama  # noqa: E402

SEQ, PER_RANK, LAYERS, DIM, HEADS, KV_HEADS = 512, 2, 8, 128, 8, 4


class _Probe(L.Callback):
    """Counts cp all-gather bytes and saved activation bytes in the forward of the measured step; times steps."""

    def __init__(self, measure_step: int) -> None:
        self.measure_step = measure_step
        self.times: list[float] = []
        self.gathered = 0
        self.exchanged = 0  # all-to-all bytes received (Ulysses)
        self.saved_total = 0
        self.saved_trunk = 0
        self._on = False
        self._in_block = 0
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._hooks: Any = None
        self._t = 0.0
        self._orig = _compat.all_gather_single
        self._orig_a2a = dist.all_to_all_single

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        trunk = find_trunk(pl_module)
        assert trunk is not None
        for block in trunk.blocks:
            block.register_forward_pre_hook(lambda *a: self._enter())
            block.register_forward_hook(lambda *a: self._leave())

        def counted(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
            if self._on:
                n = dist.get_world_size(group)
                self.gathered += inp.numel() * inp.element_size() * (n - 1)  # received from the other ranks
            return self._orig(out, inp, group=group)

        def exchanged(out: torch.Tensor, inp: torch.Tensor, out_splits: Any = None, in_splits: Any = None,
                      group: Any = None) -> Any:  # fmt: skip
            if self._on and out_splits is not None:
                own = out_splits[dist.get_rank(group)]
                self.exchanged += (sum(out_splits) - own) * out[0].numel() * out.element_size()
            return self._orig_a2a(out, inp, out_splits, in_splits, group=group)

        _compat.all_gather_single = counted  # type: ignore[assignment]
        dist.all_to_all_single = exchanged  # type: ignore[assignment]

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        _compat.all_gather_single = self._orig  # type: ignore[assignment]
        dist.all_to_all_single = self._orig_a2a  # type: ignore[assignment]

    def _enter(self) -> None:
        self._in_block += 1

    def _leave(self) -> None:
        self._in_block -= 1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._seen and ptr not in self._params and t.device.type != "meta":
            self._seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
            self.saved_total += nbytes
            if self._in_block:
                self.saved_trunk += nbytes
        return t

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t = time.perf_counter()
        if batch_idx == self.measure_step:
            self._on = True
            self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if self._on:
            self._on = False
            self._hooks.__exit__(None, None, None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t)


def _run(cp: int, mode: str, steps: int) -> tuple[_Probe, int]:
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // cp
    probe = _Probe(measure_step=steps - 1)
    data = ByteTextDataModule(seq_len=SEQ, batch_size=PER_RANK, num_samples=PER_RANK * dp * steps, seed=0)
    strategy = lightning_par.ParallelStrategy(cp=cp, cp_mode=mode) if cp > 1 else lightning_par.ParallelStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])  # fmt: skip
    model = Llama(max_seq_len=SEQ, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, ffn_hidden=344)
    trainer.fit(model, datamodule=data)
    return probe, dp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    steps, rounds, warm = (3, 1, 1) if args.quick else (6, 3, 2)
    layouts = [(1, "allgather"), (2, "allgather"), (4, "allgather"), (2, "ulysses"), (4, "ulysses")]
    times: dict[tuple[int, str], list[float]] = {x: [] for x in layouts}
    mem: dict[tuple[int, str], tuple[int, int]] = {}
    out: list[str] = []
    # K and V of the whole sequence as scaled_dot_product_attention receives them, fp32: the reference Llama repeats
    # its KV_HEADS to HEADS before the call (Meta's repeat_kv), so that is what travels.
    kv = 2 * PER_RANK * SEQ * HEADS * (DIM // HEADS) * 4
    hidden = PER_RANK * SEQ * DIM * 4
    for r in range(rounds):
        for cp, mode in layouts:
            probe, _ = _run(cp, mode, steps)
            times[cp, mode].append(statistics.median(probe.times[warm:]) * 1e3)
            if r:
                continue
            mem[cp, mode] = (probe.saved_total, probe.saved_trunk)
            if cp == 1:
                continue
            exit_bytes = hidden * (cp - 1) // cp
            if mode == "allgather":
                per_layer = (probe.gathered - exit_bytes) / LAYERS
                formula = kv * (cp - 1) / cp
                name = "K/V all-gather received per layer"
                how = "ring formula 2*(cp-1)/cp*|K|"
            else:
                per_layer = probe.exchanged / LAYERS
                formula = 2 * kv * (cp - 1) / cp**2  # q, k, v and the output: 4 (cp-1)/cp^2 |K|
                name = "q/k/v/out all-to-all received per layer"
                how = "Ulysses formula 4*(cp-1)/cp^2*|K|"
            out.append(
                f"cp {cp} {mode}: {name} {per_layer / 2**10:.1f} KiB, {how} {formula / 2**10:.1f} KiB, "
                f"measured/formula {per_layer / formula:.4f}; trunk exit gather {exit_bytes / 2**10:.1f} KiB per "
                f"forward" + ("" if mode == "allgather" else f" (counted: {probe.gathered / 2**10:.1f} KiB)")
            )
    base = mem[1, "allgather"]
    for cp, mode in layouts:
        total, trunk = mem[cp, mode]
        out.append(
            f"cp {cp} {mode}: saved activations per rank {total / 2**20:.2f} MiB (trunk {trunk / 2**20:.2f} MiB, "
            f"outside {(total - trunk) / 2**20:.2f} MiB); trunk ratio to cp 1 {trunk / base[1]:.3f} (goal "
            f"{1 / cp:.3f}), total ratio {total / base[0]:.3f}"
        )
    for cp, mode in layouts[1:]:
        out.append(ratio_line(f"cp {cp} {mode}", times[cp, mode], times[1, "allgather"], "cp 1"))
    finish(out)


if __name__ == "__main__":
    main()
