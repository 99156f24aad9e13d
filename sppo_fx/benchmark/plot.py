"""The picture of a benchmark: step time against peak extra memory, one point per row,
anchors marked, the Pareto front drawn ("what does each GiB of memory cost me in time?").

The picture is drawn by matplotlib (the optional extra `sppo_fx[plot]`), imported only when
a picture is written; the Pareto front and the terminal's text plot need nothing beyond
the standard library.
"""
from __future__ import annotations

import dataclasses
import math

from sppo_fx.errors import SppoError

MiB = 2**20
# an axis switches to a log scale when its values span at least this ratio (a decade and
# a half): a linear axis then crushes the low-memory, fast corner the picture is about
LOG_SPAN = 30.0
ANCHOR_STYLE = dict(marker="s", color="#ff7f0e")
LIBRARY_STYLE = dict(marker="o", color="#1f77b4")
FRONT_COLOR = "#d62728"


@dataclasses.dataclass
class Point:
    label: str
    seconds: float
    peak_bytes: float
    anchor: bool = False


def pareto_front(points: list[Point]) -> list[int]:
    """Indices of the points no other point beats in both time and memory (less or equal
    in both, less in one), ordered by memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i].peak_bytes, points[i].seconds))
    front, best = [], float("inf")
    for i in order:
        if points[i].seconds < best:
            front.append(i)
            best = points[i].seconds
    return front


def points_of(rows: list[dict]) -> list[Point]:
    """The rows that measured a step (failed or timed-out rows have "error" and no figures)."""
    return [Point(r["label"], r["step_s"], r["peak_extra_bytes"], r.get("anchor", False))
            for r in rows if "error" not in r and r.get("step_s") is not None
            and r.get("peak_extra_bytes") is not None]


def points_of_records(paths: list[str]) -> list[Point]:
    """The measured rows of several bench.json records in one list; a label already taken
    by an earlier record is skipped, so the first record's anchors stay the reference and
    later records add the rows the first one lacks (or failed on)."""
    from sppo_fx.benchmark import report
    points, seen = [], set()
    for path in paths:
        for p in points_of(report.load_record(path)["rows"]):
            if p.label not in seen:
                seen.add(p.label)
                points.append(p)
    return points


def require_matplotlib() -> None:
    """Raise the SppoError saying how to install matplotlib when it is missing: a grid that
    runs for hours checks this before its first row, not when it draws."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SppoError("drawing the benchmark picture needs matplotlib, which is not installed: "
                        "pip install 'sppo_fx[plot]' (or pip install matplotlib), or leave out --plot") from None
    matplotlib.use("Agg", force=True)  # files only: never open a window or need a display
    matplotlib.rcParams["svg.hashsalt"] = "sppo_fx"  # the SVG's ids fixed, so a redraw is the same file
    import matplotlib.pyplot as plt
    return plt


def _spans_decades(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) >= LOG_SPAN


def _size_label(mib: float, _pos=None) -> str:
    """A tick in memory units people read: "512 MiB", "1.5 GiB"."""
    if mib == 0:
        return "0"
    if mib >= 1024:
        return f"{mib / 1024:g} GiB"
    return f"{mib:g} MiB"


def _seconds_label(s: float, _pos=None) -> str:
    if s == 0:
        return "0"
    return f"{s:g} s" if s >= 1 else f"{s * 1000:g} ms"


def _memory_ticks(ax, xs: list[float]) -> None:
    """Memory ticks at powers of two of MiB (log axis) or at a power-of-two step (linear),
    so they read 256 MiB, 512 MiB, 1 GiB rather than 1e+03 or 1.95 GiB."""
    from matplotlib.ticker import LogLocator, MultipleLocator
    if ax.get_xscale() == "log":
        ax.xaxis.set_major_locator(LogLocator(base=2))
    else:
        ax.xaxis.set_major_locator(MultipleLocator(2.0 ** math.ceil(math.log2(max(max(xs), 1) / 8))))


