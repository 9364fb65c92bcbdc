"""Parquet files as a sharded source: every data-parallel rank opens only the files of its ranges.

The files are the shards; their lengths come from the Parquet footers (only the metadata is read), so the
shard-by-shard split (`lightning_par.streams.shards`) plans each pass without reading a sample. Reading shard
``i`` from sample ``start`` skips the row groups that end before it unread. This is the form of most large text
corpora on the Hugging Face Hub: where ``datasets.load_dataset("parquet", data_files=files, streaming=True)`` would
be read whole by every rank, ``ParquetShards(files)`` is read 1/dp per rank (docs/data.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from torch.utils.data import IterableDataset


class ParquetShards(IterableDataset):
    """Rows of Parquet files, one shard per file, as dicts (or what ``transform`` makes of each).

    Args:
        files: the files, in the same order on every rank (sort a glob).
        transform: applied to each row (a dict of column -> value), e.g. to make tensors; ``None`` yields the dicts.
        columns: read only these columns.
        filesystem: a ``pyarrow.fs.FileSystem`` for remote files (S3, GCS, HDFS); ``None`` for local paths.
        cache_dir: with ``filesystem``, a local folder: a file is copied there the first time this process reads
            from it, and read from the copy after (later epochs, resumes). Only the files of this rank's ranges are
            copied. Use a folder per node, or one shared by the node's ranks (copies appear by an atomic rename).

    Raises:
        ImportError: pyarrow is missing (``pip install "lightning-par[streaming]"``).
    """

    def __init__(
        self,
        files: Sequence[Union[str, Path]],
        transform: Optional[Callable[[dict[str, Any]], Any]] = None,
        columns: Optional[Sequence[str]] = None,
        filesystem: Any = None,
        cache_dir: Optional[Union[str, Path]] = None,
    ) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover - the streaming extra installs it
            raise ImportError('ParquetShards reads with pyarrow: pip install "lightning-par[streaming]"') from err
        if not files:
            raise ValueError("ParquetShards got no files; pass the Parquet files to read (e.g. sorted(glob(...)))")
        self.files = [str(f) for f in files]
        self.transform, self.filesystem = transform, filesystem
        self.columns = list(columns) if columns is not None else None
        if cache_dir is not None and filesystem is None:
            raise ValueError("ParquetShards(cache_dir=...) caches remote files: pass their filesystem= too, or drop "
                             "cache_dir for local files")  # fmt: skip
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        # Per file, its row groups' lengths: the shard's length, and where a read from the middle starts.
        self.row_groups: list[list[int]] = []
        for path in self.files:
            meta = pq.ParquetFile(self._open(path)).metadata
            self.row_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])

    def _open(self, path: str) -> Any:
        return path if self.filesystem is None else self.filesystem.open_input_file(path)

    def _local(self, index: int) -> Any:
        """What to read file ``index`` from: the local copy when caching (made now if missing), else the file."""
        path = self.files[index]
        if self.cache_dir is None:
            return self._open(path)
        local = self.cache_dir / f"{index:06d}-{Path(path).name}"
        if not local.exists():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f"{local.name}.{os.getpid()}.tmp")
            with self.filesystem.open_input_stream(path) as remote, open(tmp, "wb") as out:
                shutil.copyfileobj(remote, out, length=1 << 24)
            os.replace(tmp, local)  # whole or absent, also when other ranks of the node copy it too
        return str(local)

    def shard_lengths(self) -> list[int]:
        """Rows per file, from the footers read once at construction."""
        return [sum(groups) for groups in self.row_groups]

    def read_shard(self, index: int, start: int) -> Iterator[Any]:
        """The rows of file ``index`` from its ``start``-th on; row groups that end before it are not read."""
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(self._local(index))
        skip = start
        for group, rows in enumerate(self.row_groups[index]):
            if skip >= rows:
                skip -= rows
                continue
            table = handle.read_row_group(group, columns=self.columns).slice(skip)
            skip = 0
            for row in table.to_pylist():
                yield row if self.transform is None else self.transform(row)

    def __iter__(self) -> Iterator[Any]:
        """All files in order: what one process without lightning_par reads."""
        for index in range(len(self.files)):
            yield from self.read_shard(index, 0)
