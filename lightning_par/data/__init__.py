"""Bundled tiny text corpus and its byte-level LightningDataModule."""

from .text import ByteTextDataModule, decode, encode, load_text

__all__ = ["ByteTextDataModule", "decode", "encode", "load_text"]