def _place_labels(fig, ax, points: list[Point], xs: list[float], ys: list[float]) -> None:
    """Every point's label beside it, moved to another side of the point when it would
    cover a label already placed (greedy, in the order of memory)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    placed = []
    offsets = [(7, 5, "left", "bottom"), (7, -5, "left", "top"), (-7, 5, "right", "bottom"),
               (-7, -5, "right", "top"), (7, 14, "left", "bottom"), (7, -14, "left", "top")]
    for i in sorted(range(len(points)), key=lambda k: (xs[k], ys[k])):
        for dx, dy, ha, va in offsets:
            text = ax.annotate(points[i].label, (xs[i], ys[i]), xytext=(dx, dy), textcoords="offset points",
                               fontsize=8, color="#222", ha=ha, va=va, zorder=4)
            box = text.get_window_extent(renderer).expanded(1.02, 1.1)
            if not any(box.overlaps(other) for other in placed):
                break
            if (dx, dy) != offsets[-1][:2]:
                text.remove()
        placed.append(box)


def figure(points: list[Point], title: str = ""):
    """The matplotlib figure: anchors as squares, library rows as dots, every point labelled,
    the Pareto front joined in red with its points ringed; log axes where the values span
    decades. Returns (figure, axes)."""
    if not points:
        raise SppoError("no measured rows to draw: every row failed or the record has none")
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=110, layout="constrained")
    xs = [p.peak_bytes / MiB for p in points]
    ys = [p.seconds for p in points]
    front = pareto_front(points)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "-", color=FRONT_COLOR, lw=1.6, zorder=1,
            label="Pareto front (no row is both faster and smaller)")
    ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=190, facecolors="none",
               edgecolors=FRONT_COLOR, linewidths=1.6, zorder=2)
    for anchor, style, name in ((True, ANCHOR_STYLE, "anchor: the unmodified model (eager, torch.compile, "
                                 "checkpointing)"), (False, LIBRARY_STYLE, "sppo_fx row")):
        idx = [i for i, p in enumerate(points) if p.anchor == anchor]
        if idx:
            ax.scatter([xs[i] for i in idx], [ys[i] for i in idx], s=55, zorder=3, label=name,
                       marker=style["marker"], color=style["color"])
    if _spans_decades(xs):
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(xs) / 1.5, max(xs) * 2.2)  # room for the labels right of the points
    else:  # linear from 0, so lengths compare as ratios
        ax.set_xlim(0, max(xs) * 1.3)
    if _spans_decades(ys):
        ax.set_yscale("log")
        ax.set_ylim(min(ys) / 1.3, max(ys) * 1.3)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        ax.set_ylim(0, max(ys) * 1.15)
    _memory_ticks(ax, xs)
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.yaxis.set_major_formatter(FuncFormatter(_seconds_label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("peak extra memory of a step" + (" (log scale)" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("step time" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.grid(True, which="major", color="#ddd", lw=0.8)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, fontsize=11)
    # below the axes, so it covers no point or label
    fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    _place_labels(fig, ax, points, xs, ys)
    return fig, ax


def write_picture(points: list[Point], path: str, title: str = "") -> list[str]:
    """The picture in the format `path`'s suffix names (.png, .svg, .pdf). A .png gets the
    SVG beside it (text stays text there). Returns the files written."""
    fig, _ = figure(points, title)
    plt = _pyplot()
    written = [path]
    if path.lower().endswith(".png"):
        written.append(path[:-4] + ".svg")
    try:
        for out in written:
            # no date or software version in the files, so a redraw of the same record is the same file
            meta = {"Software": None} if out.lower().endswith(".png") else {"Date": None}
            fig.savefig(out, metadata=meta)
    finally:
        plt.close(fig)
    return written


def text_plot(points: list[Point], width: int = 60, height: int = 16) -> str:
    """The picture in characters: points numbered, the front's numbers in brackets below."""
    if not points:
        return ""
    front = pareto_front(points)
    xmax = max(p.peak_bytes for p in points) or 1.0
    ymax = max(p.seconds for p in points) or 1.0
    grid = [[" "] * width for _ in range(height)]
    for i, p in enumerate(points):
        x = min(width - 1, int(p.peak_bytes / xmax * (width - 1)))
        y = height - 1 - min(height - 1, int(p.seconds / ymax * (height - 1)))
        grid[y][x] = _mark(i)
    lines = [f"{ymax:8.3g} s |" + "".join(grid[0])]
    lines += ["           |" + "".join(row) for row in grid[1:]]
    lines.append("         0 +" + "-" * width)
    lines.append(" " * 12 + "0" + " " * (width - 12) + f"{xmax / MiB:.0f} MiB")
    for i, p in enumerate(points):
        tag = " [Pareto front]" if i in front else ""
        lines.append(f"  {_mark(i)}: {p.label}{' (anchor)' if p.anchor else ''}: {p.seconds:.3f} s, "
                     f"{p.peak_bytes / MiB:.0f} MiB{tag}")
    return "\n".join(lines)


def _mark(i: int) -> str:
    return str(i % 10) if i < 10 else chr(ord("a") + (i - 10) % 26)



def accuracy_points(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(label, predicted s, measured s) of every row that ran with a step prediction."""
    return [(r["label"], float(r["predicted_step_s"]), float(r["step_s"])) for r in rows
            if "error" not in r and r.get("predicted_step_s") and r.get("step_s")]


def write_accuracy_picture(rows: list[dict], path: str, title: str = "", band=(0.8, 1.25)) -> list[str]:
    """Predicted against measured step time, log-log, one dot per row, with y = x and the
    band measured/predicted in [band]: the solver clock's accuracy at a glance. Returns the
    files written (none when no row has a prediction)."""
    pts = accuracy_points(rows)
    if not pts:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 6))
    xs, ys = [p for _, p, _ in pts], [m for _, _, m in pts]
    lo, hi = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1, label="measured = predicted")
    ax.fill_between(line, [band[0] * v for v in line], [band[1] * v for v in line], color="#2ca02c", alpha=0.15,
                    label=f"measured / predicted in {band[0]:g}..{band[1]:g}")
    inside = [band[0] <= m / p <= band[1] for _, p, m in pts]
    for ok, color in ((True, LIBRARY_STYLE["color"]), (False, FRONT_COLOR)):
        sel = [i for i, v in enumerate(inside) if v == ok]
        ax.scatter([xs[i] for i in sel], [ys[i] for i in sel], color=color, s=18, zorder=3,
                   label=f"{len(sel)} row(s) {'inside' if ok else 'outside'} the band")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step (s)")
    ax.set_ylabel("measured step (s)")
    ax.set_title(title or "solver clock: predicted vs measured step")
    ax.legend(loc="upper left", fontsize=8)
    written = [path]
    try:
        fig.savefig(path, metadata={"Software": None} if path.lower().endswith(".png") else {"Date": None})
    finally:
        plt.close(fig)
    return written
