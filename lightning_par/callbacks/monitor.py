"""Throughput, model FLOPs utilisation and per-rank memory for any lightning_par strategy.

`ParallelismMonitor` is a plain Lightning callback: it reads only what every strategy has (`trainer.world_size`,
`trainer.optimizers`, the module's parameters) plus three optional strategy attributes, so it needs no code in
the strategies themselves:

- `dp_size: int`: ranks that see *different* batches. Tensor- and pipeline-parallel ranks of one data-parallel
  replica see the same batch, so only this size multiplies the per-rank token count. Absent: `world_size`.
- `global_param_count: int`: the active non-embedding parameter count of the whole model
  (`lightning_par.parallel.flops.active_param_count`, counted before the model is laid out, so the same under every
  layout); lightning_par's strategies set it at set-up. Absent (other strategies): counted on the module here.
- `parallel_layout: dict[str, int | str]`: logged once as the `parallel` hyperparameter; its degrees also go out
  as `parallel/<axis>` values at every log.
- `token_group`: the process group whose ranks see different tokens, over which expert loads are summed.
  Absent: every rank (plain data parallelism).
- `moe_layers`: the MoE layers (`lightning_par.parallel.experts.finder.MoELayer`) as found before their experts were
sharded.
  Absent: found in the module.
"""

import itertools
import math
import re
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_par.axes import MODEL_AXES
from lightning_par.callbacks.expert_load import ExpertLoad, load_metrics
from lightning_par.callbacks.pictures import MEMORY_KINDS, load_heatmap, log_pictures, memory_bars, pipeline_timeline
from lightning_par.callbacks.pipeline_view import bubble_metrics, gather_records, step_record
from lightning_par.parallel.flops import active_param_count
from lightning_par.utils import dtensors

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

