"""Iterable (streaming) training datasets under the strategies, against one process reading the same stream.

The stream: the corpus's first windows in order, as a plain torch `IterableDataset` and as Hugging Face `datasets`
in streaming mode over a JSON-lines file the worker writes (no network). One process with the global batch
(Lightning's own loop, no strategy of ours) is the reference: with the data-parallel ranks each taking a share of
every global batch, step k must train on the same samples. Losses are compared to 1e-5 relative (fp32, as
tests/test_zero.py: only the summation order differs); rank 0's batches must be the reference's rows 0, 2, 4, ...
(the `DistributedSampler`'s stride).

Sharded sources, read shard by shard: litdata (zero2 with 2 loader workers, against a one-process reference on the
documented order; each rank's cache holds only its chunks; tp) and Hugging Face streaming over 4 Parquet files of
unequal length (zero1 with 2 workers: each rank its 2 files, every pass ending on both ranks when rank 0's files
end; tp and pipe). Both resumed from a mid-pass checkpoint.

Spawns: one 2-rank torchrun (zero1; zero2 with 2 loader workers over `datasets`; zero3; DeepSpeed ZeRO-1; tp, cp
and pipe, whose two ranks are one replica; a Hugging Face Llama built from a config under tp x ZeRO-1; a resume on
the same layout; a stream shorter than one global batch; the sharded sources above) and one process (the
references, and the 2-rank checkpoint resumed on one rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launch import run_jobs
from parity import rel

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

STEPS = 4
BASE: dict[str, Any] = {"model": "gpt", "steps": STEPS, "global_batch": 8, "stream": "torch"}
# 2 ranks: name -> job. dp is the data-parallel size (the per-rank batch is global_batch // dp).
TWO: dict[str, dict[str, Any]] = {
    "zero1": {"strategy": "zero1"},
    "zero2_hf_workers": {"strategy": "zero2", "stream": "hf", "workers": 2},
    "zero3": {"strategy": "zero3"},
    "deepspeed_zero1": {"strategy": "deepspeed_zero1"},
    "tp": {"strategy": {"tp": 2}, "dp": 1},
    "cp": {"strategy": "cp", "dp": 1},
    "pipe": {"strategy": {"pp": 2, "microbatches": 2}, "dp": 1},
    "hf_llama_tp_zero1": {"model": "hf_llama", "strategy": {"tp": 2, "zero_stage": 1}, "dp": 1},
    "too_short": {"strategy": "zero1", "stream_samples": 6, "expect_error": True},
    # litdata, read shard by shard (each rank its chunks, through its own cache): 2 ranks x 2 loader workers
    "zero2_litdata": {"strategy": "zero2", "stream": "litdata", "workers": 2},
    "tp_litdata": {"strategy": {"tp": 2}, "dp": 1, "stream": "litdata"},
    # Hugging Face streaming over 4 Parquet files: each rank reads its 2 files, passes end when rank 0's do
    "zero1_hf_parquet": {"strategy": "zero1", "stream": "hf_parquet", "workers": 2},
    # one replica (dp = 1): both ranks read all 4 files in order, the same windows as "ref"
    "tp_hf_parquet": {"strategy": {"tp": 2}, "dp": 1, "stream": "hf_parquet"},
    "pipe_hf_parquet": {"strategy": {"pp": 2, "microbatches": 2}, "dp": 1, "stream": "hf_parquet"},
}
ONE: dict[str, dict[str, Any]] = {
    "ref": {},
    "ref_hf": {"stream": "hf", "workers": 2},
    "ref_hf_llama": {"model": "hf_llama"},
    "ref_litdata": {"stream": "sharded_ref:2:2:4"},  # zero2_litdata's global batches: rank 0's 4, then rank 1's
    "ref_hf_parquet": {"stream": "hf_parquet_ref"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("streaming")
    data = str(tmp / "data")
    ckpts = str(tmp / "ckpts")
    two = {name: {**BASE, "stream_dir": data, **job} for name, job in TWO.items()}
    two["zero1"].update(ckpt_dir=ckpts, ckpt_every_n_steps=1)
    two["zero1_resumed"] = {**two["zero1"], "ckpt_dir": None, "resume": f"{ckpts}/step=2.ckpt"}
    two["zero1_hf_parquet"].update(ckpt_dir=str(tmp / "ckpts_parquet"), ckpt_every_n_steps=1)
    two["zero1_hf_parquet_resumed"] = {**two["zero1_hf_parquet"], "ckpt_dir": None,
                                       "resume": str(tmp / "ckpts_parquet" / "step=2.ckpt")}  # fmt: skip
    for name in ("zero2_litdata", "tp_litdata"):  # each its own chunks and caches
        two[name]["stream_dir"] = str(tmp / name)
    two["zero2_litdata"].update(ckpt_dir=str(tmp / "ckpts_litdata"), ckpt_every_n_steps=1)
    two["zero2_litdata_resumed"] = {**two["zero2_litdata"], "ckpt_dir": None,
                                    "resume": str(tmp / "ckpts_litdata" / "step=2.ckpt")}  # fmt: skip
    results = dict(zip(two, run_jobs(tmp / "two", list(two.values()), nproc=2, timeout=400), strict=True))
    one = {name: {**BASE, "stream_dir": data, **job} for name, job in ONE.items()}
    # The 2-rank ZeRO-1 checkpoint after step 2, on one rank: the stream continues at sample 16 of the same order.
    one["resumed_on_one"] = {**BASE, "strategy": {"zero_stage": 0}, "resume": f"{ckpts}/step=2.ckpt"}
    results.update(zip(one, run_jobs(tmp / "one", list(one.values()), nproc=1, timeout=300), strict=True))
    return results


@pytest.mark.parametrize("name", ["zero1", "zero2_hf_workers", "zero3", "deepspeed_zero1", "tp", "cp", "pipe",
                                  "hf_llama_tp_zero1"])  # fmt: skip
def test_every_step_trains_on_the_global_batch_of_one_process(runs, name):
    got = runs[name]
    ref = runs["ref_hf_llama" if "llama" in name else "ref_hf" if "hf" in name else "ref"]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert rel(got["losses"], ref["losses"]) < 1e-5
    if "zero" in name and got["layout"]["dp_shard"] > 1:  # rank 0 holds every other sample of each global batch
        assert got["batch_heads"] == [heads[0::2] for heads in ref["batch_heads"]]
    else:  # tensor and pipeline ranks of one replica read the same samples: the whole global batch
        assert got["batch_heads"] == ref["batch_heads"]


def _rank_0_reads_the_first_half(runs: dict[str, Any], ref_name: str, names: tuple[str, ...]) -> None:
    """Sharded 2-rank runs (and their resumes) against the one-process reference of their global batches: the
    same losses from each run's first step on, and rank 0's 4 samples first in each global batch."""
    ref = runs[ref_name]
    for name in names:
        got = runs[name]
        start = got.get("start_step", 0)
        assert len(got["losses"]) == STEPS - start and rel(got["losses"], ref["losses"][start:]) < 1e-5
        assert got["batch_heads"] == [heads[:4] for heads in ref["batch_heads"][start:]]


def test_litdata_ranks_read_their_own_chunks_and_train_on_the_global_batch_of_one_process(runs, tmp_path_factory):
    _rank_0_reads_the_first_half(runs, "ref_litdata", ("zero2_litdata", "zero2_litdata_resumed"))
    assert runs["zero2_litdata_resumed"]["start_step"] == 2
    # 32 samples in chunks of 4: rank 0's ranges are samples 0-15 (chunks 0-3), rank 1's 16-31 (chunks 4-7). Each
    # rank's local cache holds only the chunks it read.
    folder = sorted(tmp_path_factory.getbasetemp().glob("streaming*/zero2_litdata"))[-1]
    cached = {r: sorted(int(p.stem.split("-")[-1]) for p in (folder / f"cache_rank{r}").rglob("chunk-*.bin"))
              for r in (0, 1)}  # fmt: skip
    assert cached == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # tensor-parallel ranks of one replica read the same samples: the whole global batch, in order
    assert runs["tp_litdata"]["batch_heads"] == runs["ref"]["batch_heads"]
    assert rel(runs["tp_litdata"]["losses"], runs["ref"]["losses"]) < 1e-5


def test_hf_streaming_ranks_read_their_own_files_and_end_each_pass_together(runs, tmp_path_factory):
    _rank_0_reads_the_first_half(runs, "ref_hf_parquet", ("zero1_hf_parquet", "zero1_hf_parquet_resumed"))
    for name in ("tp_hf_parquet", "pipe_hf_parquet"):  # tensor / pipeline ranks of one replica: the same samples
        assert runs[name]["batch_heads"] == runs["ref"]["batch_heads"]
        assert rel(runs[name]["losses"], runs["ref"]["losses"]) < 1e-5
    # step 4 is the first of the second pass: the first pass ended on both ranks after rank 0's 3 batches
    assert runs["zero1_hf_parquet"]["batch_heads"][3] == runs["zero1_hf_parquet"]["batch_heads"][0]
    from lightning_par.checkpoint.reader import read_meta
    from lightning_par.checkpoint.resume_state import KEY

    folder = sorted(tmp_path_factory.getbasetemp().glob("streaming*/ckpts_parquet/step=2.ckpt"))[-1]
    (position,) = read_meta(folder)[KEY]["data"]
    # after 2 batches of 4: rank 0 is 1 sample into file 1 (file 0 holds 7), rank 1 is 8 samples into file 2
    assert position["ranks"] == [[[1, 1]], [[2, 8], [3, 0]]] and position["samples"] == 16


def test_the_two_sources_give_the_same_samples(runs):
    assert runs["ref_hf"]["batch_heads"] == runs["ref"]["batch_heads"]
    assert rel(runs["ref_hf"]["losses"], runs["ref"]["losses"]) < 1e-6


def test_a_resume_continues_at_the_next_unseen_sample(runs):
    full = runs["zero1"]
    same = runs["zero1_resumed"]
    assert same["start_step"] == 2 and same["batch_heads"] == full["batch_heads"][2:]
    assert rel(same["losses"], full["losses"][2:]) < 1e-5
    # On one rank (reshard 2 -> 1): the same global batches, so the loss curve continues.
    other = runs["resumed_on_one"]
    assert other["start_step"] == 2 and other["batch_heads"] == runs["ref"]["batch_heads"][2:]
    assert rel(other["losses"], full["losses"][2:]) < 1e-5


def test_a_stream_shorter_than_one_global_batch_is_refused_naming_the_fix(runs):
    got = runs["too_short"]
    assert got["losses"] == []
    assert "6 samples" in got["error"] and "global batch of 8" in got["error"]


def test_checkpoint_holds_the_stream_position(runs, tmp_path_factory):
    from lightning_par.checkpoint.reader import read_meta
    from lightning_par.checkpoint.resume_state import KEY

    folders = sorted(Path(p) for p in tmp_path_factory.getbasetemp().glob("streaming*/ckpts/step=2.ckpt"))
    (position,) = read_meta(folders[-1])[KEY]["data"]
    assert position == {"stream": True, "epoch": 0, "samples": 16, "complete": False, "global_batch": 8}


def test_a_resumed_whole_stream_with_loader_workers_saves_its_new_position_and_restarts_next_epoch():
    """With loader workers the main process's stream never iterates (the workers' copies do): its position must
    come from the trainer's batches, and the loaded start must apply to the resumed epoch's pass only."""
    from _streams import CorpusStream
    from torch.utils.data import DataLoader

    from lightning_par.streams.split import split_over_data_parallel

    epoch = [0]
    loader = DataLoader(CorpusStream(8, 40), batch_size=2, num_workers=2)
    stream = split_over_data_parallel(loader, 0, 2, lambda: epoch[0])
    assert stream is not None
    stream.resume_from({"stream": True, "epoch": 0, "samples": 16, "complete": False, "global_batch": 4})
    first = [b[0][:, 0].tolist() for b in loader]  # samples 16, 18, ... of the 40 (rank 0 of 2)
    assert len(first) == (40 - 16) // 4
    assert stream.position(4 + 2, complete=False)["samples"] == 24  # 4 batches before the resume, 2 after
    epoch[0] = 1
    second = [b[0][:, 0].tolist() for b in loader]
    assert len(second) == 40 // 4  # the next epoch reads the stream from its start
    assert stream.position(3, complete=False) == {"stream": True, "epoch": 1, "samples": 12, "complete": False,
                                                  "global_batch": 4}  # fmt: skip
