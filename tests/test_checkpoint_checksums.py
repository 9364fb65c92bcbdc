"""A checksum for every file of a checkpoint folder (`lightning_par.checkpoint.checksums`): written by every save
(synchronous and asynchronous), checked before any tensor is read.

One 2-rank spawn under ``zero3`` saves after each of 2 steps, once synchronously and once with ``async_save=True``.
Each folder's ``checksums.json`` covers every file in it. A copy with one byte of tensor data flipped in rank 1's
shard (every file size intact, the case the reader's own checks cannot see) is refused when a run resumes from it,
on every rank, naming the file, before any weight changed; the intact copy resumes (the check passes on real
checkpoints, split over the ranks); ``lightning-par consolidate`` refuses the flipped copy too, and reads a folder
saved before checksums existed (no table) as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from launch import run_jobs

from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.consolidate import main as consolidate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = {"model": "gpt_sgd", "dp": 2, "epoch_steps": 1, "max_steps": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("checksums")
    jobs = [{**BASE, "strategy": "zero3", "ckpt_dir": str(tmp / "sync")},
            {**BASE, "strategy": {"zero_stage": 3, "async_save": True}, "ckpt_dir": str(tmp / "async")}]  # fmt: skip
    run_jobs(tmp, jobs, nproc=2, timeout=300)
    ckpt = tmp / "sync" / "epoch=1.ckpt"
    flipped, intact = tmp / "flipped.ckpt", tmp / "intact.ckpt"
    shutil.copytree(ckpt, flipped)
    shutil.copytree(ckpt, intact)
    shard = flipped / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte, in the middle of the tensor data
    shard.write_bytes(bytes(data))
    resume = {**BASE, "strategy": "zero3", "max_steps": 3}
    got = run_jobs(tmp, [{**resume, "resume": str(flipped), "expect_error": True},
                         {**resume, "resume": str(intact)}], nproc=2, timeout=300)  # fmt: skip
    return {"sync": ckpt, "async": tmp / "async" / "epoch=1.ckpt", "flipped": flipped, "intact": intact,
            "resumed_flipped": got[0], "resumed_intact": got[1]}  # fmt: skip


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_every_file_of_a_saved_folder_has_its_checksum(saved: dict[str, Any], kind: str) -> None:
    folder: Path = saved[kind]
    table = json.loads((folder / checksums.FILE).read_text())
    files = {p.name for p in folder.iterdir() if p.name != checksums.FILE}
    assert table["algorithm"] == "crc32" and set(table["files"]) == files
    assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp", "rank_0.pt", "rank_1.pt"} <= files
    assert all(table["files"][n] == checksums.crc32(folder / n) for n in files)


def test_a_flipped_byte_is_refused_before_the_resumed_run_starts(saved: dict[str, Any]) -> None:
    got = saved["resumed_flipped"]
    assert got["losses"] == []
    assert "flipped.ckpt/__1_0.distcp does not match the checksum written with it" in got["error"]
    # The intact copy of the same folder resumes and trains its step: the check passed on both ranks.
    assert len(saved["resumed_intact"]["losses"]) == 1


def test_consolidate_refuses_a_flipped_byte_and_reads_folders_without_a_table(
    saved: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        consolidate([str(saved["flipped"]), str(tmp_path / "out.ckpt")])
    assert err.value.code == 2 and "__1_0.distcp does not match the checksum" in capsys.readouterr().err
    old = tmp_path / "old.ckpt"  # a folder written before checksums existed
    shutil.copytree(saved["intact"], old)
    (old / checksums.FILE).unlink()
    consolidate([str(old), str(tmp_path / "old_out.ckpt")])
    assert (tmp_path / "old_out.ckpt").is_file()
