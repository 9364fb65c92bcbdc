"""Expert parallelism: all-to-all bytes per MoE layer per step, expert parameter bytes per rank, and step time of
``moe`` (ep = 2) against plain data parallelism (``zero0`` on the same MoE-GPT: every rank holds every expert).

Launch (2 ranks on 2 CPU cores; ~40 s at 1-min load < 2, ~30 s with --quick):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py [--quick]

Bytes. Every ``all_to_all_single`` is counted while the ``moe`` run trains: rows sent to *other* ranks times the
row bytes (what leaves this rank; its own rows stay in memory). The four per layer and step are dispatch and
combine in forward and their transposes in backward, each moving the same rows. They are compared with

- the formula ``k * cf * T * d * bytes * (n-1)/n`` (T = this rank's tokens, d = hidden size, cf = 1 for dropless):
  what uniform routing would send; the measured/formula ratio shows how far real routing is from uniform;
- the exact prediction from the routing the layer recorded (kept assignments whose expert lives on another rank,
  times the row bytes): measured/predicted must be 1.

Host syncs: on the measured step, the points in each MoE layer's forward where a CUDA run would wait for the device
(``.tolist()``, ``.item()``, ops whose output size depends on the values: ``nonzero``, ``bincount``,
``repeat_interleave`` without ``output_size``; `_Syncs`, as tests/test_moe_syncs.py counts them), per layer, for
``moe`` and for ``zero0``. The backward adds none.

Step time: median ms per optimizer step after warm-up, runs interleaved over rounds (ABBA), reported as a ratio:
``moe`` (ep = 2, E/2 experts per rank) against ``zero0`` (every rank holds all E experts) at equal FLOPs (same
model, same global batch: each rank computes k assignments per token of its batch either way); the difference is
the exchange (four row all-to-alls and one count all-to-all per layer) and its host sync.
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

import lightning_par  # noqa: E402
from lightning_par import _compat  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import MoEGPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

SEQ, BATCH = 64, 8


class _Counter:
    """Wraps ``dist.all_to_all_single`` and records (rows sent to others, row bytes, kind) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._orig = dist.all_to_all_single
        self.on = False

    def __enter__(self) -> _Counter:
        def counted(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                    input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:  # fmt: skip
            if self.on:
                rank = dist.get_rank(group)
                n = dist.get_world_size(group)
                splits = input_split_sizes or [input.shape[0] // n] * n
                row = input[0:1].numel() * input.element_size() if input.shape[0] else 0
                if input.dim() == 1 and input.dtype == torch.int64:
                    kind = "counts"
                    row = input.element_size()
                else:
                    kind = "rows"
                    row = (input.numel() // max(input.shape[0], 1)) * input.element_size()
                self.calls.append((kind, sum(s for j, s in enumerate(splits) if j != rank) * row))
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._orig


class _Syncs(_compat.TorchDispatchMode):  # type: ignore[misc]
    """Counts the host syncs of a CUDA run (module docstring) while entered; ``tolist`` is patched while counting."""

    ALWAYS = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "_unique2", "unique_consecutive")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> _Syncs:
        def counted(t: torch.Tensor) -> Any:
            self.count += 1
            return self._tolist(t)

        torch.Tensor.tolist = counted  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sized = name == "repeat_interleave" and kwargs.get("output_size") is None
        masked = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        self.count += name in self.ALWAYS or sized or masked
        return func(*args, **kwargs)


class _Probe(L.Callback):
    """Step times, and on the measured step the counted bytes and the routing-predicted bytes."""

    def __init__(self, counter: _Counter | None, measure_step: int) -> None:
        self.counter, self.measure_step = counter, measure_step
        self.times: list[float] = []
        self.bytes: dict[str, Any] = {}
        self.syncs: list[int] = []  # per MoE layer, on the measured step
        self._handles: list[Any] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.counter is not None:
            self.counter.on = batch_idx == self.measure_step
            self.counter.calls.clear()
        if batch_idx == self.measure_step:
            self._count_syncs(pl_module._moe_layers())
        self._t = time.perf_counter()

    def _count_syncs(self, layers: list[Any]) -> None:
        """Count each layer's syncs in its forward of this step (hooks enter and leave a fresh `_Syncs`)."""
        self.syncs = [0] * len(layers)
        self._handles = []
        for i, layer in enumerate(layers):
            mode = _Syncs()

            def enter(m: Any, a: Any, mode: _Syncs = mode) -> None:
                mode.__enter__()

            def leave(m: Any, a: Any, out: Any, i: int = i, mode: _Syncs = mode) -> None:
                mode.__exit__(None, None, None)
                self.syncs[i] = mode.count

            self._handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t)
        if batch_idx == self.measure_step:
            for h in self._handles:
                h.remove()
        if self.counter is None or batch_idx != self.measure_step:
            return
        self.counter.on = False
        n, rank = dist.get_world_size(), dist.get_rank()
        layers = pl_module._moe_layers()
        e_local = layers[0].n_experts // n
        row = pl_module.hidden_size * 4
        # sends[i, j]: kept rows rank i dispatches to rank j, summed over layers. Per rank, dispatch and the
        # backward of combine send its own rows (sum_j!=r sends[r, j]); combine and the backward of dispatch send
        # back what it received (sum_i!=r sends[i, r]).
        sends = torch.zeros(n, n, dtype=torch.int64)
        for moe in layers:
            experts, kept = moe.stats["expert_index"], moe.stats["kept"]
            sends[rank] += torch.bincount(experts[kept] // e_local, minlength=n)
        dist.all_reduce(sends)
        own = sends[rank].sum() - sends[rank, rank]
        back = sends[:, rank].sum() - sends[rank, rank]
        predicted = int(own + back) * 2 * row / 4  # per all-to-all (4 per layer), summed over layers
        rows = [b for kind, b in self.counter.calls if kind == "rows"]
        self.bytes = {
            "rows_calls": len(rows),
            "rows_bytes": sum(rows),
            "count_calls": sum(1 for kind, _ in self.counter.calls if kind == "counts"),
            "predicted_per_a2a": predicted,
            "tokens": batch[0].numel(),
            "layers": len(layers),
            "k": layers[0].top_k,
            "dropped": float(torch.stack([m.stats["dropped_fraction"] for m in layers]).mean()),
            "cf": layers[0].capacity_factor or 1.0,
            "d": pl_module.hidden_size,
            "expert_bytes": sum(
                p.numel() * p.element_size() for nm, p in pl_module.named_parameters() if ".experts." in nm
            ),
        }


def _model(capacity: float | None) -> MoEGPT:
    return MoEGPT(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=128, n_experts=8, top_k=2,
                  capacity_factor=capacity, lr=1e-3)  # fmt: skip


def _run(strategy: Any, steps: int, capacity: float | None, counter: _Counter | None) -> _Probe:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    probe = _Probe(counter, measure_step=steps - 1)
    if isinstance(strategy, dict):
        strategy = lightning_par.ParallelStrategy(**strategy)
    data = ByteTextDataModule(seq_len=SEQ, batch_size=BATCH // world, num_samples=BATCH * steps, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])  # fmt: skip
    trainer.fit(_model(capacity), datamodule=data)
    return probe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    steps, rounds, warm = (4, 2, 1) if args.quick else (12, 6, 2)
    out: list[str] = []
    with _Counter() as counter:
        for cf in (None, 1.0):
            probe = _run("moe", 3, cf, counter)
            b = probe.bytes
            n = dist.get_world_size()
            per = b["rows_bytes"] / b["layers"] / 4  # per all-to-all
            formula = b["k"] * b["cf"] * b["tokens"] * b["d"] * 4 * (n - 1) / n
            predicted = b["predicted_per_a2a"] / b["layers"]
            out.append(
                f"cf={cf}: a2a row calls {b['rows_calls']} ({b['rows_calls'] / b['layers']:.0f}/layer), count calls "
                f"{b['count_calls']}; dropped {b['dropped']:.3f}; per a2a per layer {per / 2**10:.2f} KiB; "
                f"formula {formula / 2**10:.2f} KiB "
                f"(measured/formula {per / formula:.3f}); routing-predicted {predicted / 2**10:.2f} KiB "
                f"(measured/predicted {per / predicted:.4f})"
            )
        expert_ep = probe.bytes["expert_bytes"]
    dense = _model(None)
    expert_full = sum(p.numel() * p.element_size() for nm, p in dense.named_parameters() if ".experts." in nm)
    out.append(
        f"expert param bytes per rank: moe {expert_ep / 2**20:.3f} MiB, full {expert_full / 2**20:.3f} MiB, "
        f"ratio {expert_ep / expert_full:.4f} (E/ep / E = {1 / dist.get_world_size():.4f})"
    )
    syncs = {
        name: _run(strategy, 2, None, None).syncs for name, strategy in (("moe", "moe"), ("zero0", {"zero_stage": 0}))
    }
    out.append(f"host syncs per MoE layer forward (dropless): moe {syncs['moe']}, zero0 {syncs['zero0']}")
    medians: dict[str, list[float]] = {"moe": [], "zero0": []}
    pairs = [("moe", "moe"), ("zero0", {"zero_stage": 0})]
    for r in range(rounds):
        for name, strategy in pairs if r % 2 == 0 else pairs[::-1]:  # ABBA: drift hits both alike
            times = _run(strategy, steps, None, None).times[warm:]
            medians[name].append(statistics.median(times) * 1e3)
    ratios = [m / z for m, z in zip(medians["moe"], medians["zero0"])]
    out.append(
        f"step time (median ms over rounds): moe ep=2 {statistics.median(medians['moe']):.1f}, zero0 dp=2 "
        f"{statistics.median(medians['zero0']):.1f}; moe/zero0 per round {[round(r, 3) for r in ratios]}, "
        f"median {statistics.median(ratios):.3f}"
    )
    if dist.get_rank() == 0:
        print("\n".join(out), flush=True)
    clean_exit()


if __name__ == "__main__":
    main()
