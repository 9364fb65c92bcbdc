"""The shard-by-shard split of a sharded stream (`lightning_par.streams.shards`), in one process.

Every data-parallel rank's loader is built and read here in turn (real DataLoaders, with worker processes where
``workers > 0``), which is what each rank of a job does; the strategies' spawn tests (tests/test_streaming.py) train
on it. Checked: each rank reads only the shards of its ranges, the ranks together read every sample once (less the
tail), a resume on the same layout gives exactly the uninterrupted run's later batches, and one on another layout
reads every unread sample once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_par.streams.parquet import ParquetShards
from lightning_par.streams.shards import ShardedStream, shards_of
from lightning_par.streams.split import split_over_data_parallel

LENGTHS = [13, 7, 22, 9, 16, 5, 11, 17]  # 100 samples; sample j of shard s is s * 1000 + j


class Shards(IterableDataset):
    """A user's sharded source: the `ShardedSource` methods, and a log of the shards each read opened."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self) -> Iterator[int]:
        for s in range(len(self.lengths)):
            yield from self.read_shard(s, 0)

    def shard_lengths(self) -> list[int]:
        return self.lengths

    def read_shard(self, index: int, start: int) -> Iterator[int]:
        for j in range(start, self.lengths[index]):
            yield index * 1000 + j


def _loaders(source: Any, dp: int, batch: int, workers: int) -> list[DataLoader]:
    loaders = []
    for rank in range(dp):
        loader = DataLoader(source, batch_size=batch, num_workers=workers)
        split_over_data_parallel(loader, rank, dp, lambda: 0)
        loaders.append(loader)
    return loaders


def _read(loaders: list[DataLoader], count: int | None = None) -> list[list[list[int]]]:
    """Per rank, its batches as lists (the first ``count`` only, when given)."""
    out = []
    for loader in loaders:
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            if count is not None and len(batches) == count:
                break
        out.append(batches)
    return out


def test_a_sharded_source_gets_the_shard_by_shard_split():
    loader = DataLoader(Shards(LENGTHS), batch_size=2)
    assert isinstance(split_over_data_parallel(loader, 0, 2), ShardedStream)
    assert shards_of(iter([1, 2])) is None  # a plain iterable is read whole
    # persistent workers would keep the first epoch's stream: refused, naming the fix
    persistent = DataLoader(Shards(LENGTHS), batch_size=2, num_workers=1, persistent_workers=True)
    with pytest.raises(ValueError, match="set persistent_workers=False"):
        split_over_data_parallel(persistent, 0, 2)