# Dense (no 2:4 sparsity) peaks per device in FLOP/s. bf16/fp16/tf32 are tensor-core rates with fp32
# accumulate, which is what mixed-precision training runs; fp32 is the CUDA-core rate. Datasheets print the
# sparse rate with an asterisk: these are those numbers halved. Sources:
#   H100 SXM5 / PCIe: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table 3.
#   H100 NVL, H200, H200 NVL: NVIDIA H100 (2023) and H200 (2024) datasheets; H200 SXM runs H100 SXM's compute.
#   A100 SXM4 / PCIe: NVIDIA A100 datasheet (r4); both form factors have the same peaks.
#   A10G: AWS-only part with no public NVIDIA datasheet; AWS G5 specs give half the A10's tensor rate.
#   L4: NVIDIA L4 datasheet. RTX 4090: NVIDIA Ada Lovelace architecture whitepaper v2.1, appendix A.
#   V100 SXM2 / PCIe / V100S: NVIDIA V100 datasheet; no bf16 or tf32 units, so tf32 falls back to fp32.
# First match wins, so the more specific patterns (NVL, PCIe) come before the bare chip name.
_PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH200 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH200\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (r"\bH100 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (r"\bH100\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (r"\bA100\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bA10G\b", {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bV100S\b", {"fp16": 130e12, "fp32": 16.4e12}),
    (r"\bV100\b.*\bPCIe\b", {"fp16": 112e12, "fp32": 14e12}),
    (r"\bV100\b", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"\bRTX 4090\b(?! D)", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
)


def _precision_class(precision: str) -> str | None:
    p = precision.lower()
    if "bf16" in p:
        return "bf16"
    if p in ("16", "16-mixed", "16-true", "fp16", "float16", "half"):
        return "fp16"
    if p == "tf32":
        return "tf32"
    if p in ("32", "32-true", "fp32", "float32"):
        return "fp32"
    return None  # fp64, fp8 (transformer-engine), ...: no entry in the table


def peak_flops_for(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at a precision, from vendor datasheets.

    Args:
        device_name: What `torch.cuda.get_device_name()` returns, e.g. `"NVIDIA H100 80GB HBM3"`.
        precision: A Lightning precision (`"bf16-mixed"`, `"16-mixed"`, `"32-true"`, ...) or one of `"bf16"`,
            `"fp16"`, `"tf32"`, `"fp32"`. `"32-true"` means the fp32 CUDA-core rate; pass `"tf32"` when
            `torch.get_float32_matmul_precision()` is not `"highest"`.

    Returns:
        FLOP/s without structured sparsity, or None for an unknown device or a precision it has no rate for
        (bf16 on V100).
    """
    cls = _precision_class(precision)
    if cls is None:
        return None
    for pattern, peaks in _PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if cls == "tf32" and "tf32" not in peaks:
                return peaks["fp32"]  # pre-Ampere: allow_tf32 has no effect, matmuls run in fp32
            return peaks.get(cls)
    return None


def _local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of storage behind `tensors` that this rank holds, each storage counted once."""
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        for part in dtensors.storages(t):  # a DTensor's shard; the values a wrapper subclass (fp8, NF4) holds
            if part.device.type == "meta":
                continue
            storage = part.untyped_storage()
            # Views (tied weights, flat ZeRO buffers, DDP bucket views) share one storage: count the storage once.
            key = (part.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _degrees(layout: Mapping[str, Any]) -> dict[str, float]:
    out = {f"parallel/{a}": float(layout[a]) for a in MODEL_AXES if isinstance(layout.get(a), int)}
    if isinstance(layout.get("dp_shard"), int) and isinstance(layout.get("dp_replicate"), int):
        out["parallel/dp"] = float(layout["dp_shard"] * layout["dp_replicate"])
    return out


def _input_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0]
    else:
        ids = None
    return ids if isinstance(ids, torch.Tensor) else None


class ParallelismMonitor(Callback):
    """Logs tokens/s, MFU and per-rank memory every `log_every_n_steps` optimizer steps.

    Metrics go through `pl_module.log_dict(on_step=True)` so they also reach `trainer.callback_metrics` and the
    progress bar; every rank logs its own values and the logger (rank 0) writes rank 0's. Lightning turns them
    into float32 tensors, so byte counts above 2**24 are rounded in the logger; `last_metrics` keeps exact values.

    - `perf/tokens_per_s`: global input-id elements per wall second since the last log: elements of the input
      ids on this rank, summed over the micro-batches of each optimizer step (so `B*T*accumulate_grad_batches`),
      times the data-parallel size. Validation time inside the window is excluded.
    - `perf/model_tflops_per_s_per_device` and, when a peak is known, `perf/mfu`: model FLOPs per token is
      `6N + 12*L*H*T` (PaLM, Chowdhery et al. 2022, appendix B), N the active non-embedding parameters of the
      whole model (all except `nn.Embedding` weights, so a head tied to the embedding is not counted, and only
      top_k / n_experts of each MoE layer's experts; the same under every layout), L/H/T from the module's
      `n_layers`/`hidden_size`/`seq_len` or the arguments below; without them only `6N` is used.
    - `mem/params_bytes`, `mem/grads_bytes` (measured in `on_before_optimizer_step`, while grads exist),
      `mem/optim_state_bytes`: storage this rank holds (a DTensor's local shard), and their `*_max_rank` over
      ranks; `mem/cuda_max_allocated_bytes` on CUDA.
    - `experts/<layer>/load_max_over_mean`, `experts/<layer>/dropped_fraction` and their worst / mean over layers
      `experts/load_max_over_mean`, `experts/dropped_fraction`: the logged step's tokens per expert over the global
      batch (`lightning_par.callbacks.expert_load`); the counts themselves are kept in `expert_load`.
    - `pipe/bubble` (this rank), `pipe/bubble_mean`, `pipe/bubble_max_rank`, `pipe/step_ms`: under a pipeline, the
      logged step's time inside the schedule's waits on peers over its step time (`callbacks/pipeline_view.py`).
    - `parallel/pp`, `parallel/dp`, `parallel/tp`, `parallel/ep`, `parallel/cp`: the layout's degrees (the axes the
      strategy's `parallel_layout` has).

    Args:
        log_every_n_steps: Optimizer steps between logs; None uses the Trainer's. Values only reach the logger
            on steps where the Trainer logs too, so keep this a multiple of `Trainer(log_every_n_steps=...)`.
        peak_flops: Peak FLOP/s of one device; None looks the CUDA device up with `peak_flops_for`.
        n_layers: Overrides the module's `n_layers` (L of the attention FLOPs term).
        hidden_size: Overrides the module's `hidden_size` (H*Q, the model width, in PaLM's notation).
        seq_len: Overrides the module's `seq_len` (T).
        pictures_every_n_steps: Optimizer steps between pictures (a multiple of the log interval; None: none):
            `pictures/memory_per_rank` (stacked bars of every rank's parameter, gradient and optimizer-state
            bytes), with MoE layers `pictures/expert_load` (layers x experts, load over mean) and under a pipeline
            `pictures/pipeline_timeline` (each rank's F / B / W / wait spans of the step), sent to the loggers that
            take images (W&B, TensorBoard; `lightning_par.callbacks.pictures`).

    Attributes:
        last_metrics: The values of the latest log, exact (not rounded to float32).
        n_params: N of the FLOPs formula, set at `on_train_start`.
        flops_per_token: Training FLOPs per token, forward and backward.
        peak_flops: The per-device peak MFU divides by; None when unknown.
        expert_load: Per MoE layer name, the logged step's ``tokens_per_expert`` and ``dropped_fraction``.
        last_pictures: The latest pictures (RGB arrays) by key, on global rank 0.
    """

    # Reads parameter sizes, never values: ZeRO-1/2's all-gather after the step need not finish before its hooks.
    lightning_par_reads_weights = False

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        n_layers: int | None = None,
        hidden_size: int | None = None,
        seq_len: int | None = None,
        pictures_every_n_steps: int | None = None,
    ) -> None:
        if pictures_every_n_steps is not None and pictures_every_n_steps < 1:
            raise ValueError(f"pictures_every_n_steps={pictures_every_n_steps} must be >= 1, or None for no pictures")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1; pass None to use the Trainer's")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops={peak_flops} must be > 0 FLOP/s per device; pass None to look it up")
        self._every_arg = log_every_n_steps
        self._peak_arg = peak_flops
        self._shape_args = {"n_layers": n_layers, "hidden_size": hidden_size, "seq_len": seq_len}
        self.last_metrics: dict[str, float] = {}
        self.n_params = 0
        self.flops_per_token = 0.0
        self.peak_flops: float | None = None
        self._every = 1
        self._tokens = 0
        self._t0: float | None = None
        self._val_t0: float | None = None
        self._dp_size = 1
        self._seen_step = 0
        self._grads_bytes = 0
        self._warned_batch = False
        self._load: ExpertLoad | None = None
        self.expert_load: dict[str, dict[str, Any]] = {}
        self._degrees: dict[str, float] = {}
        self._pictures_every = pictures_every_n_steps
        self.last_pictures: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # After strategy.setup, so a layout that depends on the device mesh is final.
        layout = getattr(trainer.strategy, "parallel_layout", None)
        if layout is None:
            layout = {"strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size}
        for lg in trainer.loggers:
            lg.log_hyperparams({"parallel": dict(layout)})
        # Set on the Trainer by its logger connector at init, so not a declared attribute that mypy sees.
        trainer_every: int = getattr(trainer, "log_every_n_steps", 1)
        self._every = self._every_arg or max(trainer_every, 1)
        if trainer_every and self._every % trainer_every:
            rank_zero_warn(
                f"ParallelismMonitor(log_every_n_steps={self._every}) is not a multiple of "
                f"Trainer(log_every_n_steps={trainer_every}): most of its values never reach the logger; "
                f"use a multiple of {trainer_every}"
            )

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.n_params = self._count_params(trainer, pl_module)
        shape: list[Any] = [
            arg if arg is not None else getattr(pl_module, k, None) for k, arg in self._shape_args.items()
        ]
        self.flops_per_token = 6.0 * self.n_params
        if all(isinstance(v, int) for v in shape):
            self.flops_per_token += 12.0 * math.prod(shape)  # 12 * L * H * T
        else:
            rank_zero_warn(
                f"ParallelismMonitor found n_layers/hidden_size/seq_len = {shape}: MFU counts only "
                "6N and misses attention FLOPs; set them on the LightningModule or pass them to ParallelismMonitor"
            )
        self.peak_flops = self._peak_arg
        if self.peak_flops is None and pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            precision: str = trainer.precision
            if _precision_class(precision) == "fp32" and torch.get_float32_matmul_precision() != "highest":
                precision = "tf32"
            self.peak_flops = peak_flops_for(name, precision)
        if self.peak_flops is None:
            rank_zero_info(
                f"ParallelismMonitor: no peak FLOP/s for {pl_module.device.type} at precision {trainer.precision!r}; "
                "logging perf/model_tflops_per_s_per_device without perf/mfu. Pass peak_flops= to get MFU"
            )
        # Tensor- and pipeline-parallel ranks of one replica see the same batch: only dp multiplies tokens.
        self._dp_size = getattr(trainer.strategy, "dp_size", None) or trainer.world_size
        self._seen_step = trainer.global_step  # a resumed run starts at its checkpoint's step
        self._degrees = _degrees(getattr(trainer.strategy, "parallel_layout", None) or {})
        if self._load is not None:
            self._load.remove()
        group = getattr(trainer.strategy, "token_group", None)
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        load = ExpertLoad(pl_module, group, getattr(trainer.strategy, "moe_layers", None))
        found = len(load.layers)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A pipeline stage may hold no MoE layer while others do; `collect` is collective, so all ranks agree.
            flag = torch.tensor([found], dtype=torch.int64, device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found = int(flag.item())
        self._load = load if found else None
        self._tokens, self._t0 = 0, None

    @staticmethod
    def _count_params(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
        given = getattr(trainer.strategy, "global_param_count", None)
        if isinstance(given, int):
            return given
        # DTensor.numel() is the global count, so sharded DTensor parameters need no all-reduce here.
        return active_param_count(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            self._t0 = perf_counter()

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_t0 = perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._t0 is not None and self._val_t0 is not None:
            self._t0 += perf_counter() - self._val_t0  # keep validation out of the training throughput window
        self._val_t0 = None

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        # Costs one Python pass over the parameters per step; grads may be freed (set to None) after the step. The
        # optimizer's parameters too: under ZeRO-1/2 (and tp at ZeRO-0) the reduced gradients are on the tensors it
        # steps (shards, views), not on the model's.
        stepped = (q for group in optimizer.param_groups for q in group["params"])
        self._grads_bytes = _local_bytes(p.grad for p in itertools.chain(pl_module.parameters(), stepped))

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ids = _input_ids(batch)
        if ids is None and not self._warned_batch:
            self._warned_batch = True
            rank_zero_warn(
                f"ParallelismMonitor cannot find input ids in a batch of type {type(batch).__name__}; "
                "yield a tensor, an (input_ids, labels) tuple or a dict with 'input_ids' to get perf/ metrics"
            )
        self._tokens += (ids.numel() if ids is not None else 0) * self._dp_size
        if trainer.global_step == self._seen_step:
            return  # a micro-batch of an accumulation window: no optimizer step yet
        self._seen_step = trainer.global_step
        if trainer.global_step % self._every:
            if self._load is not None:
                self._load.reset()
            return
        metrics = self._perf(trainer, pl_module) if ids is not None else {}
        metrics.update(self._memory(trainer, pl_module))
        if (record := step_record(trainer)) is not None:
            metrics.update(bubble_metrics(record, trainer.strategy.root_device))
        if self._load is not None:
            self.expert_load = self._load.collect(trainer.strategy.root_device)
            metrics.update(load_metrics(self.expert_load))
        metrics.update(self._degrees)
        if self._pictures_every and trainer.global_step % self._pictures_every == 0:
            self._pictures(trainer, metrics)
        self.last_metrics = metrics
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    def _perf(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, float]:
        if pl_module.device.type == "cuda":
            # One host-device sync per logged step; without it the clock stops before queued kernels finish.
            torch.cuda.synchronize(pl_module.device)
        now = perf_counter()
        assert self._t0 is not None  # set in on_train_batch_start
        tokens_per_s = self._tokens / max(now - self._t0, 1e-9)
        self._tokens, self._t0 = 0, now
        flops_per_device = self.flops_per_token * tokens_per_s / trainer.world_size
        out = {"perf/tokens_per_s": tokens_per_s, "perf/model_tflops_per_s_per_device": flops_per_device / 1e12}
        if self.peak_flops is not None:
            out["perf/mfu"] = flops_per_device / self.peak_flops
        return out

    def _pictures(self, trainer: "pl.Trainer", metrics: Mapping[str, float]) -> None:
        mine = [int(metrics[f"mem/{kind}_bytes"]) for kind in MEMORY_KINDS]
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank, same step
            local = torch.tensor(mine, dtype=torch.int64, device=trainer.strategy.root_device)
            every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(every, local)
            rows = [t.tolist() for t in every]
        record = step_record(trainer)
        timelines = gather_records(record) if record is not None else None  # every rank: a collective
        if not trainer.is_global_zero:
            return
        pictures = {"pictures/memory_per_rank": memory_bars(rows)}
        if timelines is not None:
            pictures["pictures/pipeline_timeline"] = pipeline_timeline(timelines)
        if self.expert_load:
            loads = {k: v["tokens_per_expert"] for k, v in self.expert_load.items()}
            pictures["pictures/expert_load"] = load_heatmap(loads)
        self.last_pictures = pictures
        # Lightning logs the metrics of this optimizer step at the count of steps before it (its loop increments
        # after on_train_batch_end): the pictures go to the same x.
        log_pictures(trainer.loggers, pictures, trainer.global_step - 1)

    def _memory(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, float]:
        states = (v for opt in trainer.optimizers for s in opt.state.values() for v in s.values())
        local = {
            "mem/params_bytes": _local_bytes(pl_module.parameters()),
            "mem/grads_bytes": self._grads_bytes,
            "mem/optim_state_bytes": _local_bytes(v for v in states if isinstance(v, torch.Tensor)),
        }
        most = list(local.values())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank reaches this line at the same step. NCCL rejects CPU tensors, so use the root device.
            peak = torch.tensor(most, dtype=torch.int64, device=trainer.strategy.root_device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            most = peak.tolist()
        out = {k: float(v) for k, v in local.items()}
        out.update({f"{k}_max_rank": float(v) for k, v in zip(local, most)})
        if pl_module.device.type == "cuda":
            out["mem/cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
        return out
