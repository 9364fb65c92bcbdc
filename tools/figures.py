"""The charts of docs/benchmarks.md, as SVG files in docs/img/, from figures written below as data.

    python tools/figures.py               # writes every chart into docs/img/
    python tools/figures.py --out DIR     # somewhere else (to compare with the committed ones)

Standard library only: each chart is horizontal bars (one group per category, one bar per series) with the value
written at the end of each bar, an optional reference mark per bar (a theory, an ideal, a prediction), optional
vertical lines (a bar to meet, a limit of the machine), the axis titles and a caption. Every number is copied from
docs/benchmarks_history.md, as written there, and the comment beside it names the section it comes from: when a
benchmark is rerun and its section there gains a newer run, change the figure here and rerun this script.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44"]  # Paul Tol's bright scheme: tells apart under colour blindness
REGENERATE = "Regenerate: python tools/figures.py."


@dataclass
class Series:
    name: str
    values: list[float | None]  # one per category; None: no bar there
    labels: list[str] | None = None  # the text at a bar's end; the value as written (`fmt`) when None
    refs: list[float | None] | None = None  # a reference mark on each bar (theory, ideal, prediction)


@dataclass
class Chart:
    name: str  # the file: docs/img/<name>.svg
    title: str
    x_title: str
    categories: list[str]
    series: list[Series]
    caption: str
    fmt: str = "{:g}"
    ref_name: str = ""  # the legend's entry for the reference marks
    ref_short: str = ""  # the mark's value in a bar's label: "<value> (<ref_short> <mark>)"
    vlines: list[tuple[float, str]] = field(default_factory=list)


# (a) Scaling. docs/benchmarks_history.md, "Pipeline throughput on real models (`bench_pipeline_throughput.py`)",
# the results table of 2026-12-02: "speedup: median" (the bar) and "ideal pp(1-b)" (the mark), m = 8 rows.
SCALING = Chart(
    name="scaling_pipeline",
    title="Pipeline throughput against one rank (samples/s), 8 microbatches, 2-core CPU",
    x_title="speedup over the same model on one rank (x)",
    categories=["GPT, pp 2", "GPT, pp 4", "Llama (HF), pp 2", "Llama (HF), pp 4"],
    series=[
        Series(
            "1F1B",
            values=[
                1.703,  # gpt | 2 | 1f1b | 8
                1.738,  # gpt | 4 | 1f1b | 8
                1.653,  # llama | 2 | 1f1b | 8
                1.689,  # llama | 4 | 1f1b | 8
            ],
            refs=[
                1.778,  # gpt | 2 | 1f1b | 8: ideal pp(1-b)
                2.909,  # gpt | 4 | 1f1b | 8
                1.778,  # llama | 2 | 1f1b | 8
                2.909,  # llama | 4 | 1f1b | 8
            ],
        ),
        Series(
            "interleaved 1F1B",
            values=[
                1.728,  # gpt | 2 | interleaved_1f1b | 8
                1.751,  # gpt | 4 | interleaved_1f1b | 8
                1.674,  # llama | 2 | interleaved_1f1b | 8
                1.640,  # llama | 4 | interleaved_1f1b | 8
            ],
            refs=[
                1.882,  # gpt | 2 | interleaved_1f1b | 8: ideal pp(1-b)
                3.368,  # gpt | 4 | interleaved_1f1b | 8
                1.882,  # llama | 2 | interleaved_1f1b | 8
                3.368,  # llama | 4 | interleaved_1f1b | 8
            ],
        ),
    ],
    fmt="{:.3f}",
    ref_name="ideal pp (1 - bubble)",
    ref_short="ideal",
    vlines=[(1.0, "one rank"), (2.0, "2 cores")],
    caption=(
        "Bars: median over 4 alternated rounds of the speedup of the pipelined step over the same model on one "
        "process (same global batch, accumulation over the microbatches). Marks: the ideal pp (1 - bubble), the "
        "bubble from torch's own schedule table. At pp 4 four ranks share 2 cores, so no run can pass 2x there: "
        "the pp 4 bars measure the machine more than the schedule. "
        "Command: python benchmarks/bench_pipeline_throughput.py. " + REGENERATE
    ),
)

# (b) Memory per rank. docs/benchmarks_history.md, "Meta-device construction: memory and set-up time
# (`meta_memory.py`)", "Memory per rank (MiB above baseline; ranks 0 / 1 / 2 / 3)"; pipe is rank 0.
MEMORY = Chart(
    name="memory_per_rank",
    title="Memory per rank, eager and meta-device construction (4 ranks, CPU, Hugging Face Llama)",
    x_title="MiB above the process's baseline, per rank",
    categories=[
        "0.43 B, zero3, eager",
        "0.43 B, zero3, meta",
        "0.94 B, zero3, meta",
        "0.94 B, pipe, meta (rank 0)",
        "0.94 B, tp, meta",
        "1.65 B, zero3, meta",
    ],
    series=[
        # MiB per rank, in the categories' order; refs: the predicted set-up peak (share + largest unit), for meta
        # construction only (none for eager).
        Series("own share after set-up", values=[415, 415, 897, 1215, 1272, 1576]),
        Series("set-up peak", values=[1730, 752, 1236, 1433, 1551, 1793], refs=[None, 665, 1147, 1465, 1522, 1769]),
        Series("first-step peak", values=[2184, 2185, 3155, 2777, 2613, 4046]),
    ],
    fmt="{:.0f}",
    ref_name="predicted set-up peak (own share + largest unit)",
    ref_short="predicted",
    caption=(
        "Peak resident memory (VmHWM, reset at each phase) per rank above the process's baseline, fp32, 4 ranks "
        "over gloo. Meta-device construction holds the rank's own share plus one unit at set-up, where eager "
        "construction holds the whole model on every rank (0.43 B: 1730 against 752 MiB). Under zero3 the first "
        "step, not the set-up, sets the peak (FSDP2's root group). The 1.65 B model needs 24.6 GiB for 4 eager "
        "copies, more than the machine has; meta trains it. "
        "Command: python benchmarks/meta_memory.py --models 1b (and --only zero3 --models mid --rounds 1; "
        "--models none --big --seq 16). " + REGENERATE
    ),
)

# (b') Memory per rank against the degree. docs/benchmarks_history.md, "Context parallelism
# (`bench_context_parallel.py`)", the table of saved activations ("saved for backward per rank", "trunk / cp 1").
CONTEXT = Chart(
    name="memory_context_parallel",
    title="Activations saved for backward per rank against the context-parallel degree (Llama, sequence 512)",
    x_title="MiB saved for backward per rank (whole model)",
    categories=["cp 1", "cp 2", "cp 4"],
    series=[
        Series(
            "all-gather of K, V (default)",
            values=[
                85.86,  # cp 1 | - | saved for backward per rank
                44.18,  # cp 2 | allgather
                23.35,  # cp 4 | allgather
            ],
            labels=[
                "85.86",
                "44.18 (trunk / cp 1: 0.500)",  # cp 2 | allgather | trunk / cp 1
                "23.35 (trunk / cp 1: 0.250)",  # cp 4 | allgather | trunk / cp 1
            ],
        ),
        Series(
            "Ulysses",
            values=[
                None,  # cp 1 runs no context parallelism: one bar
                46.31,  # cp 2 | ulysses | saved for backward per rank
                24.42,  # cp 4 | ulysses
            ],
            labels=[
                "",
                "46.31 (trunk / cp 1: 0.525)",  # cp 2 | ulysses | trunk / cp 1
                "24.42 (trunk / cp 1: 0.263)",  # cp 4 | ulysses | trunk / cp 1
            ],
        ),
    ],
    fmt="{:.2f}",
    caption=(
        "Bytes saved for backward on each rank in the last step's forward, 4 ranks on the 2-core CPU, 2 samples "
        "per rank in every layout. Inside the trunk the all-gather mode keeps exactly 1/cp (attention is "
        "recomputed in backward); Ulysses keeps one more local-size tensor per layer. The embedding, head and loss "
        "run on the whole sequence on every rank (2.52 MiB here). "
        "Command: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_context_parallel.py. "
        + REGENERATE
    ),
)

# (c) Bubble per schedule. docs/benchmarks_history.md, "Pipeline bubble (`bench_pipeline_bubble.py`)",
# "p = 4 (4 ranks on 2 cores; 17 min, 2026-11-30 11:11)": "bubble measured" (bar), "theory (table replay)" (mark).
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
BUBBLE = Chart(
    name="bubble_per_schedule",
    title="Pipeline bubble per schedule, 4 stages, 100 ms of work per pass",
    x_title="bubble: share of the step a rank waits on its peers",
    categories=SCHEDULES,
    series=[
        # In SCHEDULES' order: "bubble measured" (values) and "theory (table replay)" (refs) at m = 8, then m = 32.
        Series("m = 8 microbatches", values=[0.274, 0.274, 0.159, 0.161, 0.062, 0.061, 0.112],
               refs=[0.273, 0.273, 0.158, 0.158, 0.059, 0.059, 0.111]),
        Series("m = 32 microbatches", values=[0.088, 0.088, 0.046, 0.048, 0.017, 0.016, 0.033],
               refs=[0.086, 0.086, 0.045, 0.045, 0.015, 0.015, 0.030]),
    ],
    fmt="{:.3f}",
    ref_name="theory: torch's schedule table replayed",
    ref_short="theory",
    caption=(
        "Stages whose work is a calibrated sleep (F = B = W = 100 ms per microbatch per rank), driven by torch's "
        "schedules as the strategy drives them; measured bubble = time a rank waits on its peers over the step, "
        "mean over ranks, median of 5 steps. Marks: the same schedule's action table replayed with free "
        "communication. "
        "Command: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline_bubble.py. "
        + REGENERATE
    ),
)

# Per-step overhead. docs/benchmarks_history.md, "Per-step overhead on a tiny model (`bench_overhead.py`)",
# "Every family again (2026-12-03, session 34 ...)": the median of rounds of each run (not the fastest step's).
OVERHEAD = Chart(
    name="overhead_per_step",
    title="Per-step overhead over Lightning's ddp on a tiny GPT (2 ranks, CPU, gloo)",
    x_title="ms per step over the baseline (median of 4 rounds)",
    categories=[
        "zero0",
        "zero1",
        "zero2",
        "Fabric zero1 (vs Fabric ddp)",
        "moe (vs ddp on MoE-GPT)",
        "pipe",
        "cp",
        "deepspeed_zero1",
        "zero3",
        "tp",
        "sp",
    ],
    series=[
        Series(
            "run 1",
            values=[
                -1.28,  # `zero0` | run 1
                +0.94,  # `zero1`
                +0.63,  # `zero2`
                +0.52,  # Fabric `zero1` (vs Fabric `ddp`)
                +2.16,  # `moe` (vs `ddp` on MoE-GPT)
                +4.00,  # `pipe`
                +6.89,  # `cp`
                +7.29,  # `deepspeed_zero1`
                +12.64,  # `zero3`
                +16.68,  # `tp`
                +29.02,  # `sp`
            ],
        ),
        Series(
            "run 2",
            values=[
                -0.79,  # `zero0` | run 2
                +0.04,  # `zero1`
                +1.26,  # `zero2`
                +0.30,  # Fabric `zero1` (vs Fabric `ddp`)
                +4.74,  # `moe` (vs `ddp` on MoE-GPT)
                +4.43,  # `pipe`
                +6.98,  # `cp`
                +5.28,  # `deepspeed_zero1`
                +11.92,  # `zero3`
                +14.50,  # `tp`
                +32.16,  # `sp`
            ],
        ),
    ],
    fmt="{:+.2f}",
    vlines=[(1.0, "the bar: 1 ms")],
    caption=(
        "GPT with 2 layers, n_embd 64, sequence 32, per-rank batch 4 (~0.1 M parameters): a step of ~10 ms, so what "
        "a layout adds per step shows. Two runs of 4 alternated rounds x 30 steps, at load 1.3 -> 5.8 and 5.5 -> "
        "6.1. Each collective a layout adds costs 0.2-0.5 ms on gloo here; the data-parallel engines send about as "
        "many as ddp. "
        "Command: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py. "
        + REGENERATE
    ),
)

CHARTS = [SCALING, MEMORY, CONTEXT, BUBBLE, OVERHEAD]

# Layout, in pixels.
WIDTH = 860
LEFT = 210  # category labels
RIGHT = 200  # value labels past the longest bar
BAR = 15
GAP = 12  # between groups
FONT = "font-family='Helvetica, Arial, sans-serif'"


def nice_step(span: float, ticks: int = 6) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about `ticks` intervals over `span`."""
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw:
            return m * power
    return 10 * power


