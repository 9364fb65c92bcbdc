"""Typed, validated configuration of a parallel layout.

Validation happens here, once per path, before any process-group work (docs/design.md, "Layers"). Every error
names the bad value and the fix. Static checks, the combinations not implemented among them, run once in
``ParallelConfig.__post_init__``; `ParallelConfig.resolve` is the one function that turns a request (explicit
degrees, or the dimensions a registered name splits the world over) plus the world size and devices per node into
a complete layout, with the checks that need those numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Literal, Optional, Union

from lightning_par.axes import AXIS_NAMES, MODEL_AXES, SCHEDULES, choices, split_world
from lightning_par.config_checks import ParallelConfigError, TechniqueChecks

AXES = AXIS_NAMES  # lightning_par.axes defines them, with their properties
ZERO_STAGES = (0, 1, 2, 3)
AC_MODES = (None, "full", "selective", "selective_op", "offload")
PP_SCHEDULES = tuple(SCHEDULES)
# The dimensions a registered name can leave to `resolve` (docs/strategies.md, "Names and the degree rule").
AUTO_DIMS = (*MODEL_AXES, "dp")
CP_MODES = ("allgather", "ulysses")  # and why not "ring" (torch's): docs/context_parallel.md, "Modes"

AUTO = -1  # a degree left for `resolve` to fill from the world size

ACMode = Optional[Literal["full", "selective", "selective_op", "offload"]]


@dataclasses.dataclass
class ParallelConfig(TechniqueChecks):
    """Degrees of every mesh axis plus the techniques applied along them.

    Args:
        pp: pipeline-parallel degree (stages).
        dp_replicate: data-parallel replicas that each hold a full copy of the (dp_shard-)sharded state (the
            outer level of hybrid sharding).
        dp_shard: data-parallel ranks that shard the state (ZeRO). ``-1`` means "whatever the world size leaves".
        ep: expert-parallel degree, carved out of the data-parallel ranks (it does not multiply the world size).
        tp: tensor-parallel degree (innermost axis).
        etp: expert tensor parallelism under tp x ep: ``1`` (default): each tp rank computes ``1/tp`` of an MoE
            layer's tokens on whole experts; ``tp``: each expert's hidden width is split over tp, every token
            computed on every tp rank's slice (`lightning_par.parallel.experts.with_tp`).
        cp: context-parallel degree: each sequence is split over ``cp`` ranks inside the trunk
            (docs/context_parallel.md); they read the same samples, and gradients average over dp x cp.
        cp_mode: how attention sees the whole sequence under ``cp > 1``: ``"allgather"`` (keys and values
            gathered over cp, local queries against all of them; any head count) or ``"ulysses"`` (an all-to-all
            gives each rank every position of ``1/cp`` of the heads; less traffic from cp 3 up with as many key /
            value heads as query heads, but the heads must divide by cp). docs/context_parallel.md, "Modes".
        cp_uneven: accept sequence lengths that are not multiples of ``2 * cp`` (chunks then differ by one
            token); ``False`` refuses them at the first batch, so that a layout is never silently unbalanced.
        zero_stage: 0 replicates everything (DDP), 1 shards optimizer state, 2 also gradients, 3 also parameters.
        offload: keep sharded parameters and optimizer state in CPU memory between uses (needs ``zero_stage=3``).
        activation_checkpointing: ``None``, ``"full"`` (recompute every block), ``"selective"`` (every
            ``ac_every``-th block), ``"selective_op"`` (every block, but keep matmul and attention outputs) or
            ``"offload"`` (keep every block's saved activations in CPU memory); see
            `lightning_par.parallel.activation_checkpointing`.
        ac_every: the period of ``"selective"`` checkpointing; other modes reject a value other than 2.
        offload_blocks: under ``activation_checkpointing="offload"``, offload the saved tensors of the trunk's first
            ``offload_blocks`` blocks only (Megatron-LM's ``cpu_offloading_num_layers``); ``None``: every block.
        sequence_parallel: split the residual stream (norms, dropout, residual adds) along the sequence between
            tensor-parallel regions; ``None`` (default): wherever it is exact for the model, ``True``: required.
        pp_schedule: pipeline schedule name (`lightning_par.parallel.pipeline.schedule.SCHEDULES`).
        microbatches: pipeline microbatches per step (``None``: ``2 * pp``).
        pp_split: trunk blocks per pipeline stage, by hand (``pp`` counts, ``2 * pp`` for the interleaved and V
            schedules); ``None`` balances the stages by ``pp_costs``.
        pp_costs: one cost per trunk block for the automatic split (e.g. from
            `lightning_par.parallel.pipeline.partition.measure_block_times`); ``None``: parameter counts.
        bucket_cap_mb: size of a gradient/parameter communication bucket for ZeRO stages 0-2.
        compile: `torch.compile` each trunk block (after activation checkpointing and tensor parallelism, before
            FSDP2; `lightning_par.parallel.compile`): the code outside the trunk and ``training_step`` stay eager,
            parameter names do not change. Costs compile time at the first step (and after a shape change).
        global_batch: samples per optimizer step over all data-parallel ranks; the strategy sets the Trainer's
            gradient accumulation to ``global_batch / (per-rank batch x data-parallel size)`` when the training
            loader is set up, so a restart on fewer or more ranks (elastic) trains on the same global batch; a size
            that does not divide is refused, naming the fix. ``None``: the Trainer's ``accumulate_grad_batches``.
        sync_every: local SGD / DiLoCo (`lightning_par.parallel.local_sgd.outer`): the ``dp_replicate`` replicas train
            apart (gradients reduced inside each, over ``dp_shard``) and synchronise every ``sync_every`` optimizer
            steps with an outer SGD step; ``None`` (default): gradients are reduced over every data-parallel rank
            at every step.
        outer_lr, outer_momentum: the outer SGD's learning rate and (Nesterov) momentum; DiLoCo's 0.7 and 0.9.
        grad_compression: ``None`` (exact) or ``"powersgd"``: the data-parallel gradient all-reduce of ZeRO 0-1
            approximates each gradient matrix at rank ``compression_rank`` with error feedback, after
            ``compression_start`` exact steps (`lightning_par.parallel.compression`; docs/strategies.md).
        compression_rank, compression_start: PowerSGD's approximation rank and exact start (torch's
            ``matrix_approximation_rank`` and ``start_powerSGD_iter``).
        zero_quantized_weights: ZeRO-3 all-gathers the weights as int8 codes with a scale per 256 elements, as
            ZeRO++ does (`lightning_par.parallel.compression.quantized`): about a quarter of fp32's bytes; what the
            forward and backward compute with is quantized, the shards, gradients and optimizer are not. With or
            without a pipeline and offload; not with tp, cp or ep.
        vpp: stages per pipeline rank under a looped interleaved schedule (``interleaved_1f1b``, ``looped_bfs``,
            ``interleaved_zb``; Megatron's virtual pipeline size): ``None`` is their 2; up to the blocks per rank.
        fp8: ``True``: the trunk's linear layers train in fp8 with tensor-wise dynamic scaling (torchao's float8
            recipe; under ZeRO-3 their weights are all-gathered in fp8): CUDA devices of compute capability >= 8.9;
            ``"emulate"``: the same casts, multiplied in the training precision (any device, to check numerics);
            ``False``: off. `lightning_par.parallel.fp8`; docs/strategies.md, "fp8 training".
        trunk: the qualified name of the container of the model's repeated blocks (``"model.layers"``), where
            `lightning_par.blocks.find_trunk` picks another or none; every layout then uses its blocks.
        auto_dims: for registered names: the dimensions (``"pp"``, ``"tp"``, ``"cp"``, ``"dp"``, ``"ep"``) whose
            degrees `resolve` splits from the world size (`split_world`; ``"ep"``: every data-parallel rank).
            ``None``: the explicit degrees are used as given.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = AUTO
    ep: int = 1
    tp: int = 1
    etp: int = 1
    cp: int = 1
    cp_mode: str = "allgather"
    cp_uneven: bool = False
    zero_stage: int = 0
    offload: bool = False
    activation_checkpointing: ACMode = None
    ac_every: int = 2
    offload_blocks: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    pp_schedule: str = "1f1b"
    microbatches: Optional[int] = None
    bucket_cap_mb: float = 25.0
    pp_split: Optional[tuple[int, ...]] = None
    pp_costs: Optional[tuple[float, ...]] = None
    compile: bool = False
    auto_dims: Optional[tuple[str, ...]] = None
    global_batch: Optional[int] = None
    sync_every: Optional[int] = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    grad_compression: Optional[str] = None
    compression_rank: int = 1
    compression_start: int = 1000
    zero_quantized_weights: bool = False
    trunk: Optional[str] = None
    vpp: Optional[int] = None
    fp8: Union[bool, str] = False

    def __post_init__(self) -> None:
        if self.trunk is not None and (not isinstance(self.trunk, str) or not self.trunk):
            raise ParallelConfigError(f"trunk={self.trunk!r} must be a module's qualified name, e.g. 'model.layers'")
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelConfigError(f"{axis}={value!r} must be an int; pass e.g. {axis}=2")
            if value < 1 and not (axis == "dp_shard" and value == AUTO):
                hint = " or -1 (fill from the world size)" if axis == "dp_shard" else ""
                raise ParallelConfigError(f"{axis}={value} must be a positive int{hint}")
        if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1:
            raise ParallelConfigError(f"etp={self.etp!r} must be a positive int: 1 (split tokens) or the tp degree")
        if self.etp > 1 and not (self.uses("ep") and self.uses("tp")):
            raise ParallelConfigError(
                f"etp={self.etp} splits experts over tensor parallelism, so it needs ep > 1 and tp > 1 (got "
                f"{self._degree('ep')}, {self._degree('tp')}); use e.g. ParallelStrategy(tp=2, ep=2, etp=2), or etp=1"
            )
        if self.etp > 1 and "tp" not in (self.auto_dims or ()) and self.etp != self.tp:
            raise ParallelConfigError(
                f"etp={self.etp} must be 1 or equal tp={self.tp} (experts are split over the whole tp group); set "
                f"etp={self.tp} or etp=1"
            )
        if self.cp_mode not in CP_MODES:
            raise ParallelConfigError(
                f"cp_mode={self.cp_mode!r} is not implemented; choose one of {CP_MODES} (docs/context_parallel.md)"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise ParallelConfigError(
                f"zero_stage={self.zero_stage!r} does not exist; choose one of {ZERO_STAGES} "
                "(1: optimizer state, 2: + gradients, 3: + parameters sharded)"
            )
        if self.offload and self.zero_stage != 3:
            raise ParallelConfigError(
                f"offload=True needs zero_stage=3 (got {self.zero_stage}): only fully sharded parameters and "
                "optimizer state are moved to CPU; use strategy='zero3_offload'"
            )
        if isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing not in AC_MODES:
            raise ParallelConfigError(
                f"activation_checkpointing={self.activation_checkpointing!r} is unknown; choose None, 'full' "
                "(recompute every block), 'selective' (every ac_every-th block), 'selective_op' (keep matmul and "
                "attention outputs, recompute the rest) or 'offload' (saved activations in CPU memory)"
            )
        if not isinstance(self.ac_every, int) or isinstance(self.ac_every, bool) or self.ac_every < 1:
            raise ParallelConfigError(f"ac_every={self.ac_every!r} must be an int >= 1 (checkpoint every k-th block)")
        if self.ac_every != 2 and self.activation_checkpointing != "selective":
            # 2 is the default, so only a value someone chose is caught: it would otherwise be silently ignored.
            raise ParallelConfigError(
                f"ac_every={self.ac_every} only applies to activation_checkpointing='selective' (got "
                f"{self.activation_checkpointing!r}); use activation_checkpointing='selective' or drop ac_every"
            )
        if self.offload_blocks is not None and (self.activation_checkpointing != "offload" or not isinstance(
                self.offload_blocks, int) or isinstance(self.offload_blocks, bool) or self.offload_blocks < 1):
            raise ParallelConfigError(
                f"offload_blocks={self.offload_blocks!r} offloads the first N trunk blocks' activations: an int >= 1 "
                f"with activation_checkpointing='offload' (got {self.activation_checkpointing!r}); or drop it"
            )
        if not isinstance(self.compile, bool):
            raise ParallelConfigError(f"compile={self.compile!r} must be True (compile each trunk block) or False")
        if self.sequence_parallel not in (None, True, False):
            raise ParallelConfigError(
                f"sequence_parallel={self.sequence_parallel!r} must be None (wherever exact), True or False"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ParallelConfigError(f"pp_schedule={self.pp_schedule!r} is unknown; choose one of {PP_SCHEDULES}")
        self._check_vpp()
        split_backward = SCHEDULES[self.pp_schedule].split_backward  # zero bubble: input, weight gradients apart
        if self.pp > 1 and self.activation_checkpointing == "selective_op" and split_backward:
            raise ParallelConfigError(
                f"activation_checkpointing='selective_op' cannot run under pp_schedule={self.pp_schedule!r}: "
                "zero-bubble schedules differentiate each block twice (input, then weight gradients) and torch's "
                "selective checkpointing allows one backward; use activation_checkpointing='full' or a schedule "
                "without a split backward ('1f1b', 'interleaved_1f1b')"
            )
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ParallelConfigError(f"microbatches={self.microbatches!r} must be a positive int or None")
        if self.pp_split is not None:
            self.pp_split = tuple(self.pp_split)
            if not self.pp_split or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.pp_split):
                raise ParallelConfigError(
                    f"pp_split={self.pp_split!r} must be positive block counts, one per pipeline stage, e.g. (3, 3)"
                )
        if self.pp_costs is not None:
            self.pp_costs = tuple(float(c) for c in self.pp_costs)
            if any(not c >= 0 for c in self.pp_costs):
                raise ParallelConfigError(f"pp_costs={self.pp_costs!r} must be >= 0, one per trunk block")
        if not self.bucket_cap_mb > 0:
            raise ParallelConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be > 0 (25 is a good default)")
        if self.pp > 1 and self.microbatches is not None and self.microbatches < self.pp:
            raise ParallelConfigError(
                f"microbatches={self.microbatches} < pp={self.pp} leaves stages idle; use microbatches >= {self.pp}"
            )
        if self.auto_dims is not None:
            self.auto_dims = tuple(self.auto_dims)
            unknown = [d for d in self.auto_dims if d not in AUTO_DIMS]
            if unknown:
                raise ParallelConfigError(f"auto_dims={self.auto_dims!r}: {unknown} unknown; choose from {AUTO_DIMS}")
        if self.global_batch is not None and (not isinstance(self.global_batch, int) or self.global_batch < 1):
            raise ParallelConfigError(f"global_batch={self.global_batch!r} must be an int >= 1 (samples per step)")
        self._check_local_sgd()
        self._check_compression()
        self._check_fp8()
        self._check_two_bw()
        self.check_supported()

    def _check_vpp(self) -> None:
        if self.vpp is None:
            return
        schedule = SCHEDULES[self.pp_schedule]
        looped = [n for n, s in SCHEDULES.items() if s.virtual > 1 and s.style == "loop"]
        if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 2 or schedule.virtual == 1 \
                or schedule.style != "loop":  # fmt: skip
            raise ParallelConfigError(
                f"vpp={self.vpp!r} sets the stages per rank of a looped interleaved schedule ({', '.join(looped)}): an "
                f"int >= 2 with one of them (pp_schedule={self.pp_schedule!r} runs {schedule.virtual}); drop vpp"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size (replicate x shard); only meaningful after `resolve`."""
        return self.dp_replicate * self.dp_shard

    def resolve(self, world_size: int, devices_per_node: Optional[int] = None) -> ParallelConfig:
        """The complete layout for a job: every degree filled in and checked against the world size.

        The one place a layout is resolved (the strategy calls it once, when the processes exist). A registered
        name's dimensions (``auto_dims``) are split from the world size by `split_world`, tp never past what one
        node holds; ``dp_shard=-1`` takes what the other degrees leave; a ``moe`` name's ``ep`` becomes every
        data-parallel rank. The static checks of ``__post_init__`` are not run again.

        Args:
            world_size: number of processes in the job.
            devices_per_node: processes per node; a tensor-parallel group must not span nodes, so ``tp`` must
                divide it.
        """
        if world_size < 1:
            raise ParallelConfigError(f"world_size={world_size} must be >= 1")
        pp, tp, cp, dp_shard, ep = self.pp, self.tp, self.cp, self.dp_shard, self.ep
        if self.auto_dims is not None:
            degrees = split_world(self.auto_dims, world_size, tp_cap=devices_per_node)
            pp, tp, cp, dp_shard = degrees["pp"], degrees["tp"], degrees.get("cp", 1), AUTO
            for dim, axis in (("tp", "tp"), ("cp", "cp"), ("pp", "pp")):
                if dim in self.auto_dims and degrees.get(axis, 1) == 1:
                    # Silently training as plain data parallelism would hide that the name did nothing.
                    warnings.warn(
                        f"the strategy name asks for {dim}, but world size {world_size}"
                        + (f" ({devices_per_node} devices per node)" if devices_per_node else "")
                        + f" gives {dim}=1, so that dimension is off: degrees are split in powers of two"
                        + (" that divide the devices per node" if dim == "tp" else "")
                        + "; run on 2, 4 or 8 devices (per node for tp), or pass explicit degrees",
                        stacklevel=2,
                    )
        fixed = pp * self.dp_replicate * cp * tp
        if dp_shard == AUTO:
            if world_size % fixed:
                raise ParallelConfigError(
                    f"pp={pp} x dp_replicate={self.dp_replicate} x cp={cp} x tp={tp} = {fixed} does not divide the "
                    f"world size "
                    f"{world_size}; choose degrees whose product divides {world_size}"
                )
            dp_shard = world_size // fixed
        total = fixed * dp_shard
        if total != world_size:
            raise ParallelConfigError(
                f"pp={pp} x dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x cp={cp} x tp={tp} = {total} "
                f"but the world size is {world_size}; set dp_shard=-1 to fill it, or change devices/num_nodes"
            )
        dp = self.dp_replicate * dp_shard
        if self.etp not in (1, tp):
            raise ParallelConfigError(f"etp={self.etp} must be 1 or equal tp={tp} here; set etp={tp} or etp=1")
        if "ep" in (self.auto_dims or ()):
            ep = dp
            if ep == 1 and world_size > 1:
                warnings.warn(
                    f"the strategy name asks for moe, but world size {world_size} leaves one data-parallel rank, so "
                    "ep=1: every rank holds every expert; run on more devices, or pass explicit degrees (tp, ep)",
                    stacklevel=2,
                )
        if dp % ep:
            raise ParallelConfigError(
                f"ep={ep} does not divide the data-parallel size {dp}; choose ep in {choices(dp)}"
            )
        if devices_per_node is not None and tp > devices_per_node:
            raise ParallelConfigError(
                f"tp={tp} spans nodes ({devices_per_node} devices per node); choose tp in {choices(devices_per_node)}"
            )
        if devices_per_node is not None and devices_per_node % tp:
            raise ParallelConfigError(
                f"tp={tp} does not divide the {devices_per_node} devices per node, so some tensor-parallel groups "
                f"would straddle two nodes; choose tp in {choices(devices_per_node)}"
            )
        if self.zero_stage == 0 and self.dp_shard not in (AUTO, 1) and dp_shard > 1 and self.dp_replicate > 1:
            raise ParallelConfigError(
                "hybrid sharding (dp_replicate > 1 and dp_shard > 1) needs zero_stage >= 1; with zero_stage=0 "
                "every data-parallel rank is a replica: set dp_replicate=1"
            )
        resolved = copy.copy(self)  # not dataclasses.replace: that would run __post_init__'s checks again
        resolved.pp, resolved.tp, resolved.cp, resolved.dp_shard, resolved.ep = pp, tp, cp, dp_shard, ep
        return resolved

    def check_supported(self) -> None:
        """Reject settings that contradict the dimensions used, naming the fix.

        Runs in ``__post_init__``, on the degrees given or, for a registered name, on the dimensions it names
        (before the world size is known), so a bad combination fails at construction, before any process starts.
        Every combination of pp, tp, cp, ep and ZeRO composes (docs/compatibility.md, "Combinations").
        """
        return None  # every combination of the axes composes (docs/compatibility.md, "Combinations")

    def describe(self, world_size: int) -> str:
        """The resolved layout in one line, printed at start-up (every mesh axis, then ep and the techniques)."""
        axes = " x ".join(f"{axis} {getattr(self, axis)}" for axis in AXES if axis != "ep")
        cp = f", cp_mode {self.cp_mode}" if self.cp > 1 else ""
        return (
            f"world {world_size} = {axes} (ep {self.ep}); zero_stage {self.zero_stage}, offload {self.offload}, "
            f"activation checkpointing {self.activation_checkpointing}{cp}{', blocks compiled' if self.compile else ''}"
        )

    def layout(self) -> dict[str, Union[int, str, bool, tuple, None]]:
        """The resolved layout as a flat dict, for logs and the logger's config."""
        return dataclasses.asdict(self)
