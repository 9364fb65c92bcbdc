"""A layout the planner prices: the parallel degrees and techniques of one training job, with the checks that it
divides the model and the world. Pure data: no process group.

The names follow `lightning_par.config.ParallelConfig` where the two meet (``tp``, ``pp``, ``dp_replicate``,
``dp_shard``, ``ep``, ``cp``, ``zero_stage``, ``pp_schedule``, ``microbatches``, ``sequence_parallel``,
``offload``) so that `Layout.strategy_kwargs` turns a chosen layout into the arguments of
`lightning_par.ParallelStrategy`. Recomputation uses the paper's vocabulary (Korthikanti et al., arXiv 2205.05198):
``"none"``, ``"selective"`` (recompute the attention core and the cheap element-wise work, keep the matmul
outputs; the suite's ``activation_checkpointing="selective_op"``) and ``"full"`` (keep each block's input only);
``"offload"`` is the suite's activation offload (what a block saves goes to host memory: `offload_blocks` of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lightning_par import axes
from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.planner.model import ModelDesc

RECOMPUTE = ("none", "selective", "full", "offload")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
# Pipeline schedules and the virtual stages per rank each runs in this suite (parallel/pipeline/schedule.py).
SCHEDULES = {name: s.virtual for name, s in axes.SCHEDULES.items()}


def compute_bytes(precision: str) -> int:
    """Bytes per element of activations and matmul operands under a Lightning precision flag."""
    return 4 if precision == "32-true" else 1 if precision == "fp8" else 2  # "fp8": an fp8 GEMM's operands


def stored_bytes(precision: str) -> int:
    """Bytes per element of a stored parameter, its gradient and moments in this suite: fp32 under every flag but
    ``"bf16-true"`` (mixed precision casts low-precision copies for compute, it keeps no second master)."""
    return 2 if precision == "bf16-true" else 4


_TO_SUITE_AC = {"none": None, "selective": "selective_op", "full": "full", "offload": "offload"}


class LayoutError(ValueError):
    """A layout that cannot run the model on the world; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Degrees and techniques of one job.

    Args:
        tp: tensor-parallel degree.
        pp: pipeline stages over ranks; ``vpp``: model chunks per pipeline rank (interleaved schedules).
        dp_replicate: data-parallel replicas (the outer, cross-node level of hybrid sharding).
        dp_shard: data-parallel ranks that shard the state under ``zero_stage`` (inner level).
        zero_stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        ep: expert-parallel degree, carved out of the data-parallel ranks (as in the suite).
        cp: context-parallel degree (the sequence split over ``cp`` ranks).
        pp_schedule: a name of `SCHEDULES`; ``microbatches``: per optimizer step and pipeline (``None``: the
            whole data-parallel batch share in micro-batches of ``micro_batch_size``). ``"2bw"`` (PipeDream-2BW,
            arXiv 2006.09503: weights updated one step late) needs ``pp >= 2``, and ``microbatches >= pp`` as
            every pipeline does; `lightning_par.planner.search` never proposes it.
        micro_batch_size: samples per micro-batch on one data-parallel rank.
        recompute: ``"none"``, ``"selective"``, ``"full"`` or ``"offload"`` (activation offload).
        offload_blocks: under ``recompute="offload"``, the trunk's first N blocks offloaded (``None``: every block).
        sequence_parallel: split the residual stream over tp between the tensor-parallel regions.
        offload: parameters and optimizer state in CPU memory between uses (zero_stage 3).
        precision: one of `PRECISIONS`.
        powersgd_rank: ``0``: gradients reduced exactly; ``r``: PowerSGD at rank r (ZeRO 0-1 over dp_shard, with or
            without a pipeline, `lightning_par.parallel.compression`), priced once compression runs (after its exact
            start): the all-reduce carries ``(n + m) r`` elements per compressed ``n x m`` gradient, and each rank
            keeps its error (a full gradient) and the P, Q factors.
        zero_quantized_weights: ZeRO-3 all-gathers each unit's weights as int8 codes with a scale per 256 elements
            (`lightning_par.parallel.compression.quantized`).
        fp8: the trunk's linear layers multiply in fp8 (`lightning_par.parallel.fp8`; the parameters marked
            `ParamSpec.fp8`): ZeRO-3 gathers their weights at one byte per element, their GEMMs run at the
            device's fp8 rate, and each cast costs its bytes (`lightning_par.planner.fp8`).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    ep: int = 1
    cp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: Optional[int] = None
    micro_batch_size: int = 1
    recompute: str = "none"
    offload_blocks: Optional[int] = None
    sequence_parallel: bool = False
    offload: bool = False
    precision: str = "bf16-mixed"
    powersgd_rank: int = 0
    zero_quantized_weights: bool = False
    fp8: bool = False

    def __post_init__(self) -> None:
        for name in (*axes.AXIS_NAMES, "vpp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if self.powersgd_rank < 0:
            raise LayoutError(f"powersgd_rank={self.powersgd_rank} must be 0 (exact) or a rank >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        if self.precision not in PRECISIONS:
            raise LayoutError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if self.pp_schedule not in SCHEDULES:
            raise LayoutError(f"pp_schedule={self.pp_schedule!r} is not one of {sorted(SCHEDULES)}")
        if self.pp == 1 and axes.SCHEDULES[self.pp_schedule].asynchronous:  # as the suite (ParallelConfig) refuses it
            raise LayoutError(
                f"pp_schedule={self.pp_schedule!r} is a pipeline schedule (its steps overlap across pipeline stages); "
                "set pp >= 2 or use the default pp_schedule='1f1b'"
            )
        if self.pp > 1 and self.vpp > 1 and SCHEDULES[self.pp_schedule] == 1:
            raise LayoutError(f"vpp={self.vpp} needs an interleaved schedule, not {self.pp_schedule!r}")
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} is carved out of the data-parallel ranks, so it must divide dp={self.dp}")
        if self.offload and self.zero_stage != 3:
            raise LayoutError("offload=True needs zero_stage=3 (the sharded state is what moves to CPU memory)")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel=True needs tp > 1 (it splits the residual stream over tp)")
        if self.offload_blocks is not None and (self.recompute != "offload" or self.offload_blocks < 1):
            raise LayoutError(f"offload_blocks={self.offload_blocks} needs recompute='offload' and a count >= 1")
        if self.fp8 and self.zero_quantized_weights:
            raise LayoutError("fp8=True and zero_quantized_weights=True both replace ZeRO-3's gather; choose one")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks the layout uses."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks the ZeRO state is split over (1 under ZeRO-0)."""
        return self.dp_shard if self.zero_stage else 1

    def m(self, global_batch: int) -> int:
        """Micro-batches per optimizer step on one data-parallel rank (pipeline microbatches or accumulation)."""
        if self.microbatches is not None:
            return self.microbatches
        return global_batch // (self.dp * self.micro_batch_size)

    def check(self, model: ModelDesc, world: int, global_batch: int, seq_len: int, suite: bool = True) -> None:
        """Raise `LayoutError` naming the fix when this layout cannot run ``model`` on ``world`` ranks.

        Args:
            suite: also require that this suite runs it: `lightning_par.config.ParallelConfig` accepts its
                arguments for ``world`` ranks (``False`` for layouts of other frameworks, e.g. published
                Megatron-LM runs with 3 interleaved chunks per rank).
        """
        if suite:
            self._check_suite(world)
        if self.world != world:
            raise LayoutError(
                f"tp x pp x cp x dp = {self.tp} x {self.pp} x {self.cp} x {self.dp} = {self.world} ranks, but the "
                f"world has {world}; change a degree so that the product is {world}"
            )
        if model.heads % self.tp or (model.kv_heads % self.tp and self.tp % model.kv_heads):
            # Fewer key/value heads than tp: each replicated over tp / kv_heads ranks (parallel/tensor/kv_heads.py).
            raise LayoutError(
                f"tp={self.tp} must divide the {model.heads} query heads, and divide or be a multiple of the "
                f"{model.kv_heads} key/value heads; pick tp among the divisors of the query head count that divide "
                "or are multiples of the key/value head count"
            )
        if model.learned_positions and seq_len > model.learned_positions:
            raise LayoutError(
                f"seq_len={seq_len} is longer than the model's {model.learned_positions} learned positions; lower "
                "the sequence length (or give the model a longer position table)"
            )
        if model.experts and model.experts % self.ep:
            raise LayoutError(f"ep={self.ep} must divide the {model.experts} experts")
        chunks = self.pp * self.vpp
        if model.layers < chunks:
            raise LayoutError(f"{model.layers} blocks cannot fill pp x vpp = {chunks} stages; lower pp or vpp")
        if seq_len % (self.cp * (2 if self.cp > 1 else 1)) or (self.sequence_parallel and seq_len % self.tp):
            raise LayoutError(
                f"seq_len={seq_len} must divide by 2 x cp = {2 * self.cp} (load-balanced chunks) and, under "
                f"sequence parallelism, by tp={self.tp}"
            )
        per_rank = global_batch // self.dp if global_batch % self.dp == 0 else 0
        if not per_rank or per_rank % self.micro_batch_size:
            raise LayoutError(
                f"global batch {global_batch} must split into dp={self.dp} ranks x micro-batches of "
                f"{self.micro_batch_size}; pick a global batch that is a multiple of {self.dp * self.micro_batch_size}"
            )
        if self.pp > 1 and self.m(global_batch) < self.pp:
            raise LayoutError(
                f"{self.m(global_batch)} microbatches cannot fill {self.pp} pipeline stages; raise the global batch or "
                "lower micro_batch_size or pp"
            )

    def _check_suite(self, world: int) -> None:
        looped = SCHEDULES[self.pp_schedule] > 1 and self.pp_schedule not in ("zbv", "dualpipev")
        if self.pp > 1 and self.vpp != SCHEDULES[self.pp_schedule] and not (looped and self.vpp > 1):
            raise LayoutError(
                f"this suite runs {SCHEDULES[self.pp_schedule]} stage(s) per rank under {self.pp_schedule!r}, not "
                f"vpp={self.vpp}; use --vpp {SCHEDULES[self.pp_schedule]} or another schedule"
            )
        try:
            ParallelConfig(**self.strategy_kwargs()).resolve(world)
        except ParallelConfigError as err:
            raise LayoutError(str(err)) from err

    def describe(self) -> str:
        """A short name, e.g. ``tp=8 pp=8 vpp=3 dp=1 zero=1 sp sel``."""
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"vpp={self.vpp}"] if self.vpp > 1 else []
        parts += [f"dp={self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp={self.dp}"]
        parts += [f"zero={self.zero_stage}"] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [self.pp_schedule] if self.pp > 1 else []
        parts += [f"mbs={self.micro_batch_size}"] + (["sp"] if self.sequence_parallel else [])
        parts += [f"recompute={self.recompute}"] if self.recompute != "none" else []
        parts += [f"offload_blocks={self.offload_blocks}"] if self.offload_blocks else []
        parts += ["offload"] if self.offload else []
        parts += [f"powersgd={self.powersgd_rank}"] if self.powersgd_rank else []
        parts += ["int8-gather"] if self.zero_quantized_weights else []
        parts += ["fp8"] if self.fp8 else []
        return " ".join(parts)

    def strategy_kwargs(self) -> dict[str, Any]:
        """The `lightning_par.ParallelStrategy` arguments that run this layout."""
        kwargs: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
            "ep": self.ep, "cp": self.cp, "zero_stage": self.zero_stage,
        }  # fmt: skip
        if self.pp > 1:
            kwargs.update(pp_schedule=self.pp_schedule, microbatches=self.microbatches)
            if self.vpp > SCHEDULES[self.pp_schedule] > 1 or 1 < self.vpp < SCHEDULES[self.pp_schedule]:
                kwargs["vpp"] = self.vpp  # another number of stages per rank than the schedule's own
        if self.recompute != "none":
            kwargs["activation_checkpointing"] = _TO_SUITE_AC[self.recompute]
            kwargs["offload_blocks"] = self.offload_blocks
        if self.tp > 1:
            kwargs["sequence_parallel"] = self.sequence_parallel
        if self.offload:
            kwargs["offload"] = True
        if self.powersgd_rank:
            kwargs.update(grad_compression="powersgd", compression_rank=self.powersgd_rank)
        if self.zero_quantized_weights:
            kwargs["zero_quantized_weights"] = True
        if self.fp8:
            kwargs["fp8"] = True
        return {k: v for k, v in kwargs.items() if v is not None}