def wrap(text: str, width: int) -> list[str]:
    """Greedy word wrap at `width` characters."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def render(chart: Chart) -> str:
    """The chart as an SVG document."""
    values = [v for s in chart.series for v in s.values if v is not None]
    refs = [r for s in chart.series for r in (s.refs or []) if r is not None]
    extent = values + refs + [x for x, _ in chart.vlines]
    lo, hi = min(0.0, *extent), max(0.0, *extent)
    step = nice_step(hi - lo)
    # The axis ends on a tick on the right; on the left at zero, or just past a negative value (a tick there
    # could waste most of the plot on a small negative bar).
    lo, hi = lo - 0.03 * (hi - lo) if lo < 0 else 0.0, math.ceil(hi / step) * step
    plot_w = WIDTH - LEFT - RIGHT

    def x_of(v: float) -> float:
        return LEFT + (v - lo) / (hi - lo) * plot_w

    out: list[str] = []
    y = 28
    out.append(
        f"<text x='{WIDTH / 2:.0f}' y='{y}' text-anchor='middle' font-size='15' font-weight='bold'>"
        f"{escape(chart.title)}</text>"
    )
    # Legend: one swatch per series, then the reference mark; a new row when an entry would pass the edge.
    entries: list[tuple[str, str]] = [(COLORS[i % len(COLORS)], s.name) for i, s in enumerate(chart.series)]
    if refs:
        entries.append(("", chart.ref_name))
    y += 22
    lx = LEFT
    for colour, name in entries:
        width = 30 + 7 * len(name)
        if lx > LEFT and lx + width > WIDTH - 16:
            lx, y = LEFT, y + 18
        if colour:
            out.append(f"<rect x='{lx}' y='{y - 10}' width='12' height='12' fill='{colour}'/>")
        else:
            out.append(
                f"<line x1='{lx + 6}' y1='{y - 12}' x2='{lx + 6}' y2='{y + 3}' stroke='#000' stroke-width='2.5'/>"
            )
        out.append(f"<text x='{lx + 17}' y='{y}' font-size='12'>{escape(name)}</text>")
        lx += width
    top = y + 16
    n = len(chart.series)
    group = n * BAR + GAP
    bottom = top + len(chart.categories) * group
    # Grid and ticks.
    k = math.ceil(lo / step - 1e-9)
    while k * step <= hi + step / 1e6:
        v = k * step
        x = x_of(v)
        colour = "#888" if abs(v) < step / 1e6 else "#e3e3e3"
        out.append(f"<line x1='{x:.1f}' y1='{top - 4}' x2='{x:.1f}' y2='{bottom}' stroke='{colour}'/>")
        out.append(f"<text x='{x:.1f}' y='{bottom + 15}' text-anchor='middle' font-size='11' fill='#444'>{v:g}</text>")
        k += 1
    out.append(
        f"<text x='{LEFT + plot_w / 2:.0f}' y='{bottom + 34}' text-anchor='middle' font-size='12'>"
        f"{escape(chart.x_title)}</text>"
    )
    # Bars, marks and values.
    for c, category in enumerate(chart.categories):
        gy = top + c * group
        out.append(
            f"<text x='{LEFT - 8}' y='{gy + n * BAR / 2 + 4:.1f}' text-anchor='end' font-size='12'>"
            f"{escape(category)}</text>"
        )
        for i, s in enumerate(chart.series):
            v = s.values[c]
            if v is None:
                continue
            by = gy + i * BAR
            x0, x1 = sorted((x_of(0.0), x_of(v)))
            out.append(
                f"<rect x='{x0:.1f}' y='{by + 1}' width='{max(x1 - x0, 1):.1f}' height='{BAR - 2}' "
                f"fill='{COLORS[i % len(COLORS)]}'/>"
            )
            end = x1
            ref = s.refs[c] if s.refs else None
            if ref is not None:
                xr = x_of(ref)
                out.append(
                    f"<line x1='{xr:.1f}' y1='{by - 1}' x2='{xr:.1f}' y2='{by + BAR + 1}' stroke='#000' "
                    "stroke-width='2.5'/>"
                )
                end = max(end, xr)
            label = s.labels[c] if s.labels else chart.fmt.format(v)
            if ref is not None and not s.labels:
                label += f" ({chart.ref_short} {chart.fmt.format(ref)})"
            out.append(f"<text x='{end + 5:.1f}' y='{by + BAR - 3}' font-size='11' fill='#222'>{escape(label)}</text>")
    # Vertical lines, labelled above the plot.
    for v, text in chart.vlines:
        x = x_of(v)
        out.append(
            f"<line x1='{x:.1f}' y1='{top - 6}' x2='{x:.1f}' y2='{bottom}' stroke='#555' stroke-dasharray='5,4'/>"
        )
        out.append(f"<text x='{x + 4:.1f}' y='{top - 1}' font-size='10' fill='#555'>{escape(text)}</text>")
    # Caption.
    y = bottom + 56
    for line in wrap(chart.caption, 138):
        out.append(f"<text x='16' y='{y}' font-size='11' fill='#333'>{escape(line)}</text>")
        y += 15
    height = y + 4
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' {FONT}>\n<title>{escape(chart.title)}</title>\n"
        f"<rect width='{WIDTH}' height='{height}' fill='#fff'/>\n"
    )
    return head + "\n".join(out) + "\n</svg>\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for chart in CHARTS:
        path = args.out / f"{chart.name}.svg"
        path.write_text(render(chart))
        print(path)


if __name__ == "__main__":
    main()
