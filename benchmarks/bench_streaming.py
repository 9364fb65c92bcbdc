"""Per-rank throughput of the streaming loaders (whole-stream and sharded) against the map-style loader, same samples.

    python benchmarks/bench_streaming.py [--quick]

One process plays data-parallel rank 0 of ``--dp`` ranks (no process group is needed to read data): the map-style
loader is a `DataLoader` over the corpus windows with the `DistributedSampler(num_replicas=dp, rank=0)` Lightning
inserts; the streaming one reads the same windows in order, wrapped the way the strategies wrap it. Two sources: in-
memory windows (a `TensorDataset` against an `IterableDataset` over the same tensor: what the wrapper costs),
Hugging Face `datasets` over a local JSON-lines file (Arrow map-style against streaming mode) and over 8 Parquet
files (Arrow map-style against streaming mode read shard by shard: `CountedShardStream`), the in-memory windows
as a sharded source (shards of 64 windows, read shard by shard: `lightning_par.streams.shards`) and a
`litdata.StreamingDataset` over chunks of the windows (indexed through a map-style wrapper against read chunk by
chunk; the rounds read litdata from a warm cache, and the chunks rank 0 copies into its cache from cold are counted
once per loader). Both loaders of a pair yield the same number of batches of the same size. Rounds alternate the
order (ABBA); the figure is the median over rounds of the per-round ratio of samples per second (streaming / map-
style). A hand- run benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from lightning_par.data import encode, load_text
from lightning_par.streams.counted import CountedShardStream, counted_shards_of
from lightning_par.streams.split import split_over_data_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _streams import _litdata_pairs, _pairs, hf_stream, litdata_stream, windows


class _Rows(IterableDataset):
    """The same windows as the map-style dataset, yielded in order: the stream's source costs what indexing does."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for row in self.w:
            yield row[:-1], row[1:]


