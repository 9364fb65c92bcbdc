"""Streaming training data for tests/_worker.py jobs (``stream``): the bundled corpus's windows, in order, as a plain
torch `IterableDataset`, as Hugging Face `datasets` in streaming mode over a JSON-lines file written here, or as a
`litdata.StreamingDataset` over chunks written here (read shard by shard, through a per-rank local cache)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
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


class OrderedStream(CorpusStream):
    """The windows in a given order: the reference of a sharded stream's global batches (`sharded_order`)."""

    def __init__(self, seq_len: int, count: int, order: Sequence[int]) -> None:
        super().__init__(seq_len, count)
        self.order = list(order)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        data = windows(self.seq_len, self.count)
        for i in self.order:
            yield data[i][:-1], data[i][1:]


def sharded_order(count: int, dp: int, workers: int, batch: int) -> list[int]:
    """The samples of the global batches of a sharded stream of ``count`` samples read by ``dp`` ranks x ``workers``
    loader workers (docs/data.md): range ``r x W + w`` of the equal cut is worker ``w`` of rank ``r``'s; step ``k``
    of each rank takes the next batch of worker ``k mod W``; the global batch is rank 0's batch, then rank 1's, ..."""
    slots = dp * max(workers, 1)
    quota = count // slots // batch * batch
    order = []
    for k in range(slots * quota // batch // dp):
        for rank in range(dp):
            w = k % max(workers, 1)
            first = (rank * max(workers, 1) + w) * quota + (k // max(workers, 1)) * batch
            order.extend(range(first, first + batch))
    return order


# `hf_parquet_stream`: the windows in 4 Parquet files of unequal lengths; 2 data-parallel ranks read files 0-1
# (windows 0-11) and 2-3 (windows 12-31), so rank 0's pass ends after 3 batches of 4.
PARQUET_FILES = (7, 5, 10, 10)


def hf_parquet_stream(folder: Path, seq_len: int) -> Any:
    """The first 32 windows through `datasets.load_dataset("parquet", streaming=True)` over `PARQUET_FILES`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_dataset

    data = windows(seq_len, sum(PARQUET_FILES))
    files, first = [], 0
    for i, n in enumerate(PARQUET_FILES):
        files.append(folder / f"part-{i}.parquet")
        if not files[-1].exists():  # every rank writes the same bytes; a rename makes the file appear whole
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f"part-{i}.{os.getpid()}.tmp"
            pq.write_table(pa.table({"tokens": [w.tolist() for w in data[first : first + n]]}), tmp)
            tmp.replace(files[-1])
        first += n
    return load_dataset("parquet", data_files=[str(f) for f in files], split="train", streaming=True)


def hf_parquet_order(steps: int) -> list[int]:
    """The global batches of `hf_parquet_stream` on 2 ranks x 4 per rank: rank 0's batch (windows 0-11, 3 batches a
    pass), then rank 1's (windows 12-31); every pass ends after 3 steps, when rank 0's files end."""
    order = []
    for step in range(steps):
        k = step % 3
        order += list(range(4 * k, 4 * k + 4)) + list(range(12 + 4 * k, 12 + 4 * k + 4))
    return order


CHUNK = 4  # samples per litdata chunk


def litdata_stream(folder: Path, seq_len: int, count: int) -> Any:
    """The windows as a `litdata.StreamingDataset` over chunks of `CHUNK` samples written here, read through a
    ``local:`` URL, so each rank copies the chunks it reads into its own cache folder ``cache_rank<R>``."""
    import litdata
    from litdata.streaming.resolver import Dir
    from litdata.streaming.writer import BinaryWriter

    chunks = folder / f"litdata_{seq_len}_{count}"
    if not chunks.exists():  # every rank writes the same chunks; a rename makes the folder appear whole
        tmp = folder / f"litdata.{os.getpid()}.tmp"
        tmp.mkdir(parents=True)
        # One writer per rank, each alone: litdata's writer would otherwise see the process group, name its chunks
        # by rank and wait in merge() for the other ranks' index in the same folder.
        with _env(WORLD_SIZE="1", GLOBAL_RANK="0"):
            writer = BinaryWriter(str(tmp), chunk_size=CHUNK)
            for i, window in enumerate(windows(seq_len, count)):
                writer[i] = {"tokens": window}
            writer.done()
            writer.merge()
        with contextlib.suppress(OSError):  # another rank was first
            tmp.rename(chunks)
        shutil.rmtree(tmp, ignore_errors=True)
    cache = folder / f"cache_rank{os.environ.get('RANK', '0')}"
    # litdata asks PyPI for a newer version when a dataset is built; a proxy that refuses keeps the test offline.
    with _env(HTTPS_PROXY="http://127.0.0.1:9"):
        return litdata.StreamingDataset(Dir(path=str(cache), url=f"local:{chunks}"))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _litdata_pairs(rows: list[dict[str, Any]]) -> tuple[Tensor, Tensor]:
    tokens = torch.stack([r["tokens"] for r in rows])
    return tokens[:, :-1], tokens[:, 1:]


class StreamData(L.LightningDataModule):
    """A training loader over a stream: ``kind`` "torch" (`CorpusStream`), "hf" (`hf_stream`), "hf_parquet"
    (`hf_parquet_stream`), "hf_parquet_ref" (its 2-rank global batches in one process), "litdata"
    (`litdata_stream`) or "sharded_ref:<dp>:<workers>:<per-rank batch>" (the global batches of a sharded stream
    read by that layout, in one process: `sharded_order`)."""

    def __init__(self, kind: str, seq_len: int, batch_size: int, count: int, workers: int, folder: str) -> None:
        super().__init__()
        self.kind, self.seq_len, self.batch_size, self.count = kind, seq_len, batch_size, count
        self.workers, self.folder = workers, Path(folder)

    def train_dataloader(self) -> DataLoader:
        if self.kind == "litdata":
            source = litdata_stream(self.folder, self.seq_len, self.count)
            return DataLoader(source, batch_size=self.batch_size, num_workers=self.workers, collate_fn=_litdata_pairs)
        if self.kind == "hf_parquet":
            source = hf_parquet_stream(self.folder / "parquet", self.seq_len)
            return DataLoader(source, batch_size=self.batch_size, num_workers=self.workers, collate_fn=_pairs)
        if self.kind == "hf_parquet_ref":  # one process: the global batches of hf_parquet on 2 ranks
            order = hf_parquet_order(self.count // 8)
            return DataLoader(OrderedStream(self.seq_len, sum(PARQUET_FILES), order), batch_size=self.batch_size)
        if self.kind.startswith("sharded_ref"):  # "sharded_ref:<dp>:<workers>:<per-rank batch>", one process
            dp, workers, batch = (int(v) for v in self.kind.split(":")[1:])
            order = sharded_order(self.count, dp, workers, batch)
            return DataLoader(OrderedStream(self.seq_len, self.count, order), batch_size=self.batch_size)
        if self.kind == "hf":
            source = hf_stream(self.folder, self.seq_len, self.count)
            return DataLoader(source, batch_size=self.batch_size, num_workers=self.workers, collate_fn=_pairs)
        return DataLoader(CorpusStream(self.seq_len, self.count), batch_size=self.batch_size, num_workers=self.workers)
