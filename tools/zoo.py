"""The zoo sweep: causal language models of the installed transformers under each parallel dimension, against one
process, each run classified (docs/compatibility.md, "The zoo sweep").

Every architecture in transformers' causal-LM registry is built from its own config shrunk by one rule
(tests/_zoo.py: no per-model table); those that do not build or train in one process are listed as not shrinkable.
Each of the others runs under ``tp`` (2), ``pipe`` (pp 2), ``zero3`` (2 ranks), ``moe`` (ep 2, where the model has
mixture-of-experts layers lightning_par recognises), ``cp`` (2, with SDPA attention) and ``fp8`` (``zero3`` with
``fp8="emulate"``, against one process converting the same layers with torchao over the same sub-batches) on 2 CPU
ranks, 3 steps, and is compared with the same model trained in one process (the test suite's machinery:
tests/launch.py, fp32, losses 1e-5 relative, parameters 1e-5 / 1e-7). Outcomes:

- ``parity``: trained like one process;
- ``fp8 rounding``: an ``fp8`` run off the exact bounds but within tests/test_fp8.py's bounds for fp8's rounding of
  summation-order noise (wrong share < 1e-3, losses 5e-5; a run with fp8 off fails them);
- ``no fp8 layer``: ``fp8`` converted nothing (no ``nn.Linear`` of fp8's shapes in the trunk: GPT-2's ``Conv1D``);
- ``refused``: stopped before the first optimizer step with lightning_par's own error (the message names a fix);
- ``crash``: any other error, or one after training started;
- ``mismatch``: trained, but not like one process (the worst: a silently different result);
- ``ill-conditioned``: a data-parallel mismatch that Lightning's own ``ddp`` shows as well (the model amplifies the
  rounding of summing two half batches; not a difference lightning_par makes);
- ``microbatch rounding``: a ``pipe`` mismatch against one process that is parity against one process accumulating
  the pipeline's microbatches (the same samples, each microbatch's gradient summed in the same order): the order of
  the sum, not a difference the pipeline makes.

    python tools/zoo.py                       # everything (hours on 2 cores)
    python tools/zoo.py --only llama,phi3     # some architectures
    python tools/zoo.py --sample 8 --seed 3   # 8 architectures drawn with a seed
    python tools/zoo.py --markdown zoo.md     # also write the table
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DIMS = {"tp": {"tp": 2}, "pipe": {"pp": 2}, "zero3": {"zero_stage": 3}, "moe": {"ep": 2}, "cp": {"cp": 2},
        "fp8": {"zero_stage": 3, "fp8": "emulate"}}  # fmt: skip
# lightning_par's refusals (each message names a fix); any other error is a crash.
REFUSALS = ("TPPlanError", "PipelineError", "ParallelConfigError", "LayoutError", "PartitionError",
            "NotImplementedError")  # fmt: skip


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _applicable(model_type: str) -> tuple[list[str], str]:
    """The dimensions that apply to ``model_type``'s tiny model, or why it is not shrinkable."""
    from _zoo import build

    from lightning_par.parallel.experts.finder import find_moe_layers

    try:
        model = build(model_type)
    except Exception as err:
        return [], f"{type(err).__name__}: {str(err)[:120]}"
    dims = ["tp", "pipe", "zero3", "fp8"]
    try:
        if find_moe_layers(model):
            dims.append("moe")
    except Exception:
        pass
    if getattr(model, "_supports_sdpa", False) is True:  # context parallelism runs SDPA attention
        dims.append("cp")
    return dims, ""


def _outcome(got: dict[str, Any], ref: dict[str, Any]) -> str:
    from parity import params_close, rel, without_tied_copies

    if got.get("error"):
        kind = got["error"].split(":", 1)[0]
        return "refused" if kind in REFUSALS and not got["losses"] else "crash"
    if len(got["losses"]) != len(ref["losses"]) or rel(got["losses"], ref["losses"]) > 1e-5:
        return "mismatch"
    try:
        params_close(without_tied_copies(got, ref), ref["params"], rtol=1e-5, atol=1e-7)
    except AssertionError:
        return "mismatch"
    return "parity"


