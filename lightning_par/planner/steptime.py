"""Step time of a layout: compute, communication, pipeline bubble and optimizer, composed with stated overlaps.

Per micro-batch and block on one GPU (`lightning_par.planner.compute` prices each part):

- forward GEMMs ``F`` and element-wise kernels ``E``; the backward costs ``2F + 2E`` (input and weight gradients
  are two GEMMs of the forward's size; each element-wise backward reads the saved input and the incoming gradient
  and writes one gradient); recomputation adds ``F + E`` (full) or the attention core and its element-wise work
  (selective);
- tensor parallelism: two collectives of the residual stream per block in the forward and two in the backward
  (all-reduces, or reduce-scatter + all-gather under sequence parallelism, the same bytes), two more when full
  recomputation repeats the forward, and under sequence parallelism two all-gathers redone in the backward
  (Megatron-LM does not keep the gathered input); not overlapped with compute (neither Megatron-LM in 2022 nor
  this suite overlaps them);
- expert parallelism: an all-to-all before and after the experts, forward and backward; context parallelism: the
  keys and values all-gathered in the forward and their gradients reduce-scattered in the backward.

A pipeline rank runs its blocks (and the embedding or the head) per micro-batch; the step is
``m x T_max + bubble``, the slowest stage paced by its micro-batches plus the schedule's fill and drain, in mean
stage times from the schedule's own action table replayed (`idle_stage_times`): ``p - 1`` for GPipe and 1F1B,
``(p - 1) / v`` for interleaved 1F1B (Narayanan et al., arXiv 2104.04473), what torch's zero-bubble tables leave
(Qi et al., arXiv 2401.10241) with equal input- and weight-gradient times, ``(p - 1) / 3`` for PipeDream-2BW
(Narayanan et al., arXiv 2006.09503: no flush, only the forward chain's ramp). Point-to-point sends between stages go
over the inter-node link when a tensor-parallel group fills a node, are sent once per virtual stage and direction,
and wait in line with compute.

Data-parallel gradient traffic (all-reduce, or reduce-scatter + all-gather under ZeRO, plus ZeRO-3's parameter
all-gathers) overlaps the backward it runs in, up to the device's `Device.comm_overlap`: ZeRO-2 and FSDP2 reduce in
every micro-batch's backward, ZeRO 0 and 1 in the one that ends the accumulation; ZeRO 1/2's all-gather after the
step is exposed, and so is whatever exceeds the compute it overlaps.
The engines also copy: ZeRO 0-2 pack the gradients into buckets and unpack what comes back (four passes over the
local parameter bytes), FSDP2 copies each gathered block out twice (forward and backward) and each gradient in
once (six). The optimizer step streams its state once at memory bandwidth. Under ``offload`` the sharded
parameters cross PCIe to the GPU twice (forward and backward gathers), the gradient shards once back, and the
optimizer streams its state in host memory; none of it is overlapped (a conservative bound: FSDP2 prefetches the
next block's copy).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from lightning_par import _compat, axes
from lightning_par.analysis.pipeline_timeline import replay, two_bw_order
from lightning_par.parallel.activation_offload import MIN_BYTES as OFFLOAD_MIN_BYTES
from lightning_par.planner import activations, compute, fp8
from lightning_par.planner.devices import Device
from lightning_par.planner.inflight import rank_blocks
from lightning_par.planner.layout import SCHEDULES, Layout, compute_bytes, stored_bytes
from lightning_par.planner.model import ModelDesc

# Bytes the optimizer step streams per parameter on this rank (reads + writes): "megatron": apex's fused Adam on
# fp32 master weights (read master, grad, two moments: 16; write master, moments and the half-precision copy: 14),
# the gradient-norm read (4) and zeroing of the fp32 main gradients (4). "torch": torch's foreach AdamW on fp32
# parameters (read 16, write 12) and the norm read (4); gradients are freed, not zeroed.
_OPTIMIZER_BYTES = {"megatron": 38, "torch": 32}
_ENGINE_PASSES = {0: 4, 1: 4, 2: 4, 3: 6}  # read + write passes over the local parameter bytes (module docstring)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds per optimizer step and its parts (all per GPU, on the slowest pipeline stage)."""

    total: float
    compute: float
    tp_comm: float
    pipeline_bubble: float
    pipeline_p2p: float
    dp_comm_exposed: float
    optimizer: float
    model_flops: float  # per GPU per step: 6 x active parameters x tokens + attention, the MFU convention

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilisation against ``peak`` FLOP/s."""
        return self.model_flops / (self.total * peak)


@functools.lru_cache(maxsize=512)
def idle_stage_times(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """A pipeline rank's idle time per step, in stage times (one micro-batch's forward and backward over all of a
    rank's chunks), when every stage costs the same.

    The multi-stage schedules' own action tables (torch's, built without stages or a process group) are replayed
    with forward = input-gradient = weight-gradient cost (`lightning_par.analysis.pipeline_timeline.replay`):
    ``makespan / (3 v) - m``. GPipe and 1F1B idle ``p - 1`` stage times, which their replay equals
    (tests/test_plan_activations.py replays them). A table torch cannot build for these numbers falls back to the
    closed forms: ``(p - 1) / v``, a third of it for the zero-bubble schedules (ZB-H1's bound).

    PipeDream-2BW (``"2bw"``; Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", arXiv
    2006.09503) overlaps steps: each stage runs 1F1B's steady state across the optimizer-step boundary, so there is
    no warm-up or cool-down flush, only the ramp of the forward chain after the boundary's barrier. Its steady-state
    step (`lightning_par.analysis.pipeline_timeline.two_bw_order`, the previous step's in-flight results given)
    replays to ``(p - 1) / 3`` stage times: ``p - 1`` forwards, against 1F1B's ``p - 1`` forward-backward pairs.
    """
    if schedule in ("gpipe", "1f1b"):
        return float(pp - 1)
    if schedule == "2bw":
        order, given = two_bw_order(pp, microbatches)
        return replay(order, 1.0, 1.0, 1.0, given=given).makespan / 3 - microbatches
    local = max(vpp, SCHEDULES[schedule])
    try:
        order = {r: _compat.schedule_rank_actions(schedule, local, pp, microbatches, r) for r in range(pp)}
        return replay(order, 1.0, 1.0, 1.0).makespan / (3 * local) - microbatches
    except (ValueError, RuntimeError, AssertionError, ZeroDivisionError, KeyError, IndexError):
        return (pp - 1) / local * (1 / 3 if axes.SCHEDULES[schedule].split_backward else 1)


def _link(dev: Device, span: int) -> float:
    """Bandwidth between ranks ``span`` apart in rank order: NVLink inside a node, the NIC across nodes."""
    bw = dev.intra_node_bytes_per_s if span <= dev.gpus_per_node else dev.inter_node_bytes_per_s
    return bw * dev.link_efficiency


def collective_time(kind: str, nbytes: float, n: int, bandwidth: float, dev: Device) -> float:
    """Ring-algorithm seconds for a collective of ``nbytes`` (the full tensor) over ``n`` ranks: an all-reduce
    moves ``2 (n-1)/n`` of it per rank, a reduce-scatter, all-gather or all-to-all ``(n-1)/n``."""
    if n <= 1:
        return 0.0
    emulated = kind == "reduce_scatter" and dev.reduce_scatter_all_reduces
    factor = 2.0 if kind == "all_reduce" or emulated else 1.0
    return factor * (n - 1) / n * nbytes / bandwidth + dev.collective_latency_s


def _block_time(desc: ModelDesc, layout: Layout, seq_len: int, dev: Device, profile: str) -> tuple[float, float]:
    """(compute seconds, tensor/expert/context-parallel communication seconds) of one block, forward + backward +
    recomputation, for one micro-batch."""
    gemms = compute.block_gemms(desc, layout, seq_len, profile)
    times = {g.name: compute.gemm_time(g, dev, layout.precision) for g in gemms}
    casts = (0.0, 0.0)
    if layout.fp8:  # the projections at the fp8 rate, plus their casts' bytes (planner/fp8.py)
        fp8.check_device(dev)
        times.update({g.name: compute.gemm_time(g, dev, "fp8") for g in gemms if g.name in fp8.FP8_GEMMS})
        casts = fp8.cast_seconds(gemms, layout, dev)
    fwd_gemm = sum(times.values())
    elem = compute.block_elementwise_bytes(desc, layout, seq_len, profile) / (
        dev.hbm_bytes_per_s * dev.memory_efficiency
    )
    if layout.recompute == "full":
        redo = fwd_gemm + elem
    elif layout.recompute == "selective":
        core = times["scores"] + times["context"] if profile == "megatron" else 0.0
        redo = core + elem * (0.5 if profile == "megatron" else 1.0)  # megatron: the softmax / dropout half
    else:
        redo = 0.0
    comp = 3 * fwd_gemm + 3 * elem + redo + sum(casts) + (casts[0] if layout.recompute == "full" else 0.0)
    el = compute_bytes(layout.precision)
    tokens = layout.micro_batch_size * seq_len // layout.cp
    resid = tokens * desc.hidden * el
    comm = 0.0
    if layout.tp > 1:
        bw = _link(dev, layout.tp)
        if layout.sequence_parallel:  # reduce-scatter + all-gather: an all-reduce's bytes, one more latency
            per = collective_time("reduce_scatter", resid, layout.tp, bw, dev)
            per += collective_time("all_gather", resid, layout.tp, bw, dev)
        else:
            per = collective_time("all_reduce", resid, layout.tp, bw, dev)
        count = 4 + (2 if layout.recompute == "full" else 0)
        comm += count * per
        if layout.sequence_parallel and layout.recompute != "full":
            comm += 2 * collective_time("all_gather", resid, layout.tp, bw, dev)
        if layout.sequence_parallel and layout.fp8:  # the regions' input gathers at one byte a value (fp8/sequence)
            forward = 2 * (2 if layout.recompute == "full" else 1)
            comm -= forward * (collective_time("all_gather", resid, layout.tp, bw, dev)
                               - collective_time("all_gather", resid / el, layout.tp, bw, dev))  # fmt: skip
    if desc.experts and layout.ep > 1:
        routed = tokens * desc.top_k * desc.hidden * el
        comm += 4 * collective_time("all_to_all", routed * layout.ep, layout.ep, _link(dev, layout.ep * layout.tp), dev)
    if layout.cp > 1:
        kv = 2 * seq_len * layout.micro_batch_size * max(1, desc.kv_heads // layout.tp) * desc.head_dim * el
        comm += 2 * collective_time("all_gather", kv, layout.cp, _link(dev, layout.cp * layout.tp), dev)
    return comp, comm


def _offload_exposed(desc: ModelDesc, layout: Layout, seq_len: int, dev: Device, profile: str, comp: float) -> float:
    """Seconds per offloaded block and micro-batch its activation copies add: each crosses PCIe out during the
    block's forward and back during the backward of the block after it (the prefetch), hidden up to that compute
    (a third of the block's, and two thirds)."""
    items = activations.block_tensors(desc, layout, seq_len, profile)
    copy = sum(x.nbytes for x in items if x.autograd and x.nbytes >= OFFLOAD_MIN_BYTES) / dev.pcie_bytes_per_s
    return max(0.0, copy - comp / 3) + max(0.0, copy - 2 * comp / 3)


def _head_time(desc: ModelDesc, layout: Layout, seq_len: int, dev: Device) -> float:
    """The vocabulary projection (forward, two backward GEMMs) and its softmax cross-entropy, per micro-batch."""
    logits = sum(compute.gemm_time(g, dev, layout.precision) for g in compute.head_gemms(desc, layout, seq_len))
    tokens = layout.micro_batch_size * seq_len // layout.cp
    # The loss reads the logits, writes their softmax and reads it back in the backward (fp32 in both profiles).
    xent = 3 * tokens * math.ceil(desc.vocab / layout.tp) * 4 / (dev.hbm_bytes_per_s * dev.memory_efficiency)
    return 3 * logits + xent


def step_time(
    desc: ModelDesc,
    layout: Layout,
    dev: Device,
    global_batch: int,
    seq_len: int,
    profile: str = "torch",
    local_params: float | None = None,
    dp_sent: float | None = None,
) -> StepTime:
    """Predicted time of one optimizer step.

    Args:
        desc, layout, dev: the model, the layout and the GPU (its node: `Device.gpus_per_node`).
        global_batch: samples per optimizer step over all data-parallel ranks.
        seq_len: tokens per sample.
        profile: which kernels run (`lightning_par.planner.compute.PROFILES`).
        local_params: parameters this GPU updates (default: the model's share under tp, pp, ep and ZeRO).
        dp_sent: under PowerSGD (``layout.powersgd_rank``), the share of the gradient elements its all-reduce sends.
    """
    m = layout.m(global_batch)
    comp, comm = _block_time(desc, layout, seq_len, dev, profile)
    chunks = layout.pp * layout.vpp
    per_rank_blocks = [len(range(r, desc.layers, layout.pp)) for r in range(layout.pp)]  # balanced split
    head = _head_time(desc, layout, seq_len, dev)
    stage = [n * (comp + comm) for n in per_rank_blocks]
    stage[-1] += head
    if layout.recompute == "offload":  # each offloaded block's PCIe copies, what its compute does not hide
        exposed = _offload_exposed(desc, layout, seq_len, dev, profile, comp)
        for r in range(layout.pp):
            mine = rank_blocks(layout, desc.layers, r)[0]
            stage[r] += exposed * sum(layout.offload_blocks is None or i < layout.offload_blocks for i in mine)
    p2p = 0.0
    if layout.pp > 1:
        el = compute_bytes(layout.precision)
        act = layout.micro_batch_size * seq_len // layout.cp * desc.hidden * el / layout.tp  # scatter-gather send
        span = layout.tp * layout.cp * layout.dp + 1  # neighbouring stages sit a whole stage's ranks apart
        p2p = 2 * layout.vpp * (act / _link(dev, span) + dev.collective_latency_s) * (chunks > 1)
    t_max = max(stage) + p2p
    bubble_chunks = idle_stage_times(layout.pp_schedule, layout.pp, m, layout.vpp) if layout.pp > 1 else 0.0
    bubble = bubble_chunks * (sum(stage) / len(stage) + p2p)
    compute_total = m * max(stage)
    tp_total = m * per_rank_blocks[-1] * comm
    # Data-parallel traffic of this rank's parameter share.
    stage_params = desc.total_params / layout.pp
    if desc.experts:
        expert_share = desc.layers * desc.experts * desc.expert_params / layout.pp
        stage_params = stage_params - expert_share + expert_share / layout.ep
    share = local_params if local_params is not None else stage_params / layout.tp
    el_grad = 4 if profile == "megatron" or layout.precision in ("32-true", "bf16-mixed", "16-mixed") else 2
    dp_comm = 0.0
    if layout.dp > 1:
        bw = _link(dev, layout.dp * layout.cp * layout.tp)
        n, grads, zs = layout.dp, share * el_grad, layout.zero_stage
        once = 0.0  # after the step, never overlapped: ZeRO 1/2's all-gather of the updated shards
        if zs == 0:
            per = collective_time("all_reduce", grads, n, bw, dev)
        elif zs in (1, 2):  # the updated shards gathered back: fp32 here, half under Megatron
            per = collective_time("reduce_scatter", grads, n, bw, dev)
            params = share * (2 if profile == "megatron" else stored_bytes(layout.precision))
            once = collective_time("all_gather", params, n, bw, dev)
        else:  # FSDP2 gathers each block twice in the compute dtype (int8 and a scale per 256 under qwZ)
            per = collective_time("reduce_scatter", grads, n, bw, dev)
            gathered = (1 + 4 / 256) if layout.zero_quantized_weights else compute_bytes(layout.precision)
            if layout.fp8:  # the fp8 weights at one byte each
                gathered -= fp8.fp8_share(desc) * (gathered - 1)
            per += 2 * collective_time("all_gather", share * gathered, n, bw, dev)
        # ZeRO 2 and 3 reduce in every micro-batch's backward, ZeRO 0 and 1 in the one that ends the accumulation;
        # each hides behind the backward it runs in (the backward's two thirds of that compute). Megatron-LM's
        # published runs did not overlap the data-parallel all-reduce.
        rounds = m if zs >= 2 else 1
        backward = compute_total * 2 / 3 * (1.0 if zs >= 2 else 1.0 / m)
        hidden = backward * dev.comm_overlap if profile == "torch" or zs >= 2 else 0.0
        if layout.powersgd_rank:  # three all-reduces per bucket after the backward (P, Q, the rest): none hidden
            per = collective_time("all_reduce", grads * (dp_sent or 1.0), n, bw, dev) + 2 * dev.collective_latency_s
            hidden = 0.0
        dp_comm = max(0.0, rounds * per - hidden) + once
        if profile == "torch":
            copies = _ENGINE_PASSES[layout.zero_stage] * share * el_grad
            dp_comm += copies / (dev.hbm_bytes_per_s * dev.memory_efficiency)
    shard = layout.shard_group if layout.zero_stage else 1
    if layout.offload:
        crossing = share / shard * (2 * 2 + el_grad)  # bf16-or-fp32 gathers assumed 2 bytes, fp32 gradients
        optimizer = (
            crossing / dev.pcie_bytes_per_s + share / shard * _OPTIMIZER_BYTES[profile] / dev.host_memory_bytes_per_s
        )
    else:
        optimizer = share / shard * _OPTIMIZER_BYTES[profile] / (dev.hbm_bytes_per_s * dev.memory_efficiency)
    total = m * t_max + bubble + dp_comm + optimizer
    tokens = global_batch * seq_len
    attn = 12 * desc.layers * desc.heads * desc.head_dim * seq_len * tokens  # forward + backward, full s x s
    model_flops = (
        6 * (desc.active_params - desc.embedding_params + desc.vocab * desc.hidden) * tokens + attn
    ) / layout.world
    return StepTime(total=total, compute=compute_total, tp_comm=tp_total, pipeline_bubble=bubble,
                    pipeline_p2p=m * p2p, dp_comm_exposed=dp_comm, optimizer=optimizer,
                    model_flops=model_flops)  # fmt: skip
