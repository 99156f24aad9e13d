"""Chrome / Perfetto traces of simulated and measured pipeline steps.

The format is the Chrome "Trace Event Format" JSON object that chrome://tracing and
https://ui.perfetto.dev open directly::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

* ``ph: "X"`` complete events: ``name``, ``cat``, ``ph``, ``ts`` (µs), ``dur`` (µs),
  ``pid`` (the rank), ``tid`` (the resource, an int), ``args`` (a dict).
* ``ph: "M"`` metadata events name the processes (``process_name``: "rank 0") and threads
  (``thread_name``: "compute", "d2h", "h2d", "disk", "link->r1", ...) and fix their order
  (``thread_sort_index``).
* ``ph: "C"`` counter events (optional) draw each rank's device memory over time.

Resources map to thread ids in a fixed order (:data:`TID_BASE`): compute 0, d2h 1, h2d 2,
disk 3, then links and receives from 4 in the order first seen (sorted by name), so two
traces of the same plan line up.

:func:`simulated_trace` turns a :class:`~sppo_fx.schedule.simulator.SimResult` into such a
trace (the `sppo-fx trace` command); :func:`write_trace` writes the JSON,
:func:`summarize_trace` gives a plain-text per-(rank, resource) summary and
:func:`render_text` an ASCII Gantt chart (for machines without a browser).
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from tabulate import tabulate

__all__ = ["TID_BASE", "simulated_trace", "write_trace", "summarize_trace", "render_text"]

#: Fixed thread ids of the named resources; other resources get ids from 4 upwards.
TID_BASE = {"compute": 0, "d2h": 1, "h2d": 2, "disk": 3}

_US = 1e6


def _tid_map(resources: Iterable[str]) -> dict[str, int]:
    out = dict(TID_BASE)
    nxt = max(out.values()) + 1
    for res in sorted(set(resources) - set(out)):
        out[res] = nxt
        nxt += 1
    return out


def _metadata(pids: dict[int, str], threads: dict[tuple[int, int], str]) -> list[dict]:
    """process_name / thread_name / thread_sort_index events."""
    meta = []
    for pid, name in sorted(pids.items()):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
    for (pid, tid), name in sorted(threads.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})
    return meta


def simulated_trace(sim_result, *, memory_counters: bool = True, title: str = "") -> dict:
    """The Chrome trace of a simulated step.

    Args:
        sim_result: a SimResult from :func:`sppo_fx.schedule.simulator.simulate` (with
            ``record_events=True``).
        memory_counters: also emit ``ph: "C"`` counters of each rank's device memory (GiB).
        title: stored in ``otherData.title``.

    Returns:
        The trace dict (``traceEvents``, ``displayTimeUnit``, ``otherData``).
    """
    events = list(sim_result.events)
    tids = _tid_map(e.resource for e in events)
    threads: dict[tuple[int, int], str] = {}
    pids = {r: f"rank {r} (stage {r})" for r in range(sim_result.num_stages)}
    out: list[dict] = []
    for e in events:
        tid = tids[e.resource]
        threads[(e.rank, tid)] = e.resource
        args = {"resource": e.resource, "start_s": e.start, "end_s": e.end}
        if e.nbytes:
            args["bytes"] = int(e.nbytes)
        out.append({"name": e.name, "cat": e.category, "ph": "X", "ts": e.start * _US,
                    "dur": max(e.end - e.start, 0.0) * _US, "pid": e.rank, "tid": tid, "args": args})
    if memory_counters:
        for r, timeline in sim_result.memory_timeline.items():
            for t, b in timeline:
                out.append({"name": "device memory", "ph": "C", "ts": t * _US, "pid": r, "tid": 0,
                            "args": {"GiB": b / 2**30}})
    out.sort(key=lambda d: (d["ts"], d["pid"], d.get("tid", 0)))
    return {
        "traceEvents": _metadata(pids, threads) + out,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "sppo_fx simulator (model prediction, not a measurement)",
            "title": title,
            "step_seconds": sim_result.step_seconds,
            "bubble_fraction": sim_result.bubble_fraction,
            "peak_bytes": {str(r): v for r, v in sim_result.peak_bytes.items()},
        },
    }


def write_trace(path: str | os.PathLike, trace: dict) -> str:
    """Write ``trace`` as JSON to ``path`` (parent folders are created).

    Args:
        path: destination file (``.json``).
        trace: a trace dict.

    Returns:
        The path as a string.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path