def sweep(names: list[str], dims: list[str], out: Path) -> dict[str, dict[str, Any]]:
    """Run ``names`` under ``dims``; one JSON line per architecture appended to ``out`` as it finishes."""
    from conftest import reference_job
    from launch import run_jobs

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        start = time.perf_counter()
        row: dict[str, Any] = {"arch": name}
        applicable, why = _applicable(name)
        if why:
            row["not_shrinkable"] = why
        else:
            tmp = Path(tempfile.mkdtemp(prefix=f"zoo-{name}-"))
            for dim in (d for d in dims if d in applicable):
                model = f"zoo:{name}:sdpa" if dim == "cp" else f"zoo:{name}"
                try:
                    (ref,) = run_jobs(tmp, [reference_job({"model": model})], nproc=1, timeout=300)
                except AssertionError as err:
                    row[dim] = {"outcome": "reference fails", "error": str(err)[-300:]}
                    continue
                if dim == "fp8":  # its own reference: the same layers converted, over the same sub-batches
                    row[dim] = _fp8(tmp, model)
                    continue
                job = {"model": model, "strategy": DIMS[dim], "dp": 1 if dim in ("tp", "pipe", "cp") else 2,
                       "expect_error": True}  # fmt: skip
                try:
                    (got,) = run_jobs(tmp, [job], nproc=2, timeout=300)
                    row[dim] = {"outcome": _outcome(got, ref), "error": (got.get("error") or "")[:400]}
                    if row[dim]["outcome"] == "mismatch" and job["dp"] > 1:
                        # Lightning's own DDP as the control: a model whose training amplifies the rounding of two
                        # half-batch sums (CPMAnt shrunk: losses of 15) is off one process under any data parallelism.
                        (ddp,) = run_jobs(tmp, [{**job, "strategy": "ddp"}], nproc=2, timeout=300)
                        if _outcome(ddp, ref) == "mismatch":
                            row[dim]["outcome"] = "ill-conditioned"
                    if row[dim]["outcome"] == "mismatch" and dim == "pipe":
                        # One process accumulating the pipeline's m = 2 x pp microbatches of B/m: the same sums of
                        # gradients in the same order (tests/test_pipeline_aux.py's reference).
                        m = 2 * DIMS["pipe"]["pp"]
                        micro = {**reference_job({"model": model}), "global_batch": 8 // m, "accumulate": m}
                        (mref,) = run_jobs(tmp, [micro], nproc=1, timeout=300)
                        losses = mref["losses"]  # one per accumulated batch: a step's loss is the mean of its m
                        steps = [sum(losses[i : i + m]) / m for i in range(0, len(losses), m)]
                        if _outcome(got, {**mref, "losses": steps}) == "parity":
                            row[dim]["outcome"] = "microbatch rounding"
                except AssertionError as err:  # the spawn itself failed: a crash
                    row[dim] = {"outcome": "crash", "error": str(err)[-400:]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = row
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: (v["outcome"] if isinstance(v, dict) else v) for k, v in row.items()}), flush=True)
    return results


def _fp8(tmp: Path, model: str) -> dict[str, Any]:
    """ZeRO-3 with fp8 (emulated) on 2 ranks against one process that converts the same layers with torchao and
    accumulates over the two ranks' sub-batches (tests/test_fp8.py's reference: each rank's activation scales are
    its own sub-batch's). Run first, so that the reference converts what the run did."""
    from launch import run_jobs

    job = {"model": model, "strategy": DIMS["fp8"], "dp": 2, "expect_error": True}
    try:
        (got,) = run_jobs(tmp, [job], nproc=2, timeout=300)
    except AssertionError as err:
        return {"outcome": "crash", "error": str(err)[-400:]}
    if got.get("error"):
        return {"outcome": _outcome(got, got), "error": got["error"][:400]}
    if not got["fp8_layers"]:
        return {"outcome": "no fp8 layer", "error": ""}
    ref_job = {"model": model, "strategy": "auto", "global_batch": 4, "accumulate": 2, "rank_order": 2,
               "torchao_fp8": got["fp8_layers"], "record_init": True}  # fmt: skip
    try:
        (ref,) = run_jobs(tmp, [ref_job], nproc=1, timeout=300)
    except AssertionError as err:
        return {"outcome": "reference fails", "error": str(err)[-300:]}
    steps = [sum(ref["losses"][i : i + 2]) / 2 for i in range(0, len(ref["losses"]), 2)]
    outcome = _outcome(got, {**ref, "losses": steps})
    if outcome == "mismatch":
        # An fp8 cast rounds the fp32 noise of another summation order now and then to the other side: held to
        # tests/test_fp8.py's bounds for tp (where that noise is the rule), which a run with fp8 off fails.
        from parity import rel, without_tied_copies, wrong_share

        share = wrong_share(without_tied_copies(got, ref), ref["params"], ref["init_state"])
        if share < 1e-3 and rel(got["losses"], steps) < 5e-5:
            outcome = "fp8 rounding"
    return {"outcome": outcome, "error": "", "layers": len(got["fp8_layers"])}


def markdown(results: dict[str, dict[str, Any]], dims: list[str]) -> str:
    """The table for docs/compatibility.md, with the date, the versions and the counts per outcome."""
    import torch
    import transformers

    counts: dict[str, int] = {}
    lines = [f"| architecture | {' | '.join(dims)} |", "|---|" + "---|" * len(dims)]
    for name, row in results.items():
        if "not_shrinkable" in row:
            counts["not shrinkable"] = counts.get("not shrinkable", 0) + 1
            continue
        cells = []
        for dim in dims:
            outcome = row.get(dim, {}).get("outcome", "-")
            if outcome != "-":
                counts[outcome] = counts.get(outcome, 0) + 1
            cells.append(outcome)
        lines.append(f"| {name} | {' | '.join(cells)} |")
    head = (f"{datetime.date.today()}, transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{len(results)} architectures: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))  # fmt: skip
    return head + "\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--dims", default=",".join(DIMS), help="comma-separated dimensions (default: all)")
    parser.add_argument("--sample", type=int, help="draw this many architectures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="zoo.jsonl", help="one JSON line per architecture (appended)")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    names = args.only.split(",") if args.only else architectures()
    if args.sample:
        names = sorted(random.Random(args.seed).sample(names, min(args.sample, len(names))))
    dims = args.dims.split(",")
    results = sweep(names, dims, Path(args.out))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, dims))


if __name__ == "__main__":
    main()
