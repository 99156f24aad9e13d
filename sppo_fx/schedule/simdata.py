"""What the schedule simulator (:mod:`sppo_fx.schedule.simulator`) reads and returns: the
per-(stage, chunk) costs of a schedule's actions and the predicted step.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, NamedTuple, Optional, Sequence, Union

from tabulate import tabulate

from sppo_fx.schedule.actions import Action

__all__ = ["ActionCosts", "CostTable", "SimEvent", "SimResult"]

#: (stage, chunk) -> number: a constant, a per-chunk sequence (same for every stage), a
#: [stage][chunk] nested sequence, or a callable ``f(stage, chunk)``.
CostTable = Union[float, Sequence[float], Sequence[Sequence[float]], Callable[[int, int], float]]


def _table(value, P: int, N: int, name: str) -> list[list[float]]:
    """Normalise a CostTable to a [P][N] list of floats."""
    if value is None:
        return [[0.0] * N for _ in range(P)]
    if callable(value):
        return [[float(value(s, i)) for i in range(N)] for s in range(P)]
    if isinstance(value, numbers.Number):
        return [[float(value)] * N for _ in range(P)]
    rows = list(value)
    if rows and all(isinstance(x, numbers.Number) for x in rows):
        if len(rows) != N:
            raise ValueError(f"ActionCosts.{name}: a flat sequence must have one entry per chunk "
                             f"({N}), got {len(rows)}")
        return [[float(x) for x in rows] for _ in range(P)]
    if len(rows) != P or any(len(r) != N for r in rows):
        raise ValueError(f"ActionCosts.{name}: expected [stage][chunk] of shape ({P}, {N}), got "
                         f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}")
    return [[float(x) for x in r] for r in rows]


@dataclasses.dataclass
class ActionCosts:
    """Durations and sizes of the actions of a schedule, per (stage, chunk).

    Every table is a :data:`CostTable`: a constant, a per-chunk list, a ``[stage][chunk]``
    list, or a callable ``f(stage, chunk)``. All micro-batches cost the same.

    Attributes:
        forward_seconds: duration of ``F`` on the compute stream.
        backward_seconds: duration of ``B`` (include recompute time here when activations
            are recomputed).
        activation_bytes: saved (level-2) activation bytes of the chunk, on the device from
            ``F`` end until ``B`` end unless offloaded.
        offload_bytes: bytes an ``OFFLOAD`` moves (``a_i * activation_bytes`` for an offload
            ratio ``a_i``); ``None`` means all of ``activation_bytes``.
        kv_bytes: K/V (level-1, skeletal) bytes of the chunk, held from ``F`` end to ``B`` end.
        send_bytes: bytes of the activation a stage sends forward (the gradient sent back
            has the same size).
        workspace_bytes: transient bytes held while the chunk's ``F`` or ``B`` runs.
        static_bytes: per-stage constant bytes (a number, a per-stage list, or ``f(stage)``).
        duration: optional ``f(action) -> seconds`` that overrides the forward/backward
            tables (per action, so it may depend on the micro-batch).
    """

    forward_seconds: CostTable = 0.0
    backward_seconds: CostTable = 0.0
    activation_bytes: CostTable = 0.0
    offload_bytes: Optional[CostTable] = None
    kv_bytes: CostTable = 0.0
    send_bytes: CostTable = 0.0
    workspace_bytes: CostTable = 0.0
    static_bytes: Union[float, Sequence[float], Callable[[int], float]] = 0.0
    duration: Optional[Callable[[Action], float]] = None

    @classmethod
    def from_callable(cls, duration: Callable[[Action], float], activation_bytes: CostTable = 1.0,
                      **kwargs) -> "ActionCosts":
        """Costs whose F/B durations come from ``duration(action)``.

        Args:
            duration: seconds of each ``F`` / ``B`` action (other kinds are ignored).
            activation_bytes: saved bytes per chunk (default 1: memory counts chunks).
            **kwargs: other ActionCosts fields.

        Returns:
            The ActionCosts.
        """
        return cls(duration=duration, activation_bytes=activation_bytes, **kwargs)

    def static_list(self, P: int) -> list[float]:
        """``static_bytes`` as one float per stage."""
        v = self.static_bytes
        if callable(v):
            return [float(v(s)) for s in range(P)]
        if isinstance(v, numbers.Number):
            return [float(v)] * P
        v = list(v)
        if len(v) != P:
            raise ValueError(f"ActionCosts.static_bytes: expected {P} entries, got {len(v)}")
        return [float(x) for x in v]


class SimEvent(NamedTuple):
    """One interval on one resource of one rank.

    Attributes:
        rank: the rank (pipeline stage).
        resource: "compute", "d2h", "h2d", "disk", "link->r<peer>" or "recv<-r<peer>".
        name: the action it belongs to, e.g. ``"0F0.3"`` (disk lane: ``"0OFF0.3:write"``).
        start / end: seconds from the start of the step.
        category: "forward", "backward", "stall", "send", "recv", "offload", "prefetch",
            "disk_write" or "disk_read".
        nbytes: bytes moved (0 for compute).
    """

    rank: int
    resource: str
    name: str
    start: float
    end: float
    category: str
    nbytes: float = 0.0


@dataclasses.dataclass
class SimResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
        num_stages: P.
        step_seconds: makespan (the last compute or copy to finish).
        busy_seconds: per rank, seconds the compute stream ran F/B.
        stall_seconds: per rank, seconds the compute stream was blocked by WAIT.
        finish_seconds: per rank, when its last compute ended.
        peak_bytes: per rank, the peak device bytes (static + activations + K/V + ...).
        peak_host_bytes: per rank, the peak host bytes of offloaded activations.
        memory_timeline: per rank, ``[(time, device bytes from then on)]``, time-ordered.
        events: every interval, for tracing (empty with ``record_events=False``).
        offloaded_bytes: per rank, the bytes moved device -> host.
    """

    num_stages: int
    step_seconds: float
    busy_seconds: dict[int, float]
    stall_seconds: dict[int, float]
    finish_seconds: dict[int, float]
    peak_bytes: dict[int, float]
    peak_host_bytes: dict[int, float]
    memory_timeline: dict[int, list[tuple[float, float]]]
    events: list[SimEvent]
    offloaded_bytes: dict[int, float]

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(busy) / (P * step_seconds)``."""
        if self.step_seconds <= 0:
            return 0.0
        return 1.0 - sum(self.busy_seconds.values()) / (self.num_stages * self.step_seconds)

    @property
    def max_peak_bytes(self) -> float:
        """The largest per-rank peak."""
        return max(self.peak_bytes.values(), default=0.0)

    def summary(self) -> str:
        """One line of totals and a table with a row per rank."""
        rows = [(r, f"{self.busy_seconds[r]:.4g}", f"{self.stall_seconds[r]:.4g}",
                 f"{self.finish_seconds[r]:.4g}", f"{self.peak_bytes[r] / 2**30:.3f}",
                 f"{self.peak_host_bytes[r] / 2**30:.3f}") for r in range(self.num_stages)]
        head = (f"step {self.step_seconds:.4g} s, bubble {self.bubble_fraction:.1%}, "
                f"peak {self.max_peak_bytes / 2**30:.3f} GiB")
        return head + "\n" + tabulate(rows, headers=["rank", "busy s", "stall s", "finish s",
                                                      "peak GiB", "host GiB"])
