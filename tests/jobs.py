"""What one training job of `tests/_worker.py` is: a `Job`, one typed field per option, with the defaults the
worker uses. Tests write jobs as plain dicts (the wire format: JSON in the spec file a rank reads); `Job.from_dict`
turns one into a `Job` and refuses a key that is no field, naming the closest field, so a misspelled option fails
instead of being ignored. `launch.run_jobs` and `launch.write_spec` check every job in the test process, before any
rank starts, and the worker converts each job again when it reads the spec. The annotations document the types; they
are not enforced at run time."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union


class UnknownJobKey(ValueError):
    """A job dict holds a key that is no `Job` field (a misspelled option)."""


@dataclass(frozen=True)
class Job:
    """One fit (tests/_worker.py's `run_job`). A field left ``None`` where the worker derives it says so."""

    # What trains, and how.
    model: str = "gpt"  # a key of tests/_job_models.py's MODELS
    strategy: Union[str, dict[str, Any]] = "auto"  # a registered name, or kwargs for `make_strategy`
    precision: Union[str, int] = "32-true"
    seed: int = 0
    steps: int = 3  # optimizer steps, and the epoch's length unless epoch_steps says otherwise
    max_steps: Optional[int] = None  # None: steps
    max_epochs: Optional[int] = None
    epoch_steps: Optional[int] = None  # optimizer steps per epoch (None: steps)
    global_batch: int = 8
    seq_len: int = 32
    accumulate: int = 1
    clip: Optional[float] = None  # gradient_clip_val
    # Where it runs: under torchrun WORLD_SIZE is set; when Lightning starts the processes itself the job states it.
    world: Optional[int] = None  # None: WORLD_SIZE (1 when unset)
    dp: Optional[int] = None  # data-parallel ranks the global batch is split over (None: world)
    devices: Optional[Union[int, str, list[int]]] = None  # None: world // num_nodes
    num_nodes: int = 1
    # Streaming training data (tests/_streams.py).
    stream: Optional[str] = None  # "torch", "hf", "hf_parquet", "litdata", "sharded_ref:...", ...
    stream_samples: Optional[int] = None  # None: global_batch * accumulate * epoch_steps
    workers: int = 0
    stream_dir: str = "."
    # Checkpoints (see tests/_worker.py's `_checkpoint_callbacks`).
    ckpt_dir: Optional[str] = None  # enables checkpointing; one per epoch unless ckpt_every_n_steps
    ckpt_every_n_steps: Optional[int] = None
    save_top_k: int = -1
    save_last: bool = False
    ckpt_epoch_end_dir: Optional[str] = None  # also one per epoch there (with ckpt_every_n_steps)
    resume: Optional[str] = None  # a path, "last" (Lightning's) or "latest" (lightning_par.checkpoint.latest)
    save: Optional[str] = None  # trainer.save_checkpoint(save) after the fit
    hf_from_pretrained: Optional[str] = None  # the model's weights from this Hugging Face folder
    list_dir: Optional[str] = None  # the result lists the files under it
    # Evaluation.
    validate: bool = False
    test: bool = False
    predict: bool = False
    limit_val_batches: Union[int, float] = 2
    num_sanity_val_steps: int = 0
    # Faults and checkpoint-writing hooks (tests/_job_hooks.py).
    fail_at_step: Optional[int] = None  # rank 1 raises at this batch
    sigkill_at_step: Optional[dict[str, int]] = None  # {"step", "rank"}
    sigkill_in_save: Optional[dict[str, int]] = None  # {"nth", "rank"}
    # {"step", "rank", "name"}: that rank adds 1e-3 to the first element of its copy of parameter ``name`` when
    # that global step starts (a replica drifting: tests/test_replica_check.py)
    corrupt: Optional[dict[str, Any]] = None
    # {"kind", "rank", "step"}: that rank hangs the job at that global step: "skip_send" (its next pipeline send is
    # never posted), "skip_all_gather" (its next all-gather is never issued), "stall_loader" (its data
    # loader blocks fetching that step's batch); tests/test_watchdog.py
    hang: Optional[dict[str, Any]] = None
    replica_callback: Optional[int] = None  # a ReplicaCheck(every_n_steps=this) in the Trainer's callbacks
    write_after_next_step: bool = False
    slow_staging_s: float = 0.0
    expect_error: bool = False  # the fit's exception is returned as ``error`` instead of failing the spawn
    # What else is recorded or switched on.
    record_optim: bool = False  # the optimizer state at train start (after a resume)
    record_warnings: bool = False  # the fit's warnings, as ``warnings``
    record_init: bool = False
    record_step_params: bool = False
    count_reduce_scatter: bool = False
    rank_seed: bool = False  # per-rank RNG seeds
    ema: bool = False
    quiet: bool = False  # no callback of ours in the batch hooks: losses come from the logger
    memory_logger: bool = False
    expert_load: bool = False  # a ParallelismMonitor drawing pictures every step
    no_routing: bool = False  # no RoutingRecorder (under a pipeline it cannot reassemble the routing)
    empty_init: bool = False  # the model built under trainer.init_module(empty_init=True)
    torch_compile: bool = False  # fit what torch.compile returns
    lightning_fp16_reference: bool = False  # Lightning's fp16 AMP with a CPU GradScaler (the 16-mixed reference)
    # Local SGD simulated in one process (tests/_local_sgd_sim.py): {replicas, shards, every, lr, momentum}.
    simulate: Optional[dict[str, float]] = None
    # PowerSGD simulated in one process (tests/_powersgd_sim.py): {dp, rank, start, stages}.
    simulate_powersgd: Optional[dict[str, Any]] = None
    # ZeRO-3's int8 weight all-gather simulated in one process (tests/_quantized_sim.py): {world, units}.
    simulate_quantized: Optional[dict[str, Any]] = None
    # PipeDream-2BW's one-step-delayed update simulated in one process (tests/_two_bw_sim.py): {dp}.
    simulate_two_bw: Optional[dict[str, Any]] = None

    # fp8 (tests/test_fp8.py): the one-process reference converts its trunk's linear layers with torchao itself
    # (`_job_callbacks.TorchaoFp8`), and reads each global batch as ``rank_order`` sub-batches in the order the
    # data-parallel ranks read them (each sub-batch then has the activation scales that rank's has).
    torchao_fp8: Union[bool, list[str]] = False  # True: the test rule; a list: exactly these layers (tools/zoo.py)
    rank_order: int = 1

    @classmethod
    def from_dict(cls, job: Mapping[str, Any]) -> Job:
        """The `Job` a dict describes; raises `UnknownJobKey` naming each key that is no field and the closest one."""
        unknown = [key for key in job if key not in FIELDS]
        if unknown:
            raise UnknownJobKey("; ".join(_explain(key) for key in unknown) + f" (job: {dict(job)!r})")
        return cls(**job)


def _explain(key: Any) -> str:
    close = difflib.get_close_matches(str(key), sorted(FIELDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown job key {key!r}{hint}"


FIELDS = frozenset(f.name for f in dataclasses.fields(Job))


def check(jobs: Iterable[Mapping[str, Any]]) -> list[Job]:
    """Every job of ``jobs`` as a `Job` (so a misspelled key fails here, before any rank starts)."""
    return [Job.from_dict(job) for job in jobs]
