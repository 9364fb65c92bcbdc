"""Does the quick tier still catch what it must? Apply representative bugs one at a time and run it.

Each mutation is an edit of one line of the library that a plausible change could make (a dropped collective, a
skipped microbatch, experts swapped, a checkpoint without its optimizer state). For each, the working tree is copied
to a temporary folder (tracked and untracked files, not what git ignores), the edit is applied there (it must match
exactly once, so a moved line fails the tool, not silently the check), and ``pytest -m "not slow" -x`` runs in the
copy with this interpreter (the copy's package shadows the editable install: it comes first on ``sys.path``). A
mutation is *caught* when at least one test fails. Prints a markdown table (docs/testing.md, "Mutations").

    python tools/mutate.py              # every mutation (each run stops at its first failing test)
    python tools/mutate.py --only tp_all_reduce,pipeline_microbatch
    python tools/mutate.py --list

Measuring a tolerance against broken runs (tests/parity.py records every compared value with ``LP_MEASURE``, and
under ``--measure`` lets every bound pass so that each comparison of a broken run is recorded):

    python tools/mutate.py --only none,half_batch --measure /tmp/m.jsonl --all \
        -- tests/test_zero.py -k low_precision
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One bug: in ``path``, each ``old`` of ``edits`` (exactly once) becomes its ``new``."""

    name: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]


MUTATIONS = [
    Mutation(
        "dp_gradient_reduction",
        "ZeRO-1/2 use each rank's own gradient: the gradient reduce-scatter is dropped",
        "lightning_par/parallel/zero/replicated.py",
        (
            (
                "        work = _reduce_scatter(out, packed.view(-1), group=self.shard_group, async_op=True)\n",
                "        out.copy_(packed[bucket.rank] * self.dp)  # MUTATION\n"
                "        work = dist.barrier(group=self.shard_group, async_op=True)\n",
            ),
        ),
    ),
    Mutation(
        "ddp_gradient_all_reduce",
        "ZeRO-0 (DDP) uses each rank's own gradient: its bucket all-reduce is dropped",
        "lightning_par/parallel/zero/replicated.py",
        (
            (
                "        work = dist.all_reduce(flat, group=self.shard_group, async_op=True)\n",
                "        flat.mul_(self.dp)  # MUTATION\n"
                "        work = dist.barrier(group=self.shard_group, async_op=True)\n",
            ),
        ),
    ),
    Mutation(
        "tp_all_reduce",
        "row-parallel Linears hand on their partial sums: tensor parallelism's all-reduce (reduce-scatter under "
        "sequence parallelism) is dropped",
        "lightning_par/parallel/tensor/apply.py",
        (
            (
                "                styles[rel] = RowwiseParallel(output_layouts=out, use_local_output=True)\n",
                "                styles[rel] = RowwiseParallel(output_layouts=out, use_local_output=True)\n"
                "                styles[rel]._prepare_output_fn = _no_reduce  # MUTATION\n",
            ),
            (
                "def _groups(plan: TPPlan)",
                "def _no_reduce(output_layouts, use_local_output, mod, outputs, mesh):  # MUTATION: never reduced\n"
                "    local = outputs.to_local()\n"
                "    if output_layouts[0].is_shard():  # this rank's sequence chunk of its own partial sums\n"
                "        local = local.chunk(mesh.size(), dim=output_layouts[0].dim)[mesh.get_local_rank()]\n"
                "    return local\n\n\n"
                "def _groups(plan: TPPlan)",
            ),
        ),
    ),
    Mutation(
        "pipeline_microbatch",
        "a pipeline step trains the second-to-last microbatch twice and never the last",
        "lightning_par/parallel/pipeline/schedule.py",
        (
            (
                "    return [_compat.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]",
                "    return [_compat.tree_unflatten([c[min(i, max(m - 2, 0))] for c in chunks], spec)"
                " for i in range(m)]",
            ),
        ),
    ),
    Mutation(
        "experts_swapped",
        "each ep rank runs its local experts on each other's rows",
        "lightning_par/parallel/experts/dispatch.py",
        (
            (
                "            torch.arange(n, device=x.device).repeat(self.ep), recv_counts, output_size=sum(recv)",
                "            torch.arange(n - 1, -1, -1, device=x.device).repeat(self.ep), recv_counts,"
                " output_size=sum(recv)",
            ),
        ),
    ),
    Mutation(
        "checkpoint_without_optimizer_state",
        "sharded checkpoints are written without the optimizer's state",
        "lightning_par/strategies/_checkpointing.py",
        (
            (
                '            tensors[f"optimizer_{i}"] = state\n',
                '            tensors[f"optimizer_{i}"] = {**state, "state": {}}  # MUTATION\n',
            ),
        ),
    ),
    Mutation(
        "resume_without_optimizer_state",
        "a resume loads the weights but not the optimizer's state (it restarts from zeroed moments)",
        "lightning_par/checkpoint/dcp.py",
        (
            (
                "    canonical, swaps = canonicalize(on_disk)",
                "    canonical, swaps = canonicalize(  # MUTATION\n"
                "        {k: v for k, v in on_disk.items() if not k.startswith('optimizer_')})",
            ),
        ),
    ),
    Mutation(
        "half_batch",
        "every data-parallel rank reads rank 0's samples: the step trains on half the global batch (the broken run "
        "that low-precision tolerances are measured against)",
        "lightning_par/strategies/_processes.py",
        (('        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}\n',
          '        return {"num_replicas": dp.size(), "rank": 0}  # MUTATION\n'),),
    ),
]


