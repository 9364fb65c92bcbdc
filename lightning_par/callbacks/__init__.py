"""Lightning callbacks that work with every lightning_par strategy."""

from lightning_par.callbacks.monitor import ParallelismMonitor, peak_flops_for
from lightning_par.callbacks.replicas import ReplicaCheck
from lightning_par.callbacks.step_record import StepRecord
from lightning_par.callbacks.watchdog import JobWatchdog

__all__ = ["JobWatchdog", "ParallelismMonitor", "ReplicaCheck", "StepRecord", "peak_flops_for"]
