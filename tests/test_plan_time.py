"""The step-time model's parts (lightning_par.planner.compute, steptime, search): each formula against its closed form,
so a change that breaks one fails here before it moves the published-table check. No process group."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_par.planner import ModelDesc, device
from lightning_par.planner.compute import Gemm, gemm_time, peak_flops
from lightning_par.planner.layout import Layout
from lightning_par.planner.search import candidates
from lightning_par.planner.steptime import collective_time, step_time

A100 = device("A100")
GPT = ModelDesc(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=16384, vocab=51200, gated_mlp=False,
                tied_embeddings=True, layernorm=True, bias=True, learned_positions=2048)  # fmt: skip


def test_gemm_waves_and_memory_bound() -> None:
    rate = peak_flops(A100, "bf16-mixed") * A100.gemm_efficiency
    # 108 tiles of 256 x 128 fill exactly one wave on 108 SMs: the large-GEMM rate.
    full = Gemm("full", 256 * 12, 128 * 9, 4096)
    assert gemm_time(full, A100, "bf16-mixed") == pytest.approx(full.flops / rate)
    # One more tile row: a second wave, mostly empty; the 128 x 128 tiling is taken if it wastes less.
    more = dataclasses.replace(full, m=full.m + 1)
    assert gemm_time(more, A100, "bf16-mixed") > 1.15 * more.flops / rate
    # A matrix-vector product moves far more bytes than it computes: priced at memory bandwidth.
    gemv = Gemm("gemv", 1, 8192, 8192)
    moved = (8192 + 8192 * 8192 + 8192) * 2
    assert gemm_time(gemv, A100, "bf16-mixed") == pytest.approx(moved / (A100.hbm_bytes_per_s * 0.8))


def test_ring_collectives() -> None:
    bw, n, nbytes = 100e9, 8, 1e9
    lat = A100.collective_latency_s
    assert collective_time("all_reduce", nbytes, n, bw, A100) == pytest.approx(2 * 7 / 8 * nbytes / bw + lat)
    assert collective_time("all_gather", nbytes, n, bw, A100) == pytest.approx(7 / 8 * nbytes / bw + lat)
    assert collective_time("all_reduce", nbytes, 1, bw, A100) == 0


@pytest.mark.parametrize(("schedule", "vpp", "factor"), [("1f1b", 1, 1.0), ("interleaved_1f1b", 2, 1.0),
                                                         ("interleaved_zb", 2, 1 / 3), ("2bw", 1, 1 / 3)])  # fmt: skip
def test_bubble_is_the_schedules_closed_form(schedule: str, vpp: int, factor: float) -> None:
    # Free links and no head: every stage costs the same, so the bubble is (p - 1) / v stage times (ZB-H1: a third;
    # PipeDream-2BW: the forward ramp only, p - 1 forwards of a third of a stage time each).
    free = dataclasses.replace(A100, intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30,
                               collective_latency_s=0.0)  # fmt: skip
    desc = dataclasses.replace(GPT, vocab=1)
    layout = Layout(pp=4, vpp=vpp, pp_schedule=schedule, microbatches=8, precision="bf16-mixed")
    t = step_time(desc, layout, free, global_batch=8, seq_len=2048, profile="megatron")
    per_micro = t.compute / 8
    assert t.pipeline_bubble == pytest.approx(3 / vpp * factor * per_micro, rel=0.02)


def test_more_tensor_parallel_traffic_crossing_nodes_costs_more() -> None:
    inside = step_time(GPT, Layout(tp=8, dp_shard=2), A100, 16, 2048)
    across = step_time(GPT, Layout(tp=8, dp_shard=2), dataclasses.replace(A100, gpus_per_node=4), 16, 2048)
    assert across.tp_comm > 5 * inside.tp_comm  # NVLink 300 GB/s vs a 25 GB/s NIC
    full = step_time(GPT, Layout(tp=8, dp_shard=2, recompute="full"), A100, 16, 2048)
    assert full.tp_comm == pytest.approx(inside.tp_comm * 6 / 4, rel=0.01)  # the forward's 2 collectives again


def test_zero_overlap_and_mfu() -> None:
    # ZeRO-1 reduces in the backward that ends the accumulation: with 8 micro-batches only the last one's backward
    # hides it. ZeRO-2 reduces in each (8 reduce-scatters), hidden on a GPU, not on a CPU whose cores all compute.
    z1 = step_time(GPT, Layout(dp_shard=8, zero_stage=1), A100, 64, 2048)
    nic = dataclasses.replace(A100, gpus_per_node=1)  # data parallelism over 25 GB/s links: more than 1/8 hides
    assert step_time(GPT, Layout(dp_shard=8, zero_stage=1), nic, 64, 2048).dp_comm_exposed > step_time(
        GPT, Layout(dp_shard=8, zero_stage=1, micro_batch_size=8), nic, 64, 2048).dp_comm_exposed  # fmt: skip
    busy = dataclasses.replace(A100, comm_overlap=0.0)
    z2_busy = step_time(GPT, Layout(dp_shard=8, zero_stage=2), busy, 64, 2048)
    assert z2_busy.dp_comm_exposed > step_time(GPT, Layout(dp_shard=8, zero_stage=1), busy, 64, 2048).dp_comm_exposed
    assert z2_busy.dp_comm_exposed > step_time(GPT, Layout(dp_shard=8, zero_stage=2), A100, 64, 2048).dp_comm_exposed
    # MFU's FLOPs: 6 x (non-embedding parameters + the head) x tokens + 12 l h s tokens, over the world.
    tokens = 64 * 2048
    n = GPT.total_params - GPT.embedding_params + GPT.vocab * GPT.hidden
    assert z1.model_flops == pytest.approx((6 * n * tokens + 12 * 32 * 4096 * 2048 * tokens) / 8)
    assert 0 < z1.mfu(peak_flops(A100, "bf16-mixed")) < A100.gemm_efficiency


def test_candidates_per_rank_batch_scale_the_global_batch() -> None:
    pool = list(candidates(GPT, world=8, gpus_per_node=8, per_rank_batch=4, precision="32-true"))
    assert pool and all(batch == 4 * layout.dp for layout, batch in pool)
    assert all(layout.micro_batch_size == 4 for layout, _ in pool if layout.pp == 1)
    assert {layout.tp for layout, _ in pool} == {1, 2, 4, 8}
    assert all(layout.sequence_parallel == (layout.tp > 1) for layout, _ in pool)  # inside pipeline stages too
    with pytest.raises(ValueError, match="exactly one of"):
        next(candidates(GPT, 8, 8))


def test_idle_stage_times_come_from_the_schedules_own_tables() -> None:
    from lightning_par.planner.steptime import idle_stage_times

    assert idle_stage_times("1f1b", 8, 64) == 7 == idle_stage_times("gpipe", 8, 16)
    # torch's interleaved table replayed: (p - 1) / v, for the suite's v = 2 and Megatron's v = 3 alike.
    assert idle_stage_times("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 2)
    assert idle_stage_times("interleaved_1f1b", 8, 64, 3) == pytest.approx(7 / 3)
    # The zero-bubble tables leave a third (ZB-H1's bound with equal F, I and W); DualPipeV its own two thirds.
    assert idle_stage_times("interleaved_zb", 4, 8, 2) == pytest.approx(1 / 2)
    assert idle_stage_times("zbv", 4, 8) == pytest.approx(1 / 2)
    assert idle_stage_times("dualpipev", 4, 8) == pytest.approx(1.0)


def test_2bw_bubble_is_its_replay_and_below_1f1b() -> None:
    # PipeDream-2BW (arXiv 2006.09503): the steady-state step replayed, the previous step's in-flight results given.
    from lightning_par.analysis.pipeline_timeline import replay, two_bw_order
    from lightning_par.planner.steptime import idle_stage_times

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p + 1):
            order, given = two_bw_order(p, m)
            replayed = replay(order, 1.0, 1.0, 1.0, given=given).makespan / 3 - m
            assert idle_stage_times("2bw", p, m) == pytest.approx(replayed)
            assert idle_stage_times("2bw", p, m) == pytest.approx((p - 1) / 3)
            assert idle_stage_times("2bw", p, m) < idle_stage_times("1f1b", p, m) == p - 1
    # With F = 1, B = 2 the idle fraction is (p - 1) / (3 m + p - 1): p = 4, m = 4: 0.2 (1F1B: 3 / 7, 0.429).
    order, given = two_bw_order(4, 4)
    assert replay(order, 1.0, 2.0, 0.0, given=given).bubble == pytest.approx(3 / 15)
    # The same layout's predicted step: the same compute and sends, a third of 1F1B's bubble, a shorter step.
    layout = Layout(pp=4, microbatches=8, precision="bf16-mixed")
    base = step_time(GPT, layout, A100, global_batch=8, seq_len=2048)
    two_bw = step_time(GPT, dataclasses.replace(layout, pp_schedule="2bw"), A100, global_batch=8, seq_len=2048)
    assert (two_bw.compute, two_bw.pipeline_p2p) == (base.compute, base.pipeline_p2p)
    assert two_bw.pipeline_bubble == pytest.approx(base.pipeline_bubble / 3)
    assert two_bw.total == pytest.approx(base.total - 2 / 3 * base.pipeline_bubble) and two_bw.total < base.total
    # The search never proposes it: a one-step-late update changes the optimisation, the user must ask for it.
    assert all(lay.pp_schedule != "2bw" for lay, _ in candidates(GPT, world=16, gpus_per_node=8, global_batch=64))


def test_fp8_gathers_the_regions_inputs_at_one_byte() -> None:
    # Under sequence parallelism fp8 all-gathers each region's input cast (parallel/fp8/sequence.py): the two
    # forward gathers of a block move 1 byte a value instead of the compute dtype's 2 (H100: fp8 peaks).
    h100 = device("H100")
    layout = Layout(tp=8, dp_shard=2, sequence_parallel=True, precision="bf16-mixed")
    bf16 = step_time(GPT, layout, h100, 16, 2048)
    fp8 = step_time(GPT, dataclasses.replace(layout, fp8=True), h100, 16, 2048)
    resid = layout.micro_batch_size * 2048 * GPT.hidden * 2
    bw = h100.intra_node_bytes_per_s * h100.link_efficiency
    gather = [collective_time("all_gather", b, 8, bw, h100) for b in (resid, resid / 2)]
    saved = 2 * (gather[0] - gather[1])
    blocks_and_microbatches = (bf16.tp_comm - fp8.tp_comm) / saved
    assert blocks_and_microbatches == pytest.approx(round(blocks_and_microbatches), rel=1e-9)
    assert round(blocks_and_microbatches) == GPT.layers * layout.m(16)  # every block's gathers, each micro-batch
    no_sp = dataclasses.replace(layout, sequence_parallel=False)
    assert step_time(GPT, dataclasses.replace(no_sp, fp8=True), h100, 16, 2048).tp_comm == step_time(
        GPT, no_sp, h100, 16, 2048).tp_comm  # without sequence parallelism nothing is gathered
