"""Bundled tiny text corpus and its byte-level LightningDataModule; iterable datasets over data-parallel ranks."""

from .streaming import DataParallelStream, split_over_data_parallel
from .text import ByteTextDataModule, decode, encode, load_text

__all__ = ["ByteTextDataModule", "DataParallelStream", "decode", "encode", "load_text", "split_over_data_parallel"]
