"""The checks of `lightning_par.config.ParallelConfig` for the techniques beside the mesh degrees (local SGD,
compressed communication, fp8), apart so that the config itself stays one screen of fields and degree rules."""

from __future__ import annotations

from typing import Optional, Union

FP8_MODES = (False, True, "emulate")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run; the message names the fix."""


class TechniqueChecks:
    """Mixin of `ParallelConfig`: validation of the technique fields, run by its ``__post_init__``."""

    pp: int
    tp: int
    cp: int
    ep: int
    dp_replicate: int
    zero_stage: int
    auto_dims: Optional[tuple[str, ...]]
    sync_every: Optional[int]
    outer_lr: float
    outer_momentum: float
    grad_compression: Optional[str]
    compression_rank: int
    compression_start: int
    zero_quantized_weights: bool
    fp8: Union[bool, str]
    pp_schedule: str
    compile: bool

    def _check_local_sgd(self) -> None:
        if self.sync_every is None:
            return
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise ParallelConfigError(f"sync_every={self.sync_every!r} must be an int >= 1 (steps between syncs)")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ParallelConfigError(
                f"outer_lr={self.outer_lr} must be > 0 and outer_momentum={self.outer_momentum} in [0, 1); DiLoCo "
                "uses 0.7 and 0.9"
            )
        for axis, why in (("pp", "a pipeline's stages would each need the outer loop of its own parameters"),
                          ("ep", "experts are sharded over the data-parallel ranks, not replicated")):  # fmt: skip
            if self.uses(axis):
                raise ParallelConfigError(
                    f"sync_every={self.sync_every} with {self._degree(axis)}: local SGD is not supported there "
                    f"({why}); drop sync_every, or train without {axis}"
                )
        if self.zero_stage > 2:
            raise ParallelConfigError(
                f"sync_every={self.sync_every} with zero_stage=3: local SGD runs on the ZeRO 0-2 engine; use "
                "zero_stage=1 or 2 inside each replica (dp_shard), or drop sync_every"
            )
        if self.dp_replicate == 1:
            raise ParallelConfigError(
                f"sync_every={self.sync_every} synchronises the dp_replicate replicas, but dp_replicate=1; set "
                "dp_replicate to the number of replicas (e.g. one per node, ZeRO inside it over dp_shard)"
            )

    def _check_compression(self) -> None:
        if not isinstance(self.zero_quantized_weights, bool):
            raise ParallelConfigError(f"zero_quantized_weights={self.zero_quantized_weights!r} must be True or False")
        if self.zero_quantized_weights:
            other = [self._degree(a) for a in ("tp", "cp", "ep") if self.uses(a)]
            if self.zero_stage != 3 or other:
                raise ParallelConfigError(
                    f"zero_quantized_weights=True quantizes ZeRO-3's weight all-gather, with or without a pipeline; "
                    f"here zero_stage={self.zero_stage}{''.join(', ' + o for o in other)}: use zero_stage=3 without "
                    "tp, cp and ep, or drop zero_quantized_weights"
                )
        if self.grad_compression is None:
            return
        if self.grad_compression != "powersgd":
            raise ParallelConfigError(f"grad_compression={self.grad_compression!r} is unknown; use None or 'powersgd'")
        for name, low in (("compression_rank", 1), ("compression_start", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ParallelConfigError(f"{name}={value!r} must be an int >= {low} (error feedback needs 2 steps)")
        if self.zero_stage > 1:
            raise ParallelConfigError(
                f"grad_compression='powersgd' with zero_stage={self.zero_stage}: PowerSGD compresses an all-reduce, "
                "and ZeRO-2/3 reduce-scatter gradients into shards; use zero_stage=0 or 1 (strategy 'ddp' or "
                "'zero1'), or drop grad_compression"
            )
        other = [self._degree(a) for a in ("tp", "cp", "ep") if self.uses(a)]
        if other or self.sync_every is not None:
            raise ParallelConfigError(
                f"grad_compression='powersgd' runs on data parallelism (ZeRO 0-1, hybrid too), with or without a "
                f"pipeline; {', '.join(other) or f'sync_every={self.sync_every}'} is not supported with it: drop "
                "grad_compression, or train without those dimensions"
            )

    def _check_fp8(self) -> None:
        if self.fp8 not in FP8_MODES or not isinstance(self.fp8, (bool, str)):
            raise ParallelConfigError(f"fp8={self.fp8!r} must be False, True (fp8 matmuls) or 'emulate'")
        if self.fp8 and self.zero_quantized_weights:
            raise ParallelConfigError(
                f"fp8={self.fp8!r} with zero_quantized_weights=True: both replace ZeRO-3's weight all-gather (fp8 "
                "gathers the fp8 layers' weights already cast, one byte per element); drop zero_quantized_weights"
            )

    def _check_two_bw(self) -> None:
        """PipeDream-2BW (`lightning_par.parallel.pipeline.two_bw`) swaps each stage's parameters for its weight
        versions: plain tensors only, updated by the ZeRO 0-1 engine."""
        if self.pp_schedule != "2bw":
            return
        other = [self._degree(a) for a in ("tp", "cp", "ep") if self.uses(a)]
        other += [f"zero_stage={self.zero_stage}"] if self.zero_stage > 1 else []
        other += [f"{name}={getattr(self, name)!r}" for name in ("compile", "fp8", "grad_compression")
                  if getattr(self, name)]  # fmt: skip
        if self.pp == 1 and "pp" not in (self.auto_dims or ()):
            raise ParallelConfigError("pp_schedule='2bw' is a pipeline schedule; set pp >= 2 or drop pp_schedule")
        if other:
            raise ParallelConfigError(
                f"pp_schedule='2bw' with {', '.join(other)}: PipeDream-2BW keeps two versions of each stage's weights "
                "as plain tensors, stepped by the ZeRO 0-1 engine; train it with pp and data parallelism "
                "(strategy 'pipe' or 'pipe_zero1'), or use pp_schedule='1f1b' for this layout"
            )

    def uses(self, axis: str) -> bool:
        """Whether the layout has more than one rank along ``axis``, or leaves it to the world size (a name)."""
        named = {"dp": ("dp_shard", "dp_replicate")}.get(axis, (axis,))
        return any(getattr(self, a) > 1 for a in named) or axis in (self.auto_dims or ())

    def _degree(self, axis: str) -> str:
        return f"{axis}={getattr(self, axis)}" if axis not in (self.auto_dims or ()) else f"{axis} from the world size"