def summarize_trace(trace: dict, top: int = 3) -> str:
    """A plain-text look at a trace: per (process, thread) busy time and utilisation.

    Args:
        trace: a trace dict.
        top: how many of the longest events to list per thread.

    Returns:
        A table (one row per thread) followed by the span of the trace.
    """
    names: dict[tuple[int, int], str] = {}
    pnames: dict[int, str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pnames[e["pid"]] = e["args"]["name"]
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not xs:
        return "(empty trace)"
    t0 = min(e["ts"] for e in xs)
    t1 = max(e["ts"] + e["dur"] for e in xs)
    span = max(t1 - t0, 1e-9)
    groups: dict[tuple[int, int], list[dict]] = {}
    for e in xs:
        groups.setdefault((e["pid"], e["tid"]), []).append(e)
    rows = []
    for (pid, tid), evs in sorted(groups.items()):
        by_cat: dict[str, float] = {}
        for e in evs:
            by_cat[e["cat"]] = by_cat.get(e["cat"], 0.0) + e["dur"]
        busy = sum(by_cat.values())
        longest = sorted(evs, key=lambda e: -e["dur"])[:top]
        rows.append((pnames.get(pid, pid), names.get((pid, tid), tid), len(evs),
                     f"{busy / 1e3:.1f}", f"{busy / span:.0%}",
                     ", ".join(f"{c} {v / 1e3:.1f}" for c, v in sorted(by_cat.items())),
                     ", ".join(f"{e['name']} {e['dur'] / 1e3:.1f}" for e in longest)))
    table = tabulate(rows, headers=["process", "thread", "events", "busy ms", "of span",
                                    "ms by category", f"longest {top} (ms)"])
    return table + f"\ntrace span: {span / 1e3:.2f} ms"


#: One character per category in :func:`render_text`.
TEXT_GLYPHS = {"forward": "F", "backward": "B", "stall": "!", "offload": "o", "prefetch": "p",
               "send": ">", "recv": ".", "disk_write": "w", "disk_read": "r"}


def render_text(trace: dict, width: int = 100, resources: Optional[Iterable[str]] = None) -> str:
    """An ASCII Gantt chart of a trace: one row per (process, thread), time left to right.

    Each column covers ``span / width`` of time and shows the glyph of the category that
    occupies most of it (:data:`TEXT_GLYPHS`; F forward, B backward, ! stall, o offload,
    p prefetch, > send) when the resource is busy at least half of the column, ``,`` when it
    is busy for less, and a space when it is idle.

    Args:
        trace: a trace dict.
        width: columns.
        resources: thread names to show (default: all but the "recv<-" threads).

    Returns:
        The chart, with a legend line.
    """
    names: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not xs:
        return "(empty trace)"
    keep = set(resources) if resources is not None else None
    t0 = min(e["ts"] for e in xs)
    span = max(max(e["ts"] + e["dur"] for e in xs) - t0, 1e-9)
    col = span / width
    rows: dict[tuple[int, int], list[dict[str, float]]] = {}
    for e in xs:
        key = (e["pid"], e["tid"])
        name = names.get(key, str(e["tid"]))
        if (keep is not None and name not in keep) or (keep is None and name.startswith("recv<-")):
            continue
        cells = rows.setdefault(key, [dict() for _ in range(width)])
        a, b = e["ts"] - t0, e["ts"] - t0 + e["dur"]
        for c in range(int(a // col), min(int(b // col) + 1, width)):
            lo, hi = c * col, (c + 1) * col
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                cells[c][e["cat"]] = cells[c].get(e["cat"], 0.0) + overlap
    label_w = max(len(f"r{p} {names.get((p, t), t)}") for p, t in rows) if rows else 0
    lines = []
    for (pid, tid), cells in sorted(rows.items()):
        text = "".join(" " if not c else TEXT_GLYPHS.get(max(c, key=c.get), "#")
                       if sum(c.values()) >= 0.5 * col else "," for c in cells)
        lines.append(f"{f'r{pid} {names.get((pid, tid), tid)}':<{label_w}} |{text}|")
    legend = ", ".join(f"{g} {k}" for k, g in TEXT_GLYPHS.items() if k != "recv") + ", ',' <50% busy"
    lines.append(f"{'':<{label_w}}  0 .. {span / 1e6:.4g} s, {col / 1e3:.3g} ms per column; {legend}")
    return "\n".join(lines)
