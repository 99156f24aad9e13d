"""How much of the activation store's copy time is hidden behind compute, from a
`torch.profiler` trace of one training step (Chrome-trace events, as `export_chrome_trace`
writes them).

    result, overlap = profile_step(step)      # or: analyze(trace_dict_or_path)
    overlap.copy_s, overlap.hidden_s, overlap.hidden_fraction

What counts as a copy is what the store does, found by its profiler ranges
(`runtime/store/core.py`: "sppo::offload_write" / "sppo::offload_read" on its worker
threads, "sppo::copy_wait" where the step blocks on a copy):

- CUDA (the trace has device events): copies are the device activities (memcpys, and any
  kernel a strided copy needs) launched from inside a store range, matched through the
  trace's launch correlation ids; compute is every other kernel, memset and
  device-to-device memcpy. A trace without the store's ranges (a profiler that cannot
  see worker threads) falls back to every host<->device memcpy; `source` says which.
- CPU: copies are the store ranges themselves (the disk tier's write / read work on its
  threads); compute is the op and annotation ranges of every other thread, less the
  ranges where that thread waited for a copy (a blocked step is not computing).

hidden = |union(copies) ∩ union(compute)|; the fraction is hidden / |union(copies)|.
Interval unions throughout, so nested ops and concurrent copies count once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile

COPY_OVERLAP_ENV = "SPPO_BENCH_COPY_OVERLAP"  # "1": benchmark workers profile one extra step
COPY_RANGES = ("sppo::offload_write", "sppo::offload_read")
WAIT_RANGE = "sppo::copy_wait"
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


# -- interval arithmetic (closed-open [start, end) in microseconds)
def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the input's points (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """The points in both unions (two-pointer sweep over the sorted, disjoint lists)."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """The points of union(a) not in union(b)."""
    out = []
    b = union(b)
    for s, e in union(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if e > s:
            out.append((s, e))
    return out


@dataclasses.dataclass
class CopyOverlap:
    """Copy time of one step and the part of it that overlapped compute (seconds)."""

    copy_s: float
    hidden_s: float
    copies: int  # copy events (ranges or device activities) found
    bytes: int | None  # bytes of the device memcpys counted (CUDA); None on CPU
    source: str  # what was counted as copies

    @property
    def hidden_fraction(self) -> float | None:
        return self.hidden_s / self.copy_s if self.copy_s > 0 else None

    @property
    def exposed_s(self) -> float:
        return self.copy_s - self.hidden_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hidden_fraction": self.hidden_fraction}


def _events(trace) -> list[dict]:
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        trace = trace.get("traceEvents", [])
    return [e for e in trace if e.get("ph") == "X" and "ts" in e]


def _span(e) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))


def _inside(t: float, ranges: list[tuple[float, float]]) -> bool:
    return any(s <= t < e for s, e in ranges)


def analyze(trace) -> CopyOverlap:
    """The copy overlap of a Chrome trace: a dict with "traceEvents", a list of events, or
    a path to the JSON file (see the module docstring for what counts)."""
    events = _events(trace)
    store = [e for e in events if e.get("name") in COPY_RANGES]
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    if device:
        return _analyze_cuda(events, store, device)
    copies = [_span(e) for e in store]
    copy_tids = {e.get("tid") for e in store}
    waits = [_span(e) for e in events if e.get("name") == WAIT_RANGE]
    compute = [_span(e) for e in events
               if e.get("cat") in ("cpu_op", "user_annotation") and e.get("tid") not in copy_tids
               and e.get("name") not in COPY_RANGES + (WAIT_RANGE,)
               and not str(e.get("name", "")).startswith("ProfilerStep")]
    compute = subtract(compute, waits)
    return CopyOverlap(copy_s=length(copies) / 1e6, hidden_s=length(intersect(copies, compute)) / 1e6,
                       copies=len(copies), bytes=None, source="store worker-thread ranges (CPU)")


def _analyze_cuda(events, store, device) -> CopyOverlap:
    by_tid: dict = {}
    for e in store:
        by_tid.setdefault(e.get("tid"), []).append(_span(e))
    launched = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") in _LAUNCH_CATS and e.get("tid") in by_tid
                and _inside(float(e["ts"]), by_tid[e.get("tid")])}
    launched.discard(None)

    def host_device(e) -> bool:
        return e.get("cat") == "gpu_memcpy" and any(k in e.get("name", "") for k in ("DtoH", "HtoD"))

    if store:
        is_copy = lambda e: e.get("args", {}).get("correlation") in launched  # noqa: E731
        source = "device activities launched by the store (CUDA)"
    else:
        is_copy = host_device
        source = "all host<->device memcpys (no store ranges in the trace) (CUDA)"
    copy_ev = [e for e in device if is_copy(e)]
    compute = [_span(e) for e in device if not is_copy(e) and not host_device(e)]
    copies = [_span(e) for e in copy_ev]
    nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copy_ev if e.get("cat") == "gpu_memcpy")
    return CopyOverlap(copy_s=length(copies) / 1e6, hidden_s=length(intersect(copies, compute)) / 1e6,
                       copies=len(copy_ev), bytes=nbytes, source=source)


def _all_threads_config():
    """An experimental config that profiles every thread (the store's workers were started
    before the profiler), where this torch has it; None otherwise."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def profile_step(step, cuda: bool = False):
    """Run `step()` once under the profiler; (its result, the `CopyOverlap` of its trace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kwargs = {}
    config = _all_threads_config()
    if config is not None:
        kwargs["experimental_config"] = config
    with profile(activities=activities, **kwargs) as prof:
        result = step()
        if cuda:
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(prefix="sppo_copy_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        overlap = analyze(path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    return result, overlap
