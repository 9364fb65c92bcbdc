"""Compressed gradient communication: PowerSGD for the data-parallel all-reduce of ZeRO 0-1 (`powersgd`)."""

from lightning_par.parallel.compression.powersgd import PowerSGD, PowerSGDSettings

__all__ = ["PowerSGD", "PowerSGDSettings"]
