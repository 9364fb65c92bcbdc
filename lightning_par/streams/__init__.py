"""Streaming (iterable) datasets split over the data-parallel ranks with exact resume: the dataset (`dataset`),
sources (`shards`, `parquet`), counting (`counted`) and the split (`split`)."""

from lightning_par.streams.dataset import DataParallelStream

__all__ = ["DataParallelStream"]
