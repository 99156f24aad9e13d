"""Logging and progress: what the long phases of a first call are doing, and for how long.

Every module logs through `logging.getLogger("sppo_fx.<module>")` (`get_logger`). The
package's root logger "sppo_fx" has a `NullHandler` only, so library use is quiet unless the
application configures logging (`logging.getLogger("sppo_fx").setLevel(logging.INFO)` and a
handler) or the environment asks for it:

    SPPO_FX_LOG=info     progress lines: each phase of the first call and its seconds
                         (capture, passes, cost model, memory models, calibration, solver,
                         Inductor compiles)
    SPPO_FX_LOG=debug    also every FX pass's graph before and after it (passes/__init__.py)

The CLI and the demo call `enable()` (INFO on stderr).

`phase(name)` is the unit of progress: it logs "name…" when it starts, "name… 40 s" every
20 s while it runs, and "name: 52.3 s" when it ends, and adds its seconds to every `record_phases()` recorder open at the time,
which is how `SppoCompiled.phases` and `bench/first_step.py` report the first call's
breakdown.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

ROOT = "sppo_fx"
ENV = "SPPO_FX_LOG"
PREFIX = "[sppo_fx]"  # of every line the stderr handler prints
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "1": logging.INFO, "true": logging.INFO, "on": logging.INFO}
_HANDLER_TAG = "_sppo_fx_handler"

logging.getLogger(ROOT).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger of a sppo_fx module: `get_logger(__name__)` or `get_logger("solver")`."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def enable(level: int | str = logging.INFO, stream=None) -> logging.Logger:
    """Send sppo_fx's log records to `stream` (default stderr) at `level` and above.

    Idempotent: one handler of ours at most. `SPPO_FX_LOG` overrides `level` when set (so
    `SPPO_FX_LOG=debug` adds the pass graphs to the CLI's output).
    """
    root = logging.getLogger(ROOT)
    env = _env_level()
    root.setLevel(env if env is not None else _as_level(level))
    for h in root.handlers:
        if getattr(h, _HANDLER_TAG, False):
            if stream is not None:
                h.setStream(stream)
            return root
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(PREFIX + " %(message)s"))
    setattr(handler, _HANDLER_TAG, True)
    root.addHandler(handler)
    root.propagate = False  # an application's root handler would print each line twice
    return root


def _as_level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    key = str(level).strip().lower()
    if key not in _LEVELS:
        from sppo_fx.errors import SppoError
        raise SppoError(f"log level {level!r}: use one of {sorted(set(_LEVELS) - {'1', 'true', 'on'})}")
    return _LEVELS[key]


def _env_level() -> int | None:
    value = os.environ.get(ENV, "").strip()
    return _as_level(value) if value else None


def configure_from_env() -> None:
    """Enable logging on stderr when `SPPO_FX_LOG` is set (called when sppo_fx is imported)."""
    if _env_level() is not None:
        enable()


# ------------------------------------------------------------------ phases and recorders

_recorders_lock = threading.Lock()
_recorders: list[list] = []
_depth = threading.local()  # phases inside a phase are logged, not recorded (no double count)


@contextlib.contextmanager
def record_phases():
    """Collect `(phase name, seconds)` of every phase that ends inside the block."""
    rows: list[tuple[str, float]] = []
    with _recorders_lock:
        _recorders.append(rows)
    try:
        yield rows
    finally:
        with _recorders_lock:
            _recorders.remove(rows)


HEARTBEAT_S = 20.0


def _heartbeat(name: str, logger: logging.Logger, level: int, t0: float, done: threading.Event) -> None:
    while not done.wait(HEARTBEAT_S):
        logger.log(level, "%s… %.0f s", name, time.perf_counter() - t0)


@contextlib.contextmanager
def phase(name: str, logger: logging.Logger | None = None, level: int = logging.INFO):
    """Log `name…` now, `name… 40 s` every HEARTBEAT_S seconds while it runs, and `name: N s`
    when the block ends; record the seconds."""
    logger = logger or get_logger(ROOT)
    logger.log(level, "%s…", name)
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    t0 = time.perf_counter()
    done = threading.Event()
    if logger.isEnabledFor(level):
        threading.Thread(target=_heartbeat, args=(name, logger, level, t0, done), daemon=True,
                         name="sppo_fx-progress").start()
    try:
        yield
    finally:
        done.set()
        seconds = time.perf_counter() - t0
        _depth.n = depth
        logger.log(level, "%s: %.1f s", name, seconds)
        if depth == 0:
            with _recorders_lock:
                for rows in _recorders:
                    rows.append((name, seconds))


def summarize(rows: list[tuple[str, float]], total: float | None = None) -> list[tuple[str, float]]:
    """Sum the seconds of phases with the same name (first-seen order); with `total`, add an
    "other" row for the time no phase covered."""
    sums: dict[str, float] = {}
    for name, seconds in rows:
        sums[name] = sums.get(name, 0.0) + seconds
    out = list(sums.items())
    if total is not None:
        out.append(("other (running the step, Python)", max(total - sum(sums.values()), 0.0)))
    return out


configure_from_env()