class _ShardedRows(_Rows):
    """The windows as a sharded source: shards of ``size`` consecutive windows, read shard by shard."""

    def __init__(self, w: torch.Tensor, size: int = 64) -> None:
        super().__init__(w)
        self.size = size

    def shard_lengths(self) -> list[int]:
        return [min(self.size, len(self.w) - i) for i in range(0, len(self.w), self.size)]

    def read_shard(self, index: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for row in self.w[index * self.size + start : (index + 1) * self.size]:
            yield row[:-1], row[1:]


class _Indexed(Dataset):
    """A litdata dataset read by index: the map-style baseline of the same reads."""

    def __init__(self, source: Any) -> None:
        self.source, self.length = source, sum(e - s for s, e in source.region_of_interest)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.source[i]


def _parquet_files(folder: Path, seq: int, count: int, files: int = 8) -> list[str]:
    """The windows in ``files`` Parquet files of equal length (written once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    w, paths = windows(seq, count), []
    for i in range(files):
        paths.append(str(folder / f"part-{i}.parquet"))
        if not Path(paths[-1]).exists():
            rows = w[i * count // files : (i + 1) * count // files]
            pq.write_table(pa.table({"tokens": [r.tolist() for r in rows]}), paths[-1])
    return paths


def _loader(kind: str, stream: bool, folder: Path, args: argparse.Namespace, count: int) -> DataLoader:
    """rank 0's loader: map-style with the DistributedSampler Lightning inserts, or the stream split as the
    strategies split it. ``kind``: "torch" (in-memory windows) or "hf" (`datasets` over a JSON-lines file: Arrow
    map-style, or streaming)."""
    batch, dp, workers = args.batch, args.dp, args.workers
    if kind == "hf":
        hf_stream(folder, args.seq, count)  # writes the file once
        from datasets import load_dataset

        path = str(folder / f"windows_{args.seq}_{count}.jsonl")
        dataset: Any = load_dataset("json", data_files=path, split="train", streaming=stream)
        collate: Any = _pairs
    elif kind == "hf_shards":  # `datasets` over 8 Parquet files: Arrow map-style, or streaming read shard by shard
        from datasets import load_dataset

        files = _parquet_files(folder / "parquet", args.seq, count)
        dataset = load_dataset("parquet", data_files=files, split="train", streaming=stream)
        collate = _pairs
        if stream:  # what a Trainer's training loader gets (the per-step end agreement is the strategy's)
            loader = DataLoader(CountedShardStream(dataset, counted_shards_of(dataset), 0, dp, batch),
                                batch_size=batch, num_workers=workers, collate_fn=collate)  # fmt: skip
            return loader
    elif kind == "litdata":
        source = litdata_stream(folder, args.seq, count)
        dataset, collate = (source if stream else _Indexed(source)), _litdata_pairs
    else:
        w = windows(args.seq, count)
        rows = _ShardedRows(w) if kind == "sharded" else _Rows(w)
        dataset, collate = (rows if stream else TensorDataset(w[:, :-1], w[:, 1:])), None
    if stream:
        loader = DataLoader(dataset, batch_size=batch, num_workers=workers, collate_fn=collate)
        split_over_data_parallel(loader, 0, dp)
        return loader
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=0, shuffle=False, drop_last=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True, num_workers=workers,
                      collate_fn=collate)  # fmt: skip


def _rate(loader: DataLoader) -> tuple[float, int]:
    start, samples = time.perf_counter(), 0
    for x, _ in loader:
        samples += len(x)
    return samples / (time.perf_counter() - start), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, fewer samples")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    count = len(encode(load_text())) // args.seq - 1
    if args.quick:
        args.rounds, count = 2, min(count, 512)
    rows: dict[str, list[float]] = {}
    cached: dict[str, str] = {}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # litdata's cache thread
        for which in ("map", "stream"):  # litdata from a cold cache: the chunks rank 0 copies into its cache
            folder = Path(tmp) / f"cold_{which}"
            _rate(_loader("litdata", which == "stream", folder, args, count))
            chunks = len(list((folder / f"litdata_{args.seq}_{count}").glob("chunk-*.bin")))
            cached[which] = f"{len(list((folder / 'cache_rank0').rglob('chunk-*.bin')))} of {chunks}"
        _rate(_loader("litdata", False, Path(tmp), args, count))  # the rounds below read from a warm cache
        for kind in ("torch", "hf", "sharded", "hf_shards", "litdata"):
            ratios, rates = [], []
            for r in range(args.rounds):
                order = ("map", "stream") if r % 2 == 0 else ("stream", "map")
                got: dict[str, Any] = {}
                for which in order:
                    loader = _loader(kind, which == "stream", Path(tmp), args, count)
                    got[which] = _rate(loader)
                # A sharded pass drops what does not fill every worker's last batch: with workers, a few more.
                sharded = kind in ("sharded", "hf_shards", "litdata")
                slack = args.dp * max(args.workers, 1) * args.batch if sharded else 1
                if abs(got["map"][1] - got["stream"][1]) >= slack:
                    raise RuntimeError(f"{kind}: map-style read {got['map'][1]} samples, stream {got['stream'][1]}")
                ratios.append(got["stream"][0] / got["map"][0])
                rates.append(got["stream"][0])
            rows[kind] = [statistics.median(ratios), min(ratios), max(ratios), statistics.median(rates)]
    print(json.dumps({"dp": args.dp, "samples_per_rank_per_pass": count // (args.dp * args.batch) * args.batch,
                      "seq": args.seq, "batch": args.batch, "workers": args.workers}))  # fmt: skip
    print("| source | stream / map-style samples/s: median [min, max] | stream samples/s |")
    print("|---|---|---|")
    for kind, (med, lo, hi, rate) in rows.items():
        print(f"| {kind} | {med:.3f} [{lo:.3f}, {hi:.3f}] | {rate:,.0f} |")
    print(f"litdata chunks in rank 0's cache after one pass from cold: map-style {cached['map']}, "
          f"sharded {cached['stream']}")  # fmt: skip


if __name__ == "__main__":
    main()
