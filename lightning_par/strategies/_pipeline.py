"""Lightning glue for pipeline parallelism: the strategy owns the training step when ``pp > 1``.

Lightning's loop calls ``strategy.training_step`` and then ``strategy.backward``. Under a pipeline the schedule
does both forward and backward for all microbatches, so `PipelineSteps.training_step` runs the whole schedule
(the user's ``training_step`` once per microbatch, as each stage's step function) and returns the batch loss, and
the strategy's ``backward`` runs Lightning's backward hooks without a second backward, handing over the gradients
the schedule computed (`PipelineSteps.hand_gradients`) between them.

Only the last stage computes the loss and reaches the user's ``self.log`` calls after the trunk. Those calls are
captured per microbatch, reduced over microbatches with their ``reduce_fx`` (the mean of equal-size
microbatches' mean losses is the batch's mean loss), broadcast from the last stage to every rank of the pipeline
group and then logged for real on every rank, so global rank 0's loggers and progress bar see the last stage's
values and ``sync_dist`` reductions over data-parallel ranks run on every rank alike. torchmetrics objects the
last stage updated have their state broadcast too before they are logged.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_par import _compat
from lightning_par.parallel.pipeline.schedule import PipelineRunner
from lightning_par.parallel.pipeline.stages import StageSpec

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_LOG_NAMES = tuple(_LOG_SIGNATURE.parameters)[1:]  # after ``self``
_LOG_KNOWN = frozenset(_LOG_NAMES)
_LOG_DEFAULTS = {n: p.default for n, p in _LOG_SIGNATURE.parameters.items() if p.default is not p.empty}
_LOG_REQUIRED = set(_LOG_NAMES) - set(_LOG_DEFAULTS)  # name, value
# The fast path below maps positional arguments by position: only if every parameter can be given both ways.
_LOG_PLAIN = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in _LOG_SIGNATURE.parameters.values())
_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}


def _to(obj: Any, device: torch.device) -> Any:
    return _compat.tree_map_only(Tensor, lambda t: t.detach().to(device), obj)


class PipelineSteps:
    """Training, evaluation and backward steps of a `ParallelStrategy` whose config has ``pp > 1``.

    Args:
        runner: the pipeline runner built by `lightning_par.parallel.compose.parallelize` (its ``group`` is the
            pipeline process group).
    """

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner
        self.group = runner.group
        self._fresh: list[tuple[torch.nn.Parameter, Optional[Tensor]]] = []
        self._logs: list[tuple[str, Any, dict[str, Any]]] = []

    # ---- training --------------------------------------------------------------------------------------------
    def training_step(self, module: pl.LightningModule, precision: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the schedule over the batch; return the batch loss (the same on every rank of the pipeline)."""
        if not module.automatic_optimization:
            raise NotImplementedError(
                "manual optimization (automatic_optimization=False) is not supported under pipeline parallelism: the "
                "schedule runs backward itself; use automatic optimization or pp=1"
            )
        batch, rest = args[0], args[1:]
        trainer = module.trainer
        if self.runner.two_bw is not None:
            _check_two_bw(trainer, precision)
        scale = self.runner.microbatches * trainer.accumulate_grad_batches
        scaler = getattr(precision, "scaler", None)
        outputs: list[Any] = []

        def step_fn(microbatch: Any, spec: StageSpec) -> Optional[Tensor]:
            out = self._call(module, "training_step", spec, microbatch, *rest, **kwargs)
            if not spec.is_last:
                return None  # not reached: the stage ends at its last block
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, Tensor):
                raise TypeError(
                    "under pipeline parallelism training_step must return the loss (a tensor or a dict with 'loss') "
                    f"on every microbatch; got {type(out).__name__}"
                )
            outputs.append(out)
            return loss.float()

        def loss_fn(loss: Tensor) -> Tensor:
            # Lightning divides by accumulate_grad_batches before its backward; the schedule's backward replaces it.
            loss = loss / scale
            return scaler.scale(loss) if scaler is not None else loss

        self._logs.clear()
        # Lightning zeroes gradients after training_step and before backward (its closure), and the schedule's
        # backward has already run by then: set earlier gradients aside, keep this step's, and hand them back in
        # `backward`, as if autograd had run there.
        params = [p for p in module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self.runner.train_step(batch, step_fn, loss_fn)
        finally:
            self._fresh = [(p, p.grad) for p in params]
            for p, g in zip(params, earlier):
                p.grad = g
        result: Optional[dict[str, Any]] = None
        if self.runner.is_last:
            losses = torch.stack([(o["loss"] if isinstance(o, dict) else o).detach().float() for o in outputs])
            extra = {k: v for o in outputs[-1:] if isinstance(o, dict) for k, v in o.items() if k != "loss"}
            result = {"loss": losses.mean(), "extra": extra}
        result = self._publish(module, result)
        return {"loss": result["loss"], **result["extra"]} if result["extra"] else result["loss"]

    def hand_gradients(self) -> None:
        """Add the gradients the schedule's backward computed (kept apart in `training_step`) to the parameters': the
        strategy calls it where Lightning's loop runs the backward, between its hooks."""
        for p, g in self._fresh:
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._fresh = []

    # ---- evaluation ------------------------------------------------------------------------------------------
    def eval_step(self, module: pl.LightningModule, hook: str, *args: Any, **kwargs: Any) -> Any:
        """``validation_step`` / ``test_step`` / ``predict_step`` through the pipeline, forward only.

        Returns what the last stage's step returned, broadcast to every rank of the pipeline group: for
        ``predict_step`` the microbatches' outputs joined along dim 0 (the batch's predictions), otherwise the
        last microbatch's output.
        """
        batch, rest = args[0], args[1:]
        outputs: list[Any] = []

        def step_fn(microbatch: Any, spec: StageSpec) -> Optional[Tensor]:
            out = self._call(module, hook, spec, microbatch, *rest, **kwargs)
            if spec.is_last:
                outputs.append(out)
            return None

        self._logs.clear()
        self.runner.eval_step(batch, step_fn)
        joined = _join(outputs) if hook == "predict_step" else (outputs[-1] if outputs else None)
        result = {"loss": None, "extra": joined} if self.runner.is_last else None
        return self._publish(module, result)["extra"]

    # ---- the user's code and its logs ------------------------------------------------------------------------
    def _call(self, module: pl.LightningModule, hook: str, spec: StageSpec, *args: Any, **kwargs: Any) -> Any:
        capture = spec.is_last

        def log(*a: Any, **k: Any) -> None:
            if capture:
                call = _log_arguments(module, a, k)
                self._logs.append((call.pop("name"), call.pop("value"), call))

        module.log = log  # type: ignore[method-assign]
        try:
            return getattr(module, hook)(*args, **kwargs)
        finally:
            del module.log

    def _publish(self, module: pl.LightningModule, result: Optional[dict[str, Any]]) -> dict[str, Any]:
        """Broadcast the last stage's result and logs over the pipeline group; log them on every rank."""
        src = self.runner.last_stage_rank
        device = self.runner.model.device
        payload: list[Any] = [None]
        if dist.get_rank() == src:
            metric_names = {id(m): n for n, m in module.named_modules() if isinstance(m, Metric)}
            logs = _reduce_logs(self._logs, metric_names)
            names = {v for _, v, _ in logs if isinstance(v, str)}
            metrics = {n: _compat.metric_state(cast(Metric, module.get_submodule(n))) for n in names}
            payload = [_to({"result": result, "logs": logs, "metrics": metrics}, torch.device("cpu"))]
        dist.broadcast_object_list(payload, src=src, group=self.group)
        data = _to(payload[0], device)
        for name, state in data["metrics"].items():
            _compat.set_metric_state(cast(Metric, module.get_submodule(name)), state)
        for name, value, kwargs in data["logs"]:
            if isinstance(value, str):  # a Metric, by its module name
                value = module.get_submodule(value)
            pl.LightningModule.log(module, name, value, **kwargs)
        self._logs.clear()
        return data["result"]


def _check_two_bw(trainer: pl.Trainer, precision: Any) -> None:
    """What PipeDream-2BW cannot run, before its first step: its microbatches are the accumulation, and a loss scale
    that changes between a microbatch's forward and its backward one step later would unscale it wrongly."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"pp_schedule='2bw' with accumulate_grad_batches={trainer.accumulate_grad_batches}: the schedule's "
            "microbatches already accumulate; set accumulate_grad_batches=1 and raise microbatches instead"
        )
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(
            "pp_schedule='2bw' with fp16 loss scaling: a microbatch's backward runs one step after its forward, "
            "across a change of scale; use precision='bf16-mixed' or '32-true'"
        )


def _log_arguments(module: pl.LightningModule, a: tuple, k: dict[str, Any]) -> dict[str, Any]:
    """``LightningModule.log``'s arguments by name, defaults filled in: what ``Signature.bind`` gives, in ~4 us
    instead of ~60 (it runs for every logged value of every microbatch on the last stage)."""
    given = dict(zip(_LOG_NAMES, a))
    if _LOG_PLAIN and len(a) <= len(_LOG_NAMES) and given.keys().isdisjoint(k):
        given.update(k)
        if _LOG_REQUIRED <= given.keys() <= _LOG_KNOWN:
            return {**_LOG_DEFAULTS, **given}
    bound = _LOG_SIGNATURE.bind(module, *a, **k)  # any other call, and the TypeError a wrong one deserves
    bound.apply_defaults()
    call = dict(bound.arguments)
    call.pop("self")
    return call


def _join(outputs: list[Any]) -> Any:
    """Microbatch outputs of one structure joined into the batch's: tensors concatenated along dim 0."""
    if not outputs:
        return None
    flat = [_compat.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        return outputs
    leaves = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        leaves.append(torch.cat(column) if isinstance(first, Tensor) and first.dim() > 0 else first)
    return _compat.tree_unflatten(leaves, spec)


def _reduce_logs(
    logs: list[tuple[str, Any, dict[str, Any]]], metric_names: dict[int, str]
) -> list[tuple[str, Any, dict[str, Any]]]:
    """One entry per logged name: microbatch values reduced with the call's ``reduce_fx``."""
    by_name: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    for name, value, kwargs in logs:
        by_name.setdefault(name, ([], kwargs))[0].append(value)
    out: list[tuple[str, Any, dict[str, Any]]] = []
    for name, (values, kwargs) in by_name.items():
        last = values[-1]
        if isinstance(last, Metric):
            if id(last) not in metric_names:
                raise ValueError(f"self.log({name!r}, metric) under pipeline parallelism needs the metric to be an "
                                 "attribute of the LightningModule")  # fmt: skip
            out.append((name, metric_names[id(last)], kwargs))
            continue
        fx: Any = kwargs.get("reduce_fx", "mean")
        reduce: Any = _REDUCE.get(fx, fx) if isinstance(fx, str) else fx
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32).detach().float() for v in values])
        out.append((name, reduce(stacked), kwargs))
    return out
