"""Hyper-parameter sweeps of a recipe (`lightning-par sweep`, docs/tuning.md)."""

from lightning_par.tuning.space import Param, Space, SpaceError, load_space

__all__ = ["Param", "Space", "SpaceError", "load_space"]
