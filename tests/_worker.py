"""Train reference models under a strategy and dump what tests compare. Run under torchrun or as one process.

``python tests/_worker.py SPEC.json``: SPEC has ``out`` (a .pt path written by global rank 0) and ``jobs``, a list
of dicts, each a `jobs.Job` (tests/jobs.py; a key that is no field fails). All jobs run in this one process group,
since a spawn costs seconds here. The process ends with barrier, destroy_process_group and ``os._exit`` (avoids
exit-time aborts, docs/testing.md). The models jobs train are in tests/_job_models.py, the callbacks that record a
fit in tests/_job_callbacks.py, what is patched around it in tests/_job_hooks.py and what is read off the strategy
after it in tests/_job_results.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _job_callbacks import (  # noqa: E402
    EMA,
    STEP_ENDS,
    STEPS,
    CheckpointRecorder,
    Corrupt,
    Hang,
    InitRecorder,
    MemoryLogger,
    OptimizerRecorder,
    QuietRecorder,
    RankSeed,
    Recorder,
    RoutingRecorder,
    SigKill,
    TorchaoFp8,
    fp8_names,
    full_params,
    local_bytes,
)
from _job_hooks import counted_reduce_scatters, patch_checkpoint_writes, recorded_warnings  # noqa: E402
from _job_models import MODELS, ProbeGPT  # noqa: E402
from _job_results import (  # noqa: E402
    as_dict,
    auto_choice,
    ds_batch,
    fsdp_groups,
    gather_experts,
    gathered_objects,
    prefetch_stats,
)
from jobs import Job, check  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_par  # noqa: E402  (registers the strategy names)
from lightning_par.callbacks import ParallelismMonitor, ReplicaCheck  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import MoEGPT  # noqa: E402
from lightning_par.strategies import make_strategy  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


def _checkpoint_callbacks(job: Job) -> list[L.Callback]:
    if not job.ckpt_dir:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    if job.ckpt_every_n_steps:
        # Keep the newest `save_top_k` by step (and last.ckpt with save_last), written after every n-th step.
        steps = [ModelCheckpoint(dirpath=job.ckpt_dir, filename="{step}", monitor="step", mode="max",
                                 every_n_train_steps=job.ckpt_every_n_steps, save_top_k=job.save_top_k,
                                 save_last=job.save_last)]  # fmt: skip
        if job.ckpt_epoch_end_dir:  # also one per epoch, written at the epoch's end (on_train_epoch_end)
            steps.append(ModelCheckpoint(dirpath=job.ckpt_epoch_end_dir, filename="{epoch}", save_top_k=-1,
                                         every_n_epochs=1, save_on_train_epoch_end=True))  # fmt: skip
        return steps

    # One checkpoint per epoch, written at the epoch's end so the loop state says "epoch finished".
    return [ModelCheckpoint(dirpath=job.ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                            save_on_train_epoch_end=True)]  # fmt: skip


def run_job(job: Job) -> dict[str, Any]:
    """One fit, as ``job`` describes it (tests/jobs.py: every option, its default and what it does); returns what
    the tests compare (losses, gradient norms, full parameters, memory, checkpoint listings, ...)."""
    if job.simulate:  # local SGD in one process (tests/_local_sgd_sim.py)
        from _local_sgd_sim import simulate

        return simulate(job, MODELS[job.model])
    if job.simulate_powersgd:  # PowerSGD in one process (tests/_powersgd_sim.py)
        from _powersgd_sim import simulate_powersgd

        return simulate_powersgd(job, MODELS[job.model])
    if job.simulate_two_bw:  # PipeDream-2BW's delayed update in one process (tests/_two_bw_sim.py)
        from _two_bw_sim import simulate_two_bw

        return simulate_two_bw(job, MODELS[job.model])
    if job.simulate_quantized:  # ZeRO-3's int8 weight all-gather in one process (tests/_quantized_sim.py)
        from _quantized_sim import simulate_quantized

        return simulate_quantized(job, MODELS[job.model])
    world = job.world or int(os.environ.get("WORLD_SIZE", "1"))
    with STEP_ENDS:
        STEPS.update(ended=0, over=False, saves=[])
    L.seed_everything(job.seed, verbose=False)
    model_cls = MODELS[job.model]
    strategy: Any = job.strategy
    if isinstance(strategy, dict):
        strategy = make_strategy(**strategy)
    dp = world if job.dp is None else job.dp
    accumulate = job.accumulate
    steps = job.steps
    global_batch = job.global_batch
    samples = global_batch * accumulate * (steps if job.epoch_steps is None else job.epoch_steps)
    seq_len = job.seq_len
    data: L.LightningDataModule = ByteTextDataModule(
        seq_len=seq_len, batch_size=global_batch // dp, num_samples=samples, seed=0
    )
    if job.stream:  # an iterable training dataset (tests/_streams.py): stream, stream_samples, workers
        from _streams import StreamData

        stream_samples = samples if job.stream_samples is None else job.stream_samples
        data = StreamData(job.stream, seq_len, global_batch // dp, stream_samples, job.workers, job.stream_dir)
    elif world == 1 and job.strategy == "auto":
        # (A lightning_par strategy in one process gets the distributed sampler itself, as below.)
        # Lightning always shuffles a distributed training loader (DistributedSampler(shuffle=True, seed=0)); at
        # step k the ranks together read perm[k*B:(k+1)*B] of that permutation, so the one-process reference
        # reads the same permutation in order and sees the same global batches.
        data.setup()
        order = data._train.order
        data._train.order = order[torch.randperm(len(order), generator=torch.Generator().manual_seed(0))]
        if job.rank_order > 1:  # rank r of `rank_order` data-parallel ranks reads every r-th sample of a step's
            step = global_batch * accumulate
            data._train.order = data._train.order.view(-1, step // job.rank_order, job.rank_order).transpose(1, 2)\
                .reshape(-1)  # fmt: skip
    recorder = Recorder(job.fail_at_step)
    memory_logger = MemoryLogger() if job.memory_logger else None
    optim_recorder = OptimizerRecorder()
    ckpt_recorder = CheckpointRecorder(job.record_step_params)
    routing = RoutingRecorder()
    extra: list[L.Callback] = [ckpt_recorder, *([optim_recorder] if job.record_optim else [])]
    ema = EMA() if job.ema else None
    if job.quiet:  # no callback of ours in the batch hooks: losses come from the logger
        recorder, memory_logger, extra = QuietRecorder(), MemoryLogger(), []
    if ema is not None:
        extra.append(ema)
    monitor = ParallelismMonitor(pictures_every_n_steps=1) if job.expert_load else None
    if monitor is not None:
        extra.append(monitor)
    if job.record_init:
        extra.append(InitRecorder())
    if job.sigkill_at_step:
        extra.append(SigKill(**job.sigkill_at_step))
    if job.corrupt:
        extra.append(Corrupt(**job.corrupt))
    if job.hang:
        extra.append(Hang(**job.hang))
    if job.replica_callback:
        extra.append(ReplicaCheck(job.replica_callback))
    if job.rank_seed:
        extra.append(RankSeed())
    if job.torchao_fp8:
        extra.append(TorchaoFp8(job.torchao_fp8 if isinstance(job.torchao_fp8, list) else None))
    ckpt_dir = job.ckpt_dir
    listing_before = sorted(os.listdir(ckpt_dir)) if ckpt_dir and os.path.isdir(ckpt_dir) else []
    found = lightning_par.checkpoint.latest(ckpt_dir) if ckpt_dir else None
    resume = job.resume
    if resume == "latest":
        resume = str(found) if found else None
    plugins = []
    precision = job.precision
    if job.lightning_fp16_reference:
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        precision = None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world // job.num_nodes if job.devices is None else job.devices,
        num_nodes=job.num_nodes,
        strategy=strategy,
        precision=precision,
        plugins=plugins or None,
        max_steps=steps if job.max_steps is None else job.max_steps,
        max_epochs=job.max_epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=job.clip,
        logger=memory_logger if memory_logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=bool(job.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([] if job.quiet else [recorder]), *_checkpoint_callbacks(job), *extra],
        num_sanity_val_steps=job.num_sanity_val_steps,
        limit_val_batches=job.limit_val_batches,
        limit_test_batches=2,
    )
    if job.write_after_next_step:  # which step each save was called at (`patch_checkpoint_writes`)
        save = trainer.strategy.save_checkpoint

        def counted_save(*args: Any, **kwargs: Any) -> Any:
            with STEP_ENDS:
                STEPS["saves"].append(STEPS["ended"])
                STEP_ENDS.notify_all()
            return save(*args, **kwargs)

        trainer.strategy.save_checkpoint = counted_save  # type: ignore[method-assign]
    # empty_init: the model is built under trainer.init_module(empty_init=True), on the meta device.
    with trainer.init_module(empty_init=True) if job.empty_init else contextlib.nullcontext():
        model = model_cls()
    # (no_routing: under a pipeline a rank routes only its stages' tokens, which this recorder cannot reassemble.)
    if isinstance(model, MoEGPT) and not job.no_routing:  # known once built (the trainer exists first)
        trainer.callbacks.append(routing)
    if job.hf_from_pretrained:  # the one-process reference of a pretrained start: transformers loads it
        if not hasattr(model, "model"):
            model.configure_model()  # a deferred model, built here (no strategy context: on the CPU)
        model.model = type(model.model).from_pretrained(job.hf_from_pretrained, attn_implementation="eager")
    if job.expect_error:
        try:
            with patch_checkpoint_writes(job):
                trainer.fit(torch.compile(model) if job.torch_compile else model, datamodule=data,
                            ckpt_path=resume)  # fmt: skip
        except Exception as err:
            import traceback

            where = "".join(traceback.format_tb(err.__traceback__)[-6:])
            return {"error": f"{type(err).__name__}: {err}", "losses": recorder.losses, "where": where}
        params = full_params(model)  # it trained after all: what a parity check needs (tools/zoo.py)
        gather_experts(trainer, model, params)
        params, _, tied = _stage_params(trainer, params)
        return {"error": None, "losses": recorder.losses, "params": params, "tied": tied,
                "fp8_layers": sorted({n for names in gathered_objects(fp8_names(model)) for n in names})}
    caught: list[Any] = []
    # record_warnings: what the strategy warned about during fit (tensor-parallel fallbacks).
    scatters: list[int] = []  # count_reduce_scatter: how often FSDP2 reduced gradients during fit, on each rank
    with patch_checkpoint_writes(job), recorded_warnings(caught, job.record_warnings), \
            counted_reduce_scatters(scatters, job.count_reduce_scatter):  # fmt: skip
        # torch_compile: fit what torch.compile returns (an OptimizedModule; our strategies compile per block).
        trainer.fit(torch.compile(model) if job.torch_compile else model, datamodule=data, ckpt_path=resume)
    if job.count_reduce_scatter:
        recorder.mem["reduce_scatters"] = len(scatters)
        recorder.mem["fsdp_groups"] = fsdp_groups(trainer.strategy)
    if job.save:
        trainer.save_checkpoint(job.save)
    recorder.mem["expert_param_bytes"] = local_bytes(p for n, p in model.named_parameters() if ".experts." in n)
    recorder.mem["expert_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}
    recorder.mem["expert_rows"] = routing.rows[0]
    mem_all: list[Any] = [recorder.mem]
    if dist.is_initialized():
        mem_all = [None] * dist.get_world_size()
        dist.all_gather_object(mem_all, recorder.mem)
    params = full_params(model)
    gather_experts(trainer, model, params)
    result: dict[str, Any] = {
        "mem_all": mem_all,
        "total_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "param_shapes": {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()},
        "losses": recorder.losses
        or [m["train_loss"] for m in (memory_logger.metrics if memory_logger else []) if "train_loss" in m],
        "ema": ema.avg if ema is not None else None,
        "probe": {"early": model.early, "after_step": model.after_step} if isinstance(model, ProbeGPT) else None,
        "prefetch": prefetch_stats(trainer.strategy),
        "compiled_blocks": sum(bool(getattr(m, "_lp_compiled", False)) for m in model.modules()),
        "batch_heads": recorder.batch_heads,
        "local_losses": recorder.local_losses,
        "grad_norms": recorder.grad_norms,
        "mem": recorder.mem,
        "params": params,
        "routing": routing.global_order() if routing in trainer.callbacks else None,
        "init_state": next((c.state for c in extra if isinstance(c, InitRecorder)), None),
        # DeepSpeed backend, meta-built model: what materialising it cost each rank (parallel/deepspeed/meta_init.py).
        "meta_init_all": gathered_objects(as_dict(getattr(trainer.strategy, "meta_init", None))),
        "layout": getattr(trainer.strategy, "parallel_layout", None),
        # The strategy's start-up lines (the pipeline's stages, tp's split and kept-whole report, ...).
        "startup": run.describe() if (run := getattr(trainer.strategy, "parallel_run", None)) is not None else [],
        # auto_parallel: the layout the planner chose and its printed top three.
        "auto": auto_choice(trainer.strategy),
        "per_rank_batch": data.batch_size,
        "ds_batch": ds_batch(trainer.strategy),
        "optim_at_start": optim_recorder.state,
        "start_step": ckpt_recorder.start_step,
        "step_params": ckpt_recorder.step_params,
        "steps_while_writing": ckpt_recorder.steps_while_writing,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "ckpt_listing_before": listing_before,
        "latest_before": found.name if found else None,
        "ckpt_listing_after": sorted(os.listdir(ckpt_dir)) if ckpt_dir and os.path.isdir(ckpt_dir) else [],
        "resumed_from": Path(trainer.ckpt_path).name if trainer.ckpt_path else None,
        "draws": getattr(model, "draws", None),
        "warnings": [str(w.message) for w in caught] if job.record_warnings else None,
        # ParallelStrategy(check_replicas_every=...): (checks run, pieces the last one compared) on each rank.
        "replica_checks": gathered_objects(
            [(len(c.seconds), c.compared) for c in trainer.callbacks if isinstance(c, ReplicaCheck)]
        ),
        # Which linear layers train in fp8 (torchao's Float8Linear), on any rank (a pipeline's stages hold theirs).
        "fp8_layers": sorted({n for names in gathered_objects(fp8_names(model)) for n in names}),
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "expert_load": monitor.expert_load if monitor is not None else None,
        "flops_per_token": monitor.flops_per_token if monitor is not None else None,
        "pictures": {k: tuple(v.shape) for k, v in monitor.last_pictures.items()} if monitor is not None else None,
        "timeline": monitor.last_pictures.get("pictures/pipeline_timeline") if monitor is not None else None,
        "monitor_metrics": monitor.last_metrics if monitor is not None else None,
        "logged": memory_logger.metrics if memory_logger is not None else None,
        "files_in_list_dir": sorted(str(p) for p in Path(job.list_dir).rglob("*") if p.is_file())
        if job.list_dir
        else None,
    }
    if isinstance(trainer.strategy, lightning_par.ParallelStrategy):
        from torchmetrics import Metric

        dp_group = trainer.strategy.meshes.dp.get_group()
        metrics = [m for m in model.modules() if isinstance(m, Metric)]
        result["metric_groups_dp"] = bool(metrics) and all(m.process_group is dp_group for m in metrics)
        # Which FSDP2 offload policy each sharded unit got (a private attribute, read only by this test).
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in trainer.strategy.model.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in units]  # type: ignore[operator]
        # Each unit's parameters in its all-gather's order, on every rank (the quantized all-gather's simulation).
        where = {id(m): n for n, m in model.named_modules()}
        run = trainer.strategy.parallel_run  # None under the DeepSpeed backend
        runner = run.pipeline if run is not None else None  # a pipeline's stage modules are its parts' roots
        roots = [m for m in (runner.model.stage_modules() if runner is not None else []) if isinstance(m, FSDPModule)]
        every = [m._get_fsdp_state()._fsdp_param_group for m in dict.fromkeys([*units, *roots])]  # type: ignore[operator]
        result["fsdp_unit_params"] = gathered_objects([
            [f"{where[id(fp._module_info.module)]}.{fp._module_info.param_name}".lstrip(".") for fp in g.fsdp_params]
            for g in every if g is not None])  # fmt: skip
        result["fsdp_units"] = len(units)
        # The shape a (2, 32, 32) hidden state travels between pipeline stages in (sequence parallelism: its shard).
        result["pipe_wire"] = runner.wire_shape((2, 32, 32)) if runner is not None else None
        # PipeDream-2BW: per rank, (weight-copy bytes held between steps, the stage's trainable bytes).
        two_bw = runner.two_bw if runner is not None else None
        result["two_bw_bytes"] = gathered_objects(two_bw.stash_bytes()) if two_bw is not None else None
        zero = getattr(trainer.strategy.parallel_run, "zero", None)
        outer = getattr(zero, "outer", None)
        result["outer_syncs"] = outer.syncs if outer is not None else None  # local SGD's synchronisations
        # ZeRO 0-2's buckets (parameter names, in reduction order): the PowerSGD simulation compresses by them.
        names = getattr(zero, "names", None)
        result["zero_buckets"] = [[names[p] for p in b.params] for b in zero.buckets] if names else None
        compression = getattr(zero, "compression", None)
        result["compressed_numel"] = (None if compression is None else
                                      (compression.state.total_numel_before_compression,
                                       compression.state.total_numel_after_compression))  # fmt: skip
        # Every rank's buckets and always-exact parameters (a pipeline's stages compress apart), for the simulation.
        # (Every rank has the same config, so all of them gather, or none: no collective for other jobs.)
        result["powersgd_ranks"] = None if compression is None else gathered_objects({
            "dp_rank": zero.rank, "buckets": result["zero_buckets"],
            "exact": sorted(names[p] for p in compression.exact)})  # fmt: skip
        # Which param groups step with torch's multi-tensor kernels (ZeRO-3 and tp switch DTensor-only groups).
        result["optimizer_foreach"] = [g.get("foreach") for g in trainer.optimizers[0].param_groups]
        # How many DTensors the optimizer steps (tp at ZeRO-0 steps plain views of the shards: none).
        result["optimizer_dtensors"] = sum(
            isinstance(p, DTensor) for g in trainer.optimizers[0].param_groups for p in g["params"]
        )
        result["offload_policies"] = sorted({type(g.offload_policy).__name__ for g in groups if g is not None})
    if getattr(getattr(trainer.strategy, "config", None), "pp", 1) > 1:
        result["params"], result["param_counts_all"], result["tied"] = _stage_params(trainer, result["params"])
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, result["optim_at_start"])
        result["optim_at_start"] = {k: v for d in states for k, v in d.items()}
        local: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(local, recorder.local_losses)
        result["local_losses_all"] = local
    if job.validate:
        result["val"] = {k: float(v) for k, v in trainer.validate(model, datamodule=data, verbose=False)[0].items()}
    if job.test:
        result["test"] = {k: float(v) for k, v in trainer.test(model, datamodule=data, verbose=False)[0].items()}
    if job.predict:
        preds = trainer.predict(model, datamodule=data)
        result["predict"] = [p.cpu() for p in preds] if preds is not None else None
    return result


def _stage_params(trainer: L.Trainer, params: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[Any]]:
    """Under a pipeline each rank holds its stages' parameters only: every rank's merged (data-parallel replicas
    agree), how many each held, and the tied weights, which have a copy on each end stage, each under its rank's
    name for it (tests/test_pipeline_tied.py). Other layouts: ``params`` as they are."""
    if getattr(getattr(trainer.strategy, "config", None), "pp", 1) <= 1:
        return params, [len(params)], []
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, params)
    pipeline = trainer.strategy.parallel_run.pipeline
    tied = pipeline.model.ownership.tied if pipeline is not None else []
    return {k: v for d in every for k, v in d.items()}, [len(d) for d in every], tied


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    jobs = check(spec["jobs"])  # every job read before the first fit: a misspelled key fails at once
    results = [run_job(job) for job in jobs]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save(results, spec["out"])
    clean_exit()


if __name__ == "__main__":
    main()
