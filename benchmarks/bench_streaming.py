"""Per-rank throughput of the streaming loader (`DataParallelStream`) against the map-style loader, same samples.

    python benchmarks/bench_streaming.py [--quick]

One process plays data-parallel rank 0 of ``--dp`` ranks (no process group is needed to read data): the map-style
loader is a `DataLoader` over the corpus windows with the `DistributedSampler(num_replicas=dp, rank=0)` Lightning
inserts; the streaming one reads the same windows in order, wrapped the way the strategies wrap it. Two sources:
in-memory windows (a `TensorDataset` against an `IterableDataset` over the same tensor: what the wrapper costs) and
Hugging Face `datasets` over a local JSON-lines file (Arrow map-style against streaming mode). Both yield the same
number of batches of the same size. Rounds alternate the order (ABBA); the figure is the median over rounds of the
per-round ratio of samples per second (streaming / map-style). A hand-run benchmark: it asserts nothing.
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
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_par.data import encode, load_text
from lightning_par.parallel.stream_split import split_over_data_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _streams import _pairs, hf_stream, windows


class _Rows(IterableDataset):
    """The same windows as the map-style dataset, yielded in order: the stream's source costs what indexing does."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for row in self.w:
            yield row[:-1], row[1:]


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
    else:
        w = windows(args.seq, count)
        dataset, collate = (_Rows(w) if stream else TensorDataset(w[:, :-1], w[:, 1:])), None
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
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("torch", "hf"):
            ratios, rates = [], []
            for r in range(args.rounds):
                order = ("map", "stream") if r % 2 == 0 else ("stream", "map")
                got: dict[str, Any] = {}
                for which in order:
                    loader = _loader(kind, which == "stream", Path(tmp), args, count)
                    got[which] = _rate(loader)
                if got["map"][1] != got["stream"][1]:
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


if __name__ == "__main__":
    main()