def _copy_tree(dst: Path) -> None:
    """The working tree as it is (tracked and untracked files git does not ignore) into ``dst``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _apply(tree: Path, m: Mutation) -> None:
    path = tree / m.path
    text = path.read_text()
    for old, new in m.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{m.name}: {old.strip()!r} occurs {text.count(old)} times in {m.path}; update the tool")
        text = text.replace(old, new)
    path.write_text(text)


# Runs the tests on the tree as it is: the measurements' baseline.
NONE = Mutation("none", "nothing broken (the baseline)", "lightning_par/__init__.py", ())


def run(m: Mutation, pytest_args: list[str], timeout: float, measure: str = "") -> tuple[str, str, float]:
    """Apply ``m`` in a copy of the tree and run pytest there; (outcome, first failing test, seconds)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant_{m.name}_") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        _apply(tree, m)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.pop("LP_SUITE_DEADLINE", None)
        if measure:
            env["LP_MEASURE"] = os.path.abspath(measure)
            env["LP_MEASURE_ALL"] = "1"  # tests/parity.py: record every comparison, fail none
            with open(measure, "a") as f:
                f.write(f'{{"mutation": "{m.name}"}}\n')
        start = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--durations=0", *pytest_args]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "timed out (not caught)", "", time.monotonic() - start
        seconds = time.monotonic() - start
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        if proc.returncode == 0:
            return ("passed" if m is NONE else "NOT caught"), "", seconds
        return "caught", failed[0] if failed else f"pytest exit {proc.returncode}", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutation names")
    parser.add_argument("--marker", default="not slow", help="pytest -m expression (default: the quick tier)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutation")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--measure", default="", help="append every compared value to this JSON-lines file (then no bound fails)"
    )
    parser.add_argument(
        "--all", action="store_true", help="run every selected test (default: stop at the first failure)"
    )
    parser.add_argument("tests", nargs="*", help="pytest arguments after --, e.g. -- tests/test_zero.py -k bf16")
    args = parser.parse_args()
    chosen = [m for m in [NONE, *MUTATIONS] if m.name in args.only.split(",")] if args.only else MUTATIONS
    default = ["-m", args.marker, "tests"]
    pytest_args = [*([] if args.all else ["-x"]), *(args.tests or default)]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what} ({m.path})")
        return
    print("| mutation | what it breaks | outcome | first failing test | seconds |\n|---|---|---|---|---|")
    missed = 0
    for m in chosen:
        outcome, test, seconds = run(m, pytest_args, args.timeout, args.measure)
        missed += outcome not in ("caught", "passed")
        print(f"| `{m.name}` | {m.what} | {outcome} | `{test}` | {seconds:.0f} |", flush=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
