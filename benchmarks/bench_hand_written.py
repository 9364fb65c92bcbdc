"""Step time of ``tp_zero3`` and ``pipe_tp`` against the same layouts written by hand, torchtitan style.

Launch (4 ranks on this machine's 2 cores, one thread each; both sides of a pair run oversubscribed alike):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_hand_written.py [--quick]

Takes ~6 min with the defaults at load < 1 (4 rounds x 4 runs of 3 + 10 steps, plus the loss check); ``--quick``
~1 min. The job first checks that each pair computes the same thing (the logged losses of a short run, same seed
and data, printed side by side), then times them in alternated rounds.

Pairs on 4 ranks (ours vs theirs):
- ``tp_zero3`` (tp 2 x dp 2) vs Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``
  with `HandTPZero3GPT.configure_model`: torchtitan's ``apply_tp`` then ``apply_fsdp`` written out for the GPT,
  with the choices our planner makes (sequence parallel on the residual stream, embeddings / final norm / head
  replicated, whole heads of q, k and v per rank), then ``fully_shard`` per block and on the root over dp.
- ``pipe_tp`` (pp 2 x tp 2, ``1f1b``, 2 x pp microbatches, no sequence parallel inside stages) vs
  `HandPipeTPGPT` under `PipeTPPeerStrategy`: Lightning's ``ModelParallelStrategy`` has no pipeline, so its 2 x 2
  mesh's first axis is read as pp (the sampler then gives every rank the same batch, as a pipeline needs), and
  ``configure_model`` cuts the GPT into torchtitan-style stages (even blocks per stage, embeddings on the first,
  ``ln_f`` + head on the last), applies Colwise / Rowwise per block over tp, and wraps each stage in
  ``torch.distributed.pipelining.PipelineStage`` run by ``Schedule1F1B`` (loss divided by the microbatch count,
  ``scale_grads=False``, as torchtitan does); manual optimization (the schedule runs backward itself), the last
  stage's loss broadcast over pp and logged on every rank.

Both hand-written plans keep the GPT's fused ``c_attn``: its rows are reordered once so a contiguous tp split holds
this rank's heads of q, k and v (Megatron's per-rank ``[q | k | v]``), where ours uses a strided DTensor split of the
unchanged weight. Every config runs once per round with a fresh Trainer, in one process group; the order reverses
every other round (ABBA). A hand-run benchmark, not a test. Results and their reading: docs/benchmarks_history.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, cast

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _rounds import StepTimer  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from typing_extensions import override  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers "tp_zero3", "pipe_tp")
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

PAIRS = [("tp_zero3", "hand_tp_fsdp2"), ("pipe_tp", "hand_pipe_tp")]


@torch.no_grad()
def _qkv_rank_major(linear: nn.Linear, tp: int) -> None:
    """Reorder a fused ``[q | k | v]`` projection's rows to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, so that
    ``ColwiseParallel``'s contiguous split gives rank r its heads of q, k and v and the model's local ``chunk(3)``
    still finds q, k and v (Megatron-LM's fused-qkv layout)."""
    rows = linear.out_features
    order = torch.arange(rows).view(3, tp, rows // (3 * tp)).transpose(0, 1).reshape(-1)
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(cast(nn.ModuleList, cast(nn.ModuleDict, model.transformer)["h"]))


class HandTPZero3GPT(GPT):
    """The GPT under ``ModelParallelStrategy``: tensor + sequence parallel by hand over ``tensor.apply``, then
    FSDP2 over ``data_parallel`` (torchtitan's order: TP before FSDP, so FSDP shards the tp-local tensors)."""

    def configure_model(self) -> None:
        assert self.device_mesh is not None, "ModelParallelStrategy sets device_mesh before configure_model"
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        blocks = _blocks(self)
        for i, block in enumerate(blocks):
            _qkv_rank_major(cast(nn.Linear, block.get_submodule("attn.c_attn")), tp.size())
            if i == 0:  # enter the sequence-parallel region: keep this rank's slice of the sequence (no comm)
                enter = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True)  # fmt: skip
                parallelize_module(block, tp, enter)
            plan: dict[str, Any] = {
                "ln_1": SequenceParallel(use_local_output=True),
                # all-gather the sequence once per region; the column split's input-gradient sum is one reduce-scatter
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.c_attn": ColwiseParallel(),
                "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln_2": SequenceParallel(use_local_output=True),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.c_fc": ColwiseParallel(),
                "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
            parallelize_module(block, tp, plan)
            if i == len(blocks) - 1:  # leave it: gather the sequence for the replicated ln_f and head
                leave = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
                parallelize_module(block, tp, leave)
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)  # the root owns wte, wpe, ln_f and lm_head


class _GPTStage(nn.Module):
    """One pipeline stage of the GPT: the embeddings on the first, blocks ``[start, end)``, ``ln_f`` + head on the
    last (torchtitan's manual split keeps the model's modules and drops the others)."""

    def __init__(self, gpt: GPT, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        tr = cast(nn.ModuleDict, gpt.transformer)
        self.wte: Optional[nn.Module] = tr["wte"] if first else None
        self.wpe: Optional[nn.Module] = tr["wpe"] if first else None
        self.drop: Optional[nn.Module] = tr["drop"] if first else None
        self.blocks = nn.ModuleList(_blocks(gpt)[start:end])
        self.ln_f: Optional[nn.Module] = tr["ln_f"] if last else None
        self.lm_head: Optional[nn.Module] = gpt.lm_head if last else None

    def forward(self, x: Tensor) -> Tensor:
        if self.wte is not None and self.wpe is not None and self.drop is not None:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class HandPipeTPGPT(GPT):
    """The GPT cut into pp stages by hand, each stage's blocks tensor-parallel over tp, run by ``Schedule1F1B``.

    Args:
        microbatches: per training step (ours: ``2 * pp``).
        **kwargs: the GPT's.
    """

    def __init__(self, microbatches: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.microbatches = microbatches
        self.automatic_optimization = False  # the schedule runs forward and backward itself
        self._schedule: Optional[Schedule1F1B] = None

    def configure_model(self) -> None:
        assert self.device_mesh is not None
        pp_mesh, tp = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]  # axis 0 read as pp
        self.pp_group = pp_mesh.get_group()
        pp, stage = pp_mesh.size(), pp_mesh.get_local_rank()
        self.first, self.last = stage == 0, stage == pp - 1
        self.last_rank = dist.get_global_rank(self.pp_group, pp - 1)
        per = self.n_layers // pp  # torchtitan's default split: even blocks per stage
        module = _GPTStage(self, stage * per, (stage + 1) * per, self.first, self.last)
        for block in module.blocks:
            _qkv_rank_major(cast(nn.Linear, block.get_submodule("attn.c_attn")), tp.size())
            parallelize_module(block, tp, {  # no sequence parallel: stages exchange whole activations
                "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
            })  # fmt: skip
        del self.transformer, self.lm_head  # the other stages' modules go; this stage keeps its own
        self.stage = module
        self.stage_index, self.n_stages = stage, pp

    def _schedule_for(self, x: Tensor) -> Schedule1F1B:
        if self._schedule is not None:
            return self._schedule
        mb, seq = x.shape[0] // self.microbatches, x.shape[1]
        hidden = torch.empty(mb, seq, self.hidden_size, device="meta", requires_grad=True)
        logits = torch.empty(mb, seq, self.vocab_size, device="meta")
        stage = PipelineStage(
            self.stage, self.stage_index, self.n_stages, x.device, group=self.pp_group,
            input_args=() if self.first else (hidden,), output_args=logits if self.last else hidden,
        )  # fmt: skip
        m = self.microbatches

        def loss_fn(out: Tensor, target: Tensor) -> Tensor:
            return F.cross_entropy(out.flatten(0, 1).float(), target.flatten()) / m  # the mean over microbatches

        self._schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        return self._schedule

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = cast(torch.optim.Optimizer, self.optimizers())
        opt.zero_grad()
        schedule = self._schedule_for(x)
        losses: list[Tensor] = []
        if self.first:
            schedule.step(x)
        elif self.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        cast(Any, self.lr_schedulers()).step()
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)  # every rank logs the batch loss, as ours
        self.log("train_loss", loss, sync_dist=True)


class PipeTPPeerStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose first mesh axis is read as pp: every rank then reads the same batches (one
    data-parallel replica), since a pipeline's first stage needs the inputs and its last the targets."""

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}


