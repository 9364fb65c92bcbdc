"""A rotating sample of the zoo sweep (tools/zoo.py, docs/compatibility.md "The zoo sweep"): a few Hugging Face
architectures the other tests never name, shrunk by the one rule of tests/_zoo.py, each under every dimension that
applies (tp, pipe, zero3, moe, cp, fp8) on 2 ranks against one process. None may crash or train differently; a refusal
before training is allowed (the sweep classifies it by lightning_par's own error naming a fix).

The sample changes every day (seeded by the date) so that over weeks the slow tier covers the registry;
``LP_ZOO_SEED`` fixes it, and a failure names the seed and the command that reproduces it.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = 3  # architectures per run (~10 s each on 2 cores)


def _zoo() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    import zoo

    return zoo


def test_a_rotating_sample_of_the_zoo_trains_like_one_process_or_is_refused(tmp_path: Path) -> None:
    zoo = _zoo()
    seed = int(os.environ.get("LP_ZOO_SEED", datetime.date.today().toordinal()))
    names = zoo.architectures()
    random.Random(seed).shuffle(names)
    # Architectures that train in one process once shrunk (the others say why, as the sweep lists them), up to
    # SAMPLE of them; each run under every dimension that applies.
    results: dict[str, dict[str, Any]] = {}
    judged = 0
    for name in names[: 4 * SAMPLE]:
        row = zoo.sweep([name], list(zoo.DIMS), tmp_path / "zoo.jsonl")[name]
        results[name] = row
        judged += any(r["outcome"] in ("parity", "refused") for r in row.values() if isinstance(r, dict))
        if judged == SAMPLE:
            break
    outcomes = {(n, d): r["outcome"] for n, row in results.items() for d, r in row.items() if isinstance(r, dict)}
    bad = {k: (v, results[k[0]][k[1]]["error"][:300]) for k, v in outcomes.items() if v in ("crash", "mismatch")}
    again = f"LP_ZOO_SEED={seed} (python tools/zoo.py --only {','.join(results)})"
    assert not bad, f"{again}: {bad}"
    assert judged == SAMPLE, f"{again}: too few architectures train in one process: {outcomes}"  # not vacuous