@pytest.mark.parametrize("dp,workers", [(2, 0), (2, 2), (4, 1)])
def test_ranks_read_their_own_contiguous_ranges_and_every_sample_once(dp, workers):
    batch = 3
    per_rank = _read(_loaders(Shards(LENGTHS), dp, batch, workers))
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1  # every rank runs the same number of steps
    samples = [s for rank in per_rank for b in rank for s in b]
    assert len(samples) == len(set(samples))
    # all but the tail: fewer than dp x W x batch samples
    assert 0 <= sum(LENGTHS) - len(samples) < dp * max(workers, 1) * batch
    for rank in per_rank:  # a rank's samples come from a run of neighbouring shards, not from all of them
        shards = {s // 1000 for b in rank for s in b}
        assert len(shards) <= len(LENGTHS) // dp + 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_on_the_same_layout_gives_the_uninterrupted_batches(workers):
    dp, batch, stop = 2, 3, 5  # stop after 5 batches: inside a worker round when workers = 2
    whole = _read(_loaders(Shards(LENGTHS), dp, batch, workers))
    first = _loaders(Shards(LENGTHS), dp, batch, workers)
    _read(first, stop)
    saved = first[0].dataset.position(stop, complete=False)
    assert all(loader.dataset.position(stop, False) == saved for loader in first)  # every rank saves the same
    assert saved["samples"] == stop * dp * batch
    resumed = _loaders(Shards(LENGTHS), dp, batch, workers)
    for loader in resumed:
        loader.dataset.resume_from(saved)
    assert _read(resumed) == [rank[stop:] for rank in whole]
    # a position saved by the resumed run (2 more batches) is the uninterrupted run's after stop + 2
    again = resumed[0].dataset.position(stop + 2, complete=False)
    assert again == first[0].dataset.position(stop + 2, complete=False)


@pytest.mark.parametrize("dp,workers", [(1, 0), (4, 2)])
def test_a_resume_on_another_layout_reads_every_unread_sample_once(dp, workers):
    first = _loaders(Shards(LENGTHS), 2, 3, 0)
    seen = [s for rank in _read(first, 4) for b in rank for s in b]
    saved = first[0].dataset.position(4, complete=False)
    resumed = _loaders(Shards(LENGTHS), dp, 12 // dp, workers)  # the same global batch of 12... of 6 x 2
    with pytest.warns(UserWarning, match="planned again for the new layout"):
        for loader in resumed:
            loader.dataset.resume_from(saved)
    later = [s for rank in _read(resumed) for b in rank for s in b]
    assert not set(seen) & set(later) and len(later) == len(set(later))
    unread = sum(LENGTHS) - len(seen)
    assert 0 <= unread - len(later) < dp * max(workers, 1) * (12 // dp)


def test_a_finished_pass_resumes_at_the_next_epoch_and_lengths_that_lie_fail():
    loaders = _loaders(Shards(LENGTHS), 2, 3, 0)
    done = _read(loaders)
    saved = loaders[0].dataset.position(len(done[0]), complete=True)
    resumed = _loaders(Shards(LENGTHS), 2, 3, 0)
    for loader in resumed:
        loader.dataset.resume_from(saved)
    assert resumed[0].dataset._start == (1, 0)  # the next epoch, from its first sample
    liar = Shards(LENGTHS)
    liar.lengths = [n + 4 for n in LENGTHS]  # says 4 more samples per shard than read_shard yields
    liar.read_shard = lambda i, start: (i * 1000 + j for j in range(start, LENGTHS[i]))  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="make shard_lengths"):
        _read(_loaders(liar, 2, 3, 0))
    with pytest.raises(ValueError, match="too few samples"):
        _read(_loaders(Shards([2, 1]), 2, 3, 0))


def test_the_position_fits_a_checkpoint():
    loaders = _loaders(Shards(LENGTHS), 2, 3, 2)
    _read(loaders, 3)
    saved = loaders[0].dataset.position(3, complete=False)
    restored = torch.load(_save(saved), weights_only=True)
    assert restored == saved


def _save(obj: Any) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


class _LoggedParquet(ParquetShards):
    """Records the files it reads samples from (the footers are read by every rank at construction)."""

    def read_shard(self, index: int, start: int) -> Iterator[Any]:
        self.read = [*getattr(self, "read", []), index]
        return super().read_shard(index, start)


def test_parquet_files_are_shards_read_from_the_middle_of_a_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    for s, n in enumerate([9, 4, 12, 7, 10, 6]):  # row groups of 4: reads from the middle skip whole groups
        files.append(tmp_path / f"part-{s}.parquet")
        pq.write_table(pa.table({"id": [s * 1000 + j for j in range(n)]}), files[-1], row_group_size=4)
    source = ParquetShards(files, transform=lambda row: row["id"])
    assert source.shard_lengths() == [9, 4, 12, 7, 10, 6] and source.row_groups[2] == [4, 4, 4]
    assert list(source.read_shard(2, 5)) == [2005 + j for j in range(7)]
    assert list(source.read_shard(0, 9)) == []
    per_rank, opened = [], []
    for rank in range(2):
        mine = _LoggedParquet(files, transform=lambda row: row["id"])
        loader = DataLoader(mine, batch_size=4)
        split_over_data_parallel(loader, rank, 2, lambda: 0)
        per_rank.append([s for b in loader for s in b.tolist()])
        opened.append(mine.read)
    assert opened == [[0, 1, 2], [2, 3, 4, 5]]  # 48 rows cut at 24: each rank opens its own files, and file 2
    assert sorted(per_rank[0] + per_rank[1]) == sorted(source)  # every row once (48 = 2 ranks x 6 batches of 4)
    with pytest.raises(ValueError, match="no files"):
        ParquetShards([])
    # Remote files (a pyarrow filesystem) with a local cache: each rank copies only the files of its ranges.
    from pyarrow import fs

    remote = fs.SubTreeFileSystem(str(tmp_path), fs.LocalFileSystem())
    names = [f.name for f in files]
    with pytest.raises(ValueError, match="pass their filesystem"):
        ParquetShards(files, cache_dir=tmp_path / "nowhere")
    for rank, expected in ((0, [0, 1, 2]), (1, [2, 3, 4, 5])):
        cached = ParquetShards(names, transform=lambda row: row["id"], filesystem=remote,
                               cache_dir=tmp_path / f"cache{rank}")  # fmt: skip
        loader = DataLoader(cached, batch_size=4)
        split_over_data_parallel(loader, rank, 2, lambda: 0)
        assert [s for b in loader for s in b.tolist()] == per_rank[rank]
        copies = sorted(p.name for p in (tmp_path / f"cache{rank}").iterdir())
        assert copies == [f"{i:06d}-part-{i}.parquet" for i in expected]


def test_litdata_chunks_are_the_shards_and_shuffle_permutes_them_per_epoch(tmp_path):
    import litdata
    from _streams import CHUNK, _env, litdata_stream

    from lightning_par.streams.shards import LitdataShards

    plain = litdata_stream(tmp_path, 8, 30)  # 30 windows in chunks of 4: 7 full chunks and one of 2
    shards = shards_of(plain)
    assert isinstance(shards, LitdataShards)
    assert shards.shard_lengths() == [CHUNK] * 7 + [2]
    heads = [[s["tokens"][0].item() for s in shards.read_shard(i, 0)] for i in range(8)]
    everything = [s["tokens"][0].item() for s in (plain[i] for i in range(30))]
    assert [h for chunk in heads for h in chunk] == everything
    assert [s["tokens"][0].item() for s in shards.read_shard(3, 1)] == heads[3][1:]
    with _env(HTTPS_PROXY="http://127.0.0.1:9"):
        mixed = litdata.StreamingDataset(str(tmp_path / "litdata_8_30"), shuffle=True, seed=7)
    shuffled = shards_of(mixed)
    orders = []
    for epoch in (0, 1):
        shuffled.set_epoch(epoch)
        chunks = [[s["tokens"][0].item() for s in shuffled.read_shard(i, 0)] for i in range(8)]
        assert sorted(map(tuple, chunks)) == sorted(map(tuple, heads))  # the same chunks, each in its order
        assert sorted(shuffled.shard_lengths()) == sorted(shards.shard_lengths())
        orders.append(chunks)
    assert orders[0] != orders[1] and orders[0] != heads


def test_hf_streaming_shards_of_unknown_length_resume_where_each_file_stopped(tmp_path):
    """`CountedShardStream` in one process (dp = 1; the 2-rank agreement on the end of a pass is trained in
    tests/test_streaming.py): shard lengths learnt while reading, the unread files in the position, exact resume."""
    from _streams import PARQUET_FILES, _pairs, hf_parquet_stream

    from lightning_par.streams.counted import CountedShardStream, counted_shards_of

    def loader(resume: Any = None) -> DataLoader:
        source = hf_parquet_stream(tmp_path, 8)
        stream = CountedShardStream(source, counted_shards_of(source), 0, 1, 4, lambda: 0)
        if resume is not None:
            stream.resume_from(resume)
        return DataLoader(stream, batch_size=4, num_workers=2, collate_fn=_pairs)

    whole = torch.cat([x for x, _ in loader()])
    assert len(whole) == sum(PARQUET_FILES)  # 32 rows: 8 batches, the 4 files one after the other
    first = loader()
    for i, _ in enumerate(first):
        if i == 4:
            break
    saved = first.dataset.position(5, complete=False)
    assert saved["ranks"] == [[[2, 8], [3, 0]]]  # 20 rows read: files 0-1 (12 rows), 8 of file 2's 10
    assert first.dataset.lengths[:2].tolist() == [7, 5]  # learnt by the workers (file 3 may be too: prefetch)
    rest = torch.cat([x for x, _ in loader(saved)])
    assert torch.equal(rest, whole[20:])


def test_hf_streaming_unread_shards_are_grouped_again_on_another_data_parallel_size(tmp_path):
    from _streams import _pairs, hf_parquet_stream

    from lightning_par.streams.counted import CountedShardStream, counted_shards_of

    source = hf_parquet_stream(tmp_path, 8)
    one = CountedShardStream(source, counted_shards_of(source), 0, 1, 4, lambda: 0)
    loader = DataLoader(one, batch_size=4, collate_fn=_pairs)
    whole = torch.cat([x for x, _ in loader])
    saved = one.position(3, complete=False)  # 12 rows read: files 0 and 1, to their ends
    assert saved["ranks"] == [[[2, 0], [3, 0]]]
    later = []
    with pytest.warns(UserWarning, match="planned again for the new layout"):
        ranks = [CountedShardStream(source, counted_shards_of(source), r, 2, 2, lambda: 0) for r in range(2)]
        for stream in ranks:
            stream.resume_from(saved)
    for stream in ranks:  # rank 0 reads file 2, rank 1 file 3: each its own, together every unread row once
        later.append(torch.cat([x for x, _ in DataLoader(stream, batch_size=2, collate_fn=_pairs)]))
    assert torch.equal(torch.cat(later), whole[12:])


def test_a_mid_pass_position_of_another_kind_of_stream_is_refused_and_an_epoch_end_one_is_not():
    from lightning_par.streams.dataset import DataParallelStream

    sharded = _loaders(Shards(LENGTHS), 2, 3, 0)[0].dataset
    _read([DataLoader(sharded, batch_size=3)], 2)
    mid, end = sharded.position(2, complete=False), sharded.position(5, complete=True)
    whole = DataParallelStream(Shards(LENGTHS), 0, 2, 3, lambda: 0)
    # (e.g. an elastic restart where a Hugging Face dataset's shards no longer cover the data-parallel ranks)
    with pytest.raises(ValueError, match=r"read shard by shard with known lengths.*this run reads it whole"):
        whole.resume_from(mid)
    whole.resume_from(end)
    assert whole._start == (1, 0)
    saved_whole = whole.position(2, complete=False)
    with pytest.raises(ValueError, match="saved while the stream was read whole by every rank"):
        _loaders(Shards(LENGTHS), 2, 3, 0)[0].dataset.resume_from(saved_whole)