class Recorder(L.Callback):
    """The logged ``train_loss`` of every step, and this process's CPU time per step after ``warmup``: with 4 ranks
    on 2 cores a rank's wall time also holds the time it waited for a core, its CPU time only its own work (gloo
    blocks rather than spins while it waits for a peer). Registered after the timer: outside its timed window."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.losses: list[float] = []
        self.cpu: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.process_time()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.cpu.append(time.process_time() - self._t0)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


Factory = Callable[[], tuple[Any, L.LightningModule, int]]


def _configs(model_kwargs: dict[str, Any], pp: int) -> dict[str, Factory]:
    """Name -> factory of (strategy, model, data-parallel replicas); a fresh pair per run."""
    return {
        "tp_zero3": lambda: ("tp_zero3", GPT(**model_kwargs), 2),
        "hand_tp_fsdp2": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
                                  HandTPZero3GPT(**model_kwargs), 2),
        "pipe_tp": lambda: ("pipe_tp", GPT(**model_kwargs), 1),
        "hand_pipe_tp": lambda: (PipeTPPeerStrategy(data_parallel_size=pp, tensor_parallel_size=2),
                                 HandPipeTPGPT(microbatches=2 * pp, **model_kwargs), 1),
    }  # fmt: skip


class Run(NamedTuple):
    """One run: rank 0's wall time per timed step, the median CPU time per step summed over ranks, the losses."""

    times: list[float]
    cpu: float
    losses: list[float]


