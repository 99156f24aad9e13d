"""Which K/V prefix rows each chunk reads, and whether a site keeps a full-sequence K/V
buffer: plain arithmetic on a chunk plan's bounds, shared by the runtime
(`runtime/kv_window.py`, `runtime/local.py`, `runtime/skeleton.py`) and the memory model (`solver/memory_model.py`), so
that what is predicted and what is kept are decided by one rule. It sits below both (it
imports nothing from sppo_fx)."""
from __future__ import annotations


def window_first(start: int, window: int | None) -> int:
    """The first position a chunk starting at `start` reads under a sliding window
    (None: 0, the whole prefix)."""
    return 0 if window is None else max(0, start - (window - 1))


def window_firsts(bounds: list[tuple[int, int]], window: int | None) -> list[int]:
    """`window_first` of every chunk."""
    return [window_first(s, window) for s, _ in bounds]


def chunk_copy_rows(bounds: list[tuple[int, int]], firsts: list[int]) -> list[int]:
    """Per chunk: the K/V rows per buffer its prefix copies (`window_prefix`) when chunk i
    reads from position firsts[i] on: those of a chunk whose prefix reaches back past the
    previous chunk's start (0 otherwise)."""
    rows = [0] * len(bounds)
    for i in range(1, len(bounds)):
        start, lo = bounds[i][0], firsts[i]
        rows[i] = start - lo if lo < bounds[i - 1][0] else 0
    return rows


def copy_rows(bounds: list[tuple[int, int]], firsts: list[int]) -> int:
    """K/V rows per buffer the prefixes copy over the whole sequence (`chunk_copy_rows`)."""
    return sum(chunk_copy_rows(bounds, firsts))


def keeps_no_buffer(bounds: list[tuple[int, int]], firsts: list[int]) -> bool:
    """Whether a site whose chunks read from positions `firsts` on keeps no full-sequence
    K/V buffer under these chunk bounds: its prefix copies are fewer rows than the
    sequence. The one test the runtime (`StageRunner._prefix`) and the memory model
    (`solver.memory_model`, with `window_firsts`) share."""
    return bool(bounds) and copy_rows(bounds, firsts) < bounds[-1][1]


# ---- the streamed skeleton (skeleton="offload", runtime/skeleton.py) --------------------

def kept_first(start: int, end: int, window: int | None) -> int:
    """The first K/V row of chunk [start, end) that a later chunk reads: with a window of W,
    the next chunk's window reaches back W-1 positions (end when W = 1: nothing is read),
    so the streamed skeleton stores only rows kept_first..end-1."""
    return start if window is None else max(start, end - (window - 1))


def stored_first(bounds: list[tuple[int, int]], firsts: list[int], j: int) -> int:
    """`kept_first` for any first positions read (`firsts`, per chunk, nondecreasing: a
    window's `window_firsts`, or a packed document's start): the next chunk reads the most."""
    start, end = bounds[j]
    return min(end, max(start, firsts[j + 1])) if j + 1 < len(bounds) else end


def blocks_read(bounds: list[tuple[int, int]], i: int, window: int | None, firsts: list[int] | None = None
                ) -> list[int]:
    """The earlier chunks whose K/V chunk i reads: those ending after the first position it
    reads (its window's, or `firsts[i]`; every earlier chunk without either)."""
    first = window_first(bounds[i][0], window) if firsts is None else firsts[i]
    return [j for j in range(i) if bounds[j][1] > first]


def last_reader(bounds: list[tuple[int, int]], j: int, firsts: list[int]) -> int:
    """The last chunk whose reads (from `firsts` on) reach chunk j's K/V (j when none does)."""
    last = j
    for i in range(j + 1, len(bounds)):
        if bounds[j][1] > firsts[i]:
            last = i
    return last
