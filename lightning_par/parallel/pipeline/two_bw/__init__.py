"""PipeDream-2BW (``pp_schedule="2bw"``): pipeline steps that overlap, with two weight versions per stage
(`runtime`: the schedule and its checkpoints; `versions`: the weight versions)."""

from lightning_par.parallel.pipeline.two_bw.runtime import TWO_BW, TwoBW, restore
from lightning_par.parallel.pipeline.two_bw.versions import WeightVersion

__all__ = ["TWO_BW", "TwoBW", "WeightVersion", "restore"]