def run_once(factory: Factory, args: argparse.Namespace, warmup: int, steps: int) -> Run:
    """One fresh Trainer.fit."""
    L.seed_everything(0, verbose=False)
    strategy, model, replicas = factory()
    total = warmup + steps
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=total * args.batch * replicas)
    timer, recorder = StepTimer(warmup), Recorder(warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer, recorder],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    if len(timer.times) != steps:
        raise RuntimeError(f"timed {len(timer.times)} steps, expected {steps}; raise num_samples")
    cpu = torch.tensor(statistics.median(recorder.cpu) if recorder.cpu else 0.0, dtype=torch.float64)
    dist.all_reduce(cpu)  # the work of all 4 ranks per step
    return Run(timer.times, float(cpu), recorder.losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 rounds, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of the loss-agreement run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per data-parallel replica; a multiple of 2 x pp")
    parser.add_argument("--only", choices=[p[0] for p in PAIRS], help="one pair")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)  # keep the tables readable
    if args.quick:
        args.rounds, args.warmup, args.steps, args.check_steps, args.embd, args.seq = 2, 1, 2, 3, 64, 32
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != 4:
        raise SystemExit(f"run on 4 ranks (tp 2 x dp 2, pp 2 x tp 2); got {world}: torchrun --nproc-per-node 4")
    model_kwargs = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    configs = _configs(model_kwargs, pp=2)
    pairs = [p for p in PAIRS if args.only in (None, p[0])]
    order = [name for pair in pairs for name in pair]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()

    # 1. Same computation: the logged loss of every step, ours against the peer (same seed, same batches).
    checks = {name: run_once(configs[name], args, 0, args.check_steps).losses for name in order}
    # 2. Time: ABBA rounds; a run's figure is the median of its timed steps on rank 0 (the ranks are in lock-step
    #    through the collectives), and the median CPU time per step summed over the 4 ranks.
    medians: dict[str, list[float]] = {name: [] for name in order}
    cpu: dict[str, list[float]] = {name: [] for name in order}
    fastest: dict[str, float] = {name: float("inf") for name in order}
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            run = run_once(configs[name], args, args.warmup, args.steps)
            medians[name].append(statistics.median(run.times))
            cpu[name].append(run.cpu)
            fastest[name] = min(fastest[name], min(run.times))
    elapsed = time.perf_counter() - start

    if rank == 0:
        n_params = sum(p.numel() for p in GPT(**model_kwargs).parameters())
        print(f"\nGPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} batch {args.batch} per replica, "
              f"{n_params / 1e6:.2f} M params, 4 ranks on {os.cpu_count()} cores; {args.rounds} rounds x "
              f"{args.steps} timed steps (+{args.warmup} warm-up); took {elapsed:.0f} s; 1-min load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")  # fmt: skip
        print("| ours | theirs | step | loss ours | loss theirs | abs diff |\n|---|---|---|---|---|---|")
        for ours, theirs in pairs:
            for i, (a, b) in enumerate(zip(checks[ours], checks[theirs])):
                print(f"| {ours} | {theirs} | {i} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")
        # The ratio of the medians is the headline; the per-round ratios pair runs seconds apart (drift cancels);
        # the fastest steps are the least disturbed by other tenants; CPU time leaves out waiting for a core.
        print("\n| ours | ms/step | hand-written | ms/step | ours/theirs | per-round ratio: median [min, max] "
              "| fastest-step ratio | CPU ms/step, 4 ranks: ours / theirs | CPU ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for ours, theirs in pairs:
            a, b = statistics.median(medians[ours]), statistics.median(medians[theirs])
            rounds = [x / y for x, y in zip(medians[ours], medians[theirs])]
            ca, cb = statistics.median(cpu[ours]), statistics.median(cpu[theirs])
            print(f"| {ours} | {a * 1e3:.1f} | {theirs} | {b * 1e3:.1f} | {a / b:.3f} | "
                  f"{statistics.median(rounds):.3f} [{min(rounds):.3f}, {max(rounds):.3f}] | "
                  f"{fastest[ours] / fastest[theirs]:.3f} | {ca * 1e3:.0f} / {cb * 1e3:.0f} | "
                  f"{ca / cb:.3f} |")  # fmt: skip
        print(f"\nper-round ms: { {k: [round(v * 1e3, 1) for v in vs] for k, vs in medians.items()} }", flush=True)
    clean_exit()


if __name__ == "__main__":
    main()
