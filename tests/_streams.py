"""Streaming training data for tests/_worker.py jobs (``stream``): the bundled corpus's windows, in order, as a plain
torch `IterableDataset` or as Hugging Face `datasets` in streaming mode over a JSON-lines file written here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_par.data import encode, load_text


def windows(seq_len: int, count: int) -> Tensor:
    """The first ``count`` training windows of ``seq_len + 1`` tokens of the bundled corpus, in order."""
    tokens = encode(load_text())
    return torch.stack([tokens[i * seq_len : (i + 1) * seq_len + 1] for i in range(count)])


class CorpusStream(IterableDataset):
    """A plain iterable dataset: ``(input, target)`` windows, read one after the other."""

    def __init__(self, seq_len: int, count: int) -> None:
        self.seq_len, self.count = seq_len, count

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for window in windows(self.seq_len, self.count):
            yield window[:-1], window[1:]


def _pairs(rows: list[dict[str, Any]]) -> tuple[Tensor, Tensor]:
    tokens = torch.stack([torch.as_tensor(r["tokens"]) for r in rows])
    return tokens[:, :-1], tokens[:, 1:]


def hf_stream(folder: Path, seq_len: int, count: int) -> Any:
    """The same windows through `datasets.load_dataset("json", streaming=True)`, from a file written here."""
    from datasets import load_dataset

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"windows_{seq_len}_{count}.jsonl"
    if not path.exists():  # every rank writes the same bytes; a rename makes the file appear whole
        tmp = path.with_suffix(f".{id(path)}.tmp")
        tmp.write_text("".join(json.dumps({"tokens": w.tolist()}) + "\n" for w in windows(seq_len, count)))
        tmp.replace(path)
    return load_dataset("json", data_files=str(path), split="train", streaming=True)


class StreamData(L.LightningDataModule):
    """A training loader over a stream: ``kind`` "torch" (`CorpusStream`) or "hf" (`hf_stream`)."""

    def __init__(self, kind: str, seq_len: int, batch_size: int, count: int, workers: int, folder: str) -> None:
        super().__init__()
        self.kind, self.seq_len, self.batch_size, self.count = kind, seq_len, batch_size, count
        self.workers, self.folder = workers, Path(folder)

    def train_dataloader(self) -> DataLoader:
        if self.kind == "hf":
            source = hf_stream(self.folder, self.seq_len, self.count)
            return DataLoader(source, batch_size=self.batch_size, num_workers=self.workers, collate_fn=_pairs)
        return DataLoader(CorpusStream(self.seq_len, self.count), batch_size=self.batch_size, num_workers=self.workers)
