"""Pipeline schedules as plain data, with a single-process validator.

A model is split into ``P`` pipeline stages; stage ``s`` runs on rank ``s``.
A training step processes ``M`` micro-batches, and each micro-batch is one long
sequence cut into ``N`` sequence chunks.  A *schedule* says, for every rank, the
exact order in which that rank runs its actions.  Nothing here needs torch: a
schedule is a list of small frozen records that print as short strings.

Action grammar
--------------

::

    action     ::= stage kind microbatch "." chunk
    kind       ::= "F" | "B"                                  compute
                 | "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B"  point-to-point
                 | "OFF" | "PRE" | "WAIT"                     activation memory
    stage, microbatch, chunk ::= decimal integer >= 0

``stage`` is always the stage that *executes* the action, i.e. the rank whose
list holds it.  ``microbatch.chunk`` names the sequence chunk the action is
about.  The kinds mean:

============  =====================  ==============================================
kind          example                meaning
============  =====================  ==============================================
``F``         ``0F1.2``              stage 0 forward of micro-batch 1, chunk 2
``B``         ``0B1.2``              stage 0 backward of micro-batch 1, chunk 2
``SEND_F``    ``0SEND_F1.2``         stage 0 sends the output activation of
                                     ``0F1.2`` to stage 1
``RECV_F``    ``1RECV_F1.2``         stage 1 receives it (pairs with ``0SEND_F1.2``)
``SEND_B``    ``1SEND_B1.2``         stage 1 sends the input gradient of ``1B1.2``
                                     to stage 0
``RECV_B``    ``0RECV_B1.2``         stage 0 receives it (pairs with ``1SEND_B1.2``)
``OFF``       ``0OFF1.2``            start copying the saved activations of
                                     ``0F1.2`` to host memory (ActionKind.OFFLOAD)
``PRE``       ``0PRE1.2``            start copying them back (ActionKind.PREFETCH)
``WAIT``      ``0WAIT1.2``           block until that prefetch has landed
============  =====================  ==============================================

A :class:`Schedule` prints one header line and one line per rank, and
:meth:`Schedule.parse` reads that text back.  For example
``print(gpipe_schedule(2, 1, 2))`` gives::

    # stages=2 microbatches=1 chunks=2
    rank 0: 0F0.0 0SEND_F0.0 0F0.1 0SEND_F0.1 0RECV_B0.1 0B0.1 0RECV_B0.0 0B0.0
    rank 1: 1RECV_F0.0 1F0.0 1RECV_F0.1 1F0.1 1B0.1 1SEND_B0.1 1B0.0 1SEND_B0.0

Dependencies (checked by :func:`validate`)
------------------------------------------

* ``F(s,m,i)`` needs ``F(s-1,m,i)`` (delivered by ``RECV_F(s,m,i)``) and
  ``F(s,m,i-1)`` (the K/V prefix of the earlier chunks).
* ``B(s,m,i)`` needs ``F(s,m,i)``, ``B(s+1,m,i)`` (delivered by
  ``RECV_B(s,m,i)``) and ``B(s,m,i+1)`` (backward runs in reverse chunk order:
  chunk ``i``'s K/V gradients accumulate from every later chunk).  On the last
  stage the loss is global over the sequence, so ``B(P-1,m,i)`` needs
  ``F(P-1,m,N-1)``.
* ``SEND_F`` / ``SEND_B`` come after the compute that produces the tensor; a
  send and its receive are matched in order (blocking point-to-point), so each
  rank must post its sends to a peer in the same order as the peer posts the
  matching receives.
* ``OFF`` after ``F``; ``PRE`` after ``OFF``; ``WAIT`` after ``PRE``; ``B``
  after ``WAIT`` whenever the activations were offloaded.

Generators
----------

:func:`gpipe_schedule` (all forwards, then all backwards) and
:func:`one_f_one_b_schedule` (chunk-level 1F1B) build schedules; both accept an
``offload`` set of ``(stage, microbatch, chunk)`` keys, handled by
:func:`with_offload`.  :func:`insert_communication` turns any per-rank order of
``F``/``B`` actions into a full schedule whose sends and receives cannot
deadlock.  :func:`predicted_peak_inflight` gives the closed-form peak number of
in-flight chunk activations for each generator.

Chunk-level 1F1B: stage ``s`` warms up with ``W_s = min(N-1 + P-1-s, M*N)``
forward chunk-steps, then alternates one forward chunk and one backward chunk,
then drains the remaining backwards.  Forward chunks are taken in order
``(0,0), (0,1), ..., (M-1,N-1)`` and backward chunks in order
``(0,N-1), ..., (0,0), (1,N-1), ...``, so on the last stage the forward of
micro-batch ``m+1`` interleaves with the backward of micro-batch ``m``.  Its
peak in-flight count on stage ``s`` is ``min(N + P-1-s, M*N)`` chunk
activations, versus ``M*N`` for GPipe.
"""
from __future__ import annotations

import bisect
import enum
import json
import numbers
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Union

from sppo_fx.errors import SppoError

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "ScheduleError",
    "ValidationReport",
    "validate",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "gpipe_compute_order",
    "one_f_one_b_compute_order",
    "one_f_one_b_warmup",
    "insert_communication",
    "with_offload",
    "predicted_peak_inflight",
    "build_schedule",
    "SCHEDULE_KINDS",
]


class ScheduleError(ValueError, SppoError):
    """A schedule that is malformed, violates a dependency, or deadlocks.

    Attributes:
        action: the offending action, when there is one.
        stuck: on deadlock, ``{rank: action the rank is blocked on}``.
    """

    def __init__(self, message: str, action: "Optional[Action]" = None,
                 stuck: "Optional[dict[int, Action]]" = None):
        super().__init__(message)
        self.action = action
        self.stuck = dict(stuck or {})


# ---------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------


class ActionKind(enum.Enum):
    """What an action does; the value is the token used in the printed form."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OFFLOAD = "OFF"
    PREFETCH = "PRE"
    WAIT = "WAIT"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B)

    @property
    def is_comm(self) -> bool:
        return self in _COMM_KINDS

    @property
    def is_memory(self) -> bool:
        return self in (ActionKind.OFFLOAD, ActionKind.PREFETCH, ActionKind.WAIT)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @classmethod
    def from_token(cls, token: str) -> "ActionKind":
        """Accept the printed token (``"OFF"``) or the member name (``"OFFLOAD"``)."""
        try:
            return cls(token)
        except ValueError:
            pass
        try:
            return cls[token]
        except KeyError:
            raise ValueError(f"unknown action kind {token!r}; expected one of "
                             f"{[k.value for k in cls]}") from None


_COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})

# Longer tokens first so that the alternation is unambiguous.
_KIND_TOKENS = sorted((k.value for k in ActionKind), key=len, reverse=True)
_ACTION_RE = re.compile(r"(\d+)(" + "|".join(_KIND_TOKENS) + r")(\d+)\.(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on ``(stage, microbatch, chunk)``.

    Prints as ``f"{stage}{kind.value}{microbatch}.{chunk}"``, e.g. ``0F1.2``;
    :meth:`parse` is the inverse.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    chunk: int

    def __post_init__(self):
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind.from_token(str(self.kind)))
        for name in ("stage", "microbatch", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"Action.{name} must be an integer >= 0, got {v!r}")
            object.__setattr__(self, name, int(v))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}.{self.chunk}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse ``"0F1.2"``-style text (surrounding whitespace allowed)."""
        if not isinstance(text, str):
            raise ValueError(f"cannot parse action from {text!r}")
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch>.<chunk> "
                f"with kind in {[k.value for k in ActionKind]}, e.g. '0F1.2'")
        stage, kind, mb, chunk = m.groups()
        return cls(ActionKind(kind), int(stage), int(mb), int(chunk))

    @property
    def key(self) -> tuple[int, int, int]:
        """``(stage, microbatch, chunk)``."""
        return (self.stage, self.microbatch, self.chunk)

    @property
    def rank(self) -> int:
        """The rank that executes this action (stage ``s`` runs on rank ``s``)."""
        return self.stage

    @property
    def peer(self) -> Optional[int]:
        """The other rank of a send/receive; ``None`` for other kinds."""
        k = self.kind
        if k in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.stage + 1
        if k in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.stage - 1
        return None

    def counterpart(self) -> Optional["Action"]:
        """The matching action on the peer rank (``0SEND_F1.2`` <-> ``1RECV_F1.2``)."""
        k, s, m, i = self.kind, self.stage, self.microbatch, self.chunk
        if k is ActionKind.SEND_F:
            return Action(ActionKind.RECV_F, s + 1, m, i)
        if k is ActionKind.RECV_F:
            return Action(ActionKind.SEND_F, s - 1, m, i)
        if k is ActionKind.SEND_B:
            return Action(ActionKind.RECV_B, s - 1, m, i)
        if k is ActionKind.RECV_B:
            return Action(ActionKind.SEND_B, s + 1, m, i)
        return None


def _a(kind: ActionKind, s: int, m: int, i: int) -> Action:
    return Action(kind, s, m, i)


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------

_HEADER_RE = re.compile(r"#\s*stages=(\d+)\s+microbatches=(\d+)\s+chunks=(\d+)\s*")
_RANK_RE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def _check_positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


@dataclass
class Schedule:
    """Per-rank action lists for ``num_stages`` ranks.

    ``actions[r]`` is the ordered list of actions rank ``r`` executes.  Every
    rank in ``range(num_stages)`` has a (possibly empty) list.
    """

    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: dict[int, list[Action]] = field(default_factory=dict)

    def __post_init__(self):
        self.num_stages = _check_positive("num_stages", self.num_stages)
        self.num_microbatches = _check_positive("num_microbatches", self.num_microbatches)
        self.num_chunks = _check_positive("num_chunks", self.num_chunks)
        normalized: dict[int, list[Action]] = {}
        for r, lst in dict(self.actions).items():
            r = int(r)
            if not 0 <= r < self.num_stages:
                raise ValueError(f"rank {r} out of range for num_stages={self.num_stages}")
            normalized[r] = [a if isinstance(a, Action) else Action.parse(a) for a in lst]
        self.actions = {r: normalized.get(r, []) for r in range(self.num_stages)}

    # -- text -------------------------------------------------------------
    def header(self) -> str:
        return (f"# stages={self.num_stages} microbatches={self.num_microbatches} "
                f"chunks={self.num_chunks}")

    def rank_line(self, rank: int) -> str:
        acts = " ".join(str(a) for a in self.actions[rank])
        return f"rank {rank}: {acts}" if acts else f"rank {rank}:"

    def __str__(self) -> str:
        return "\n".join([self.header()] + [self.rank_line(r) for r in range(self.num_stages)])

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """Read the output of ``str(schedule)``.

        The ``# stages=.. microbatches=.. chunks=..`` header is optional; without
        it the sizes are inferred (ranks = highest rank line + 1, micro-batches and
        chunks = highest index seen + 1).  Blank lines and other ``#`` lines are
        ignored.
        """
        sizes = None
        actions: dict[int, list[Action]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                m = _HEADER_RE.fullmatch(line)
                if m:
                    sizes = tuple(int(x) for x in m.groups())
                continue
            m = _RANK_RE.fullmatch(line)
            if m is None:
                raise ValueError(f"line {lineno}: expected 'rank <r>: <actions>', got {raw!r}")
            r = int(m.group(1))
            if r in actions:
                raise ValueError(f"line {lineno}: rank {r} listed twice")
            try:
                actions[r] = [Action.parse(tok) for tok in m.group(2).split()]
            except ValueError as e:
                raise ValueError(f"line {lineno}: {e}") from None
        if sizes is None:
            all_acts = [a for lst in actions.values() for a in lst]
            sizes = (
                max(list(actions) + [a.stage for a in all_acts], default=0) + 1,
                max((a.microbatch for a in all_acts), default=0) + 1,
                max((a.chunk for a in all_acts), default=0) + 1,
            )
        return cls(sizes[0], sizes[1], sizes[2], actions)

    # -- json -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_chunks": self.num_chunks,
            "actions": {str(r): [str(a) for a in lst] for r, lst in self.actions.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Schedule":
        return cls(d["num_stages"], d["num_microbatches"], d["num_chunks"],
                   {int(r): [Action.parse(a) for a in lst] for r, lst in d["actions"].items()})

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        return cls.from_dict(json.loads(text))

    # -- helpers ----------------------------------------------------------
    def copy(self) -> "Schedule":
        return Schedule(self.num_stages, self.num_microbatches, self.num_chunks,
                        {r: list(lst) for r, lst in self.actions.items()})

    def compute_order(self, rank: int) -> list[Action]:
        """Only the F and B actions of ``rank``, in order."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def validate(self, **kwargs) -> "ValidationReport":
        """Shorthand for :func:`validate(self, **kwargs) <validate>`."""
        return validate(self, **kwargs)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

Number = Union[int, float]


@dataclass
class ValidationReport:
    """What :func:`validate` measured.

    Attributes:
        peak_inflight: per rank, the peak device bytes of saved activations
            (with the default ``activation_bytes`` this is a count of chunks).
        peak_offloaded: per rank, the peak bytes held in host memory.
        timeline: per rank, ``(action, device in-flight bytes after it)`` for
            every action, in that rank's order.
        execution_order: one global interleaving in which the simulation ran the
            actions (a matched send/receive appears as two consecutive entries).
        finish_time: per rank, the time the rank finished under the cost model.
        makespan: ``max(finish_time.values())``.
    """

    peak_inflight: dict[int, Number]
    peak_offloaded: dict[int, Number]
    timeline: dict[int, list[tuple[Action, Number]]]
    execution_order: list[Action]
    finish_time: dict[int, float]
    makespan: float

    def summary(self) -> str:
        lines = [f"makespan {self.makespan:g}"]
        for r in sorted(self.peak_inflight):
            lines.append(f"rank {r}: peak in-flight {self.peak_inflight[r]}, "
                         f"peak offloaded {self.peak_offloaded[r]}, "
                         f"finish {self.finish_time[r]:g}")
        return "\n".join(lines)


def _default_cost(a: Action) -> float:
    if a.kind is ActionKind.F:
        return 1.0
    if a.kind is ActionKind.B:
        return 2.0
    return 0.0


def _bytes_fn(activation_bytes) -> Callable[[int, int], Number]:
    if activation_bytes is None:
        return lambda s, i: 1
    if callable(activation_bytes):
        return activation_bytes
    if isinstance(activation_bytes, numbers.Number):
        return lambda s, i: activation_bytes
    raise TypeError("activation_bytes must be None, a number, or a callable (stage, chunk) -> bytes")


def _required_actions(P: int, M: int, N: int) -> Iterable[tuple[Action, Optional[Action]]]:
    """Every action a complete schedule must hold, with the action needing it."""
    K = ActionKind
    for s in range(P):
        for m in range(M):
            for i in range(N):
                f, b = _a(K.F, s, m, i), _a(K.B, s, m, i)
                yield f, None
                yield b, None
                if s < P - 1:
                    yield _a(K.SEND_F, s, m, i), _a(K.F, s + 1, m, i)
                    yield _a(K.RECV_B, s, m, i), b
                if s > 0:
                    yield _a(K.RECV_F, s, m, i), f
                    yield _a(K.SEND_B, s, m, i), _a(K.B, s - 1, m, i)


class _Simulator:
    def __init__(self, sched: Schedule, activation_bytes, comm: str, prefetch_allocates: bool,
                 cost: Optional[Callable[[Action], float]]):
        if comm not in ("rendezvous", "buffered"):
            raise ValueError(f"comm must be 'rendezvous' or 'buffered', got {comm!r}")
        self.s = sched
        self.P, self.M, self.N = sched.num_stages, sched.num_microbatches, sched.num_chunks
        self.nbytes = _bytes_fn(activation_bytes)
        self.comm = comm
        self.prefetch_allocates = prefetch_allocates
        self.cost = cost or _default_cost
        self.lists = [list(sched.actions[r]) for r in range(self.P)]
        self.pc = [0] * self.P
        self.clock = [0.0] * self.P
        self.done: set[Action] = set()
        self.device = [0] * self.P
        self.host = [0] * self.P
        self.peak = [0] * self.P
        self.peak_host = [0] * self.P
        self.state: dict[tuple[int, int, int], str] = {}
        self.timeline: dict[int, list[tuple[Action, Number]]] = {r: [] for r in range(self.P)}
        self.order: list[Action] = []
        self.queues: dict[tuple[int, int], deque] = {}

    # -- static checks ----------------------------------------------------
    def static_checks(self):
        P, M, N = self.P, self.M, self.N
        seen: dict[Action, int] = {}
        for r, lst in enumerate(self.lists):
            for pos, a in enumerate(lst):
                if a.stage != r:
                    raise ScheduleError(
                        f"{a} is in rank {r}'s list, but stage {a.stage} runs on rank {a.stage}", a)
                if a.microbatch >= M or a.chunk >= N:
                    raise ScheduleError(
                        f"{a} is out of range: the schedule has {M} micro-batch(es) and "
                        f"{N} chunk(s)", a)
                if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and a.stage == P - 1:
                    raise ScheduleError(f"{a}: the last stage {P - 1} has no next stage to "
                                        f"exchange with", a)
                if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) and a.stage == 0:
                    raise ScheduleError(f"{a}: stage 0 has no previous stage to exchange with", a)
                if a in seen:
                    raise ScheduleError(
                        f"{a} appears twice on rank {r} (positions {seen[a]} and {pos}); every "
                        f"action must occur exactly once", a)
                seen[a] = pos
        for a, needed_by in _required_actions(P, M, N):
            if a not in seen:
                why = f" (needed by {needed_by})" if needed_by is not None else ""
                raise ScheduleError(f"missing action {a} on rank {a.stage}{why}", a)

    # -- execution --------------------------------------------------------
    def _need(self, a: Action, dep: Action, why: str):
        if dep not in self.done:
            raise ScheduleError(f"rank {a.stage}: {a} runs before its dependency {dep} ({why})", a)

    def _record(self, r: int, a: Action):
        self.done.add(a)
        self.order.append(a)
        self.timeline[r].append((a, self.device[r]))
        self.peak[r] = max(self.peak[r], self.device[r])
        self.peak_host[r] = max(self.peak_host[r], self.host[r])

    def _check_local(self, r: int, a: Action):
        """Checks that only depend on what rank r itself has run; raise if violated."""
        K = ActionKind
        s, m, i = a.key
        if a.kind is K.SEND_F:
            self._need(a, _a(K.F, s, m, i), "a stage sends the output of a forward after computing it")
        elif a.kind is K.SEND_B:
            self._need(a, _a(K.B, s, m, i), "a stage sends an input gradient after computing it")

    def _exec_local(self, r: int, a: Action):
        K = ActionKind
        s, m, i = a.key
        key = a.key
        nb = self.nbytes(s, i)
        st = self.state.get(key)
        if a.kind is K.F:
            if i > 0:
                self._need(a, _a(K.F, s, m, i - 1),
                           "forward chunks of a micro-batch run in order: a chunk attends to the "
                           "K/V of all earlier chunks")
            if s > 0:
                self._need(a, _a(K.RECV_F, s, m, i), "the input activation comes from the previous stage")
                self._need(a, _a(K.F, s - 1, m, i), "the previous stage's forward of this chunk")
            self.device[r] += nb
            self.state[key] = "resident"
        elif a.kind is K.B:
            self._need(a, _a(K.F, s, m, i), "backward needs the saved activations of its forward")
            if i < self.N - 1:
                self._need(a, _a(K.B, s, m, i + 1),
                           "backward runs in reverse chunk order: later chunks contribute to this "
                           "chunk's K/V gradients")
            if s < self.P - 1:
                self._need(a, _a(K.RECV_B, s, m, i), "the output gradient comes from the next stage")
                self._need(a, _a(K.B, s + 1, m, i), "the next stage's backward of this chunk")
            else:
                self._need(a, _a(K.F, s, m, self.N - 1),
                           "the loss is global over the sequence: the last stage's backward starts "
                           "after the whole forward of the micro-batch")
            if st == "offloaded":
                raise ScheduleError(
                    f"rank {r}: {a} runs while its activations are offloaded; "
                    f"{_a(K.PREFETCH, s, m, i)} and {_a(K.WAIT, s, m, i)} must come first", a)
            if st == "prefetching":
                raise ScheduleError(
                    f"rank {r}: {a} runs before {_a(K.WAIT, s, m, i)}: the prefetch of its "
                    f"activations may not have landed", a)
            self.device[r] -= nb
            self.state[key] = "freed"
        elif a.kind is K.OFFLOAD:
            self._need(a, _a(K.F, s, m, i), "only activations that exist can be offloaded")
            if st == "freed":
                raise ScheduleError(f"rank {r}: {a} runs after {_a(K.B, s, m, i)} freed the "
                                    f"activations", a)
            self.device[r] -= nb
            self.host[r] += nb
            self.state[key] = "offloaded"
        elif a.kind is K.PREFETCH:
            if st != "offloaded":
                raise ScheduleError(
                    f"rank {r}: {a} without a preceding {_a(K.OFFLOAD, s, m, i)} "
                    f"(PREFETCH must follow OFFLOAD)", a)
            self.host[r] -= nb
            if self.prefetch_allocates:
                self.device[r] += nb
            self.state[key] = "prefetching"
        elif a.kind is K.WAIT:
            if st != "prefetching":
                missing = (_a(K.PREFETCH, s, m, i) if st == "offloaded"
                           else _a(K.OFFLOAD, s, m, i))
                raise ScheduleError(
                    f"rank {r}: {a} without a preceding {missing} (WAIT must follow PREFETCH, "
                    f"which must follow OFFLOAD)", a)
            if not self.prefetch_allocates:
                self.device[r] += nb
            self.state[key] = "resident"
        else:  # pragma: no cover - comm handled elsewhere
            raise AssertionError(a)
        self.clock[r] += self.cost(a)
        self._record(r, a)

    def _head(self, r: int) -> Optional[Action]:
        return self.lists[r][self.pc[r]] if self.pc[r] < len(self.lists[r]) else None

    def _try_comm(self, r: int, a: Action) -> bool:
        self._check_local(r, a)
        peer = a.peer
        cp = a.counterpart()
        if self.comm == "rendezvous":
            if self._head(peer) != cp:
                return False
            self._check_local(peer, cp)
            send, recv = (a, cp) if a.kind.is_send else (cp, a)
            t = max(self.clock[r], self.clock[peer]) + self.cost(a)
            self.clock[r] = self.clock[peer] = t
            self.pc[peer] += 1
            self._record(send.stage, send)
            self._record(recv.stage, recv)
            return True
        # buffered: sends complete immediately, receives match the channel in FIFO order
        if a.kind.is_send:
            self.clock[r] += self.cost(a)
            self.queues.setdefault((r, peer), deque()).append((a, self.clock[r]))
            self._record(r, a)
            return True
        q = self.queues.get((peer, r))
        if not q:
            return False
        msg, t_sent = q[0]
        if msg != cp:
            raise ScheduleError(
                f"rank {r}: {a} is matched out of order: the next message from rank {peer} is "
                f"{msg}, so {a} would receive the wrong tensor (sends and receives must be posted "
                f"in the same order on both ranks)", a)
        q.popleft()
        self.clock[r] = max(self.clock[r], t_sent) + self.cost(a)
        self._record(r, a)
        return True

    def run(self):
        self.static_checks()
        P = self.P
        while True:
            progress = False
            for r in range(P):
                while (a := self._head(r)) is not None:
                    if a.kind.is_comm:
                        if not self._try_comm(r, a):
                            break
                    else:
                        self._exec_local(r, a)
                    self.pc[r] += 1
                    progress = True
            if all(self._head(r) is None for r in range(P)):
                break
            if not progress:
                self._deadlock()
        for (src, dst), q in self.queues.items():
            if q:  # pragma: no cover - unreachable after static checks
                raise ScheduleError(f"{q[0][0]} was never received by rank {dst}", q[0][0])
        return ValidationReport(
            peak_inflight={r: self.peak[r] for r in range(P)},
            peak_offloaded={r: self.peak_host[r] for r in range(P)},
            timeline=self.timeline,
            execution_order=self.order,
            finish_time={r: self.clock[r] for r in range(P)},
            makespan=max(self.clock, default=0.0),
        )

    def _deadlock(self):
        stuck = {r: self._head(r) for r in range(self.P) if self._head(r) is not None}
        parts = []
        for r, a in stuck.items():
            peer, cp = a.peer, a.counterpart()
            peer_head = self._head(peer)
            if self.comm == "rendezvous":
                where = f"rank {peer} is at {peer_head}" if peer_head is not None else \
                    f"rank {peer} has finished"
                parts.append(f"rank {r} blocked at {a} waiting for {cp} ({where})")
            else:
                where = f"rank {peer} is at {peer_head}" if peer_head is not None else \
                    f"rank {peer} has finished"
                parts.append(f"rank {r} blocked at {a} waiting for {cp} to be sent ({where})")
        raise ScheduleError(
            "deadlock: no rank can make progress; " + "; ".join(parts) +
            ". Sends and receives between two ranks must be posted in the same order.",
            next(iter(stuck.values())), stuck)


def validate(schedule: Schedule, *, activation_bytes=None, comm: str = "rendezvous",
             prefetch_allocates: bool = True,
             cost: Optional[Callable[[Action], float]] = None) -> ValidationReport:
    """Simulate ``schedule`` in one process and check it.

    All ranks run their lists concurrently; a rank runs its next action when it
    can.  Compute and memory actions run immediately if their dependencies (all
    on the same rank, because cross-rank data arrives through explicit
    RECV actions) are already done, otherwise a :class:`ScheduleError` is raised
    since a rank runs its list in order and can never satisfy them later.  A
    send and a receive run together:

    * ``comm="rendezvous"`` (default, blocking p2p): a send and its receive run
      when both ranks have them at the head of their lists.  If no rank can move
      the schedule deadlocks; the error names every stuck action.
    * ``comm="buffered"``: sends never block; a receive takes the oldest
      undelivered message from its peer, which must be the matching send.

    Memory: an ``F`` adds ``activation_bytes(stage, chunk)`` (default 1, or a
    constant) to its rank's device in-flight total, ``OFF`` moves it to host,
    ``PRE`` brings it back to the device (the buffer is allocated when the copy
    starts; pass ``prefetch_allocates=False`` to count it at ``WAIT`` instead),
    and ``B`` frees it.

    ``cost(action)`` gives the duration of each action for the ``finish_time``
    / ``makespan`` estimate (default F=1, B=2, everything else 0).

    Checks: every required action (F and B for each (stage, micro-batch, chunk),
    and the sends/receives between neighbouring stages) occurs exactly once on
    the right rank; the dependencies listed in the module docstring;
    OFF -> PRE -> WAIT -> B ordering for offloaded activations; send/receive
    matching.  Raises :class:`ScheduleError` naming the offending action.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    return _Simulator(schedule, activation_bytes, comm, prefetch_allocates, cost).run()


# ---------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------


def _forward_units(M: int, N: int) -> list[tuple[int, int]]:
    return [(m, i) for m in range(M) for i in range(N)]


def _backward_units(M: int, N: int) -> list[tuple[int, int]]:
    return [(m, i) for m in range(M) for i in reversed(range(N))]


def gpipe_compute_order(num_stages: int, num_microbatches: int,
                        num_chunks: int) -> dict[int, list[Action]]:
    """Per-rank F/B order of GPipe: every forward chunk, then every backward chunk
    (micro-batches in order, chunks of each micro-batch in reverse)."""
    P = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    N = _check_positive("num_chunks", num_chunks)
    return {s: [_a(ActionKind.F, s, m, i) for m, i in _forward_units(M, N)]
            + [_a(ActionKind.B, s, m, i) for m, i in _backward_units(M, N)]
            for s in range(P)}


def one_f_one_b_warmup(num_stages: int, num_microbatches: int, num_chunks: int, stage: int) -> int:
    """Forward chunk-steps stage ``stage`` runs before its first 1F1B pair:
    ``min(N-1 + P-1-stage, M*N)``."""
    P, M, N = num_stages, num_microbatches, num_chunks
    return min(N - 1 + P - 1 - stage, M * N)


def one_f_one_b_compute_order(num_stages: int, num_microbatches: int,
                              num_chunks: int) -> dict[int, list[Action]]:
    """Per-rank F/B order of chunk-level 1F1B.

    Stage ``s`` runs ``W_s = min(N-1 + P-1-s, M*N)`` forward chunks, then pairs
    (next forward chunk, next backward chunk) while forwards remain, then the
    remaining backward chunks.  ``N-1`` is what the last stage needs so that the
    first pair's forward completes micro-batch 0 before its backward; each
    earlier stage needs one more so that its forwards keep the next stage's
    warm-up fed before it blocks on its own first backward.
    """
    P = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    N = _check_positive("num_chunks", num_chunks)
    fw, bw = _forward_units(M, N), _backward_units(M, N)
    total = M * N
    out: dict[int, list[Action]] = {}
    for s in range(P):
        w = one_f_one_b_warmup(P, M, N, s)
        order = [_a(ActionKind.F, s, m, i) for m, i in fw[:w]]
        f = w
        b = 0
        while f < total:
            order.append(_a(ActionKind.F, s, *fw[f]))
            order.append(_a(ActionKind.B, s, *bw[b]))
            f += 1
            b += 1
        order.extend(_a(ActionKind.B, s, m, i) for m, i in bw[b:])
        out[s] = order
    return out


def insert_communication(num_stages: int, num_microbatches: int, num_chunks: int,
                         compute: Mapping[int, Iterable[Action]]) -> Schedule:
    """Add SEND/RECV actions to per-rank F/B orders so that blocking p2p cannot deadlock.

    The F/B orders are simulated in lock-step (every rank runs its next compute
    action in a step if its inputs were produced in an earlier step).  Each
    transfer becomes an event right after the step that produced its tensor;
    events of one step are ordered by the pair of stages (then forward before
    backward).  Every rank's list is its own events in that single global
    order, so sends and receives are posted in the same order on both ends and
    running the events in global order never blocks.  Raises
    :class:`ScheduleError` if the compute orders themselves deadlock.
    """
    K = ActionKind
    P = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    N = _check_positive("num_chunks", num_chunks)
    lists = {r: list(compute.get(r, [])) for r in range(P)}
    for r, lst in lists.items():
        for a in lst:
            if not a.kind.is_compute or a.stage != r:
                raise ScheduleError(f"insert_communication expects only F/B actions of stage {r} "
                                    f"on rank {r}, got {a}", a)
    done: set[Action] = set()
    pcs = [0] * P
    events: list[tuple[tuple, int, Action]] = []

    def ready(a: Action) -> bool:
        s, m, i = a.key
        if a.kind is K.F:
            deps = ([_a(K.F, s, m, i - 1)] if i > 0 else []) + \
                   ([_a(K.F, s - 1, m, i)] if s > 0 else [])
        else:
            deps = [_a(K.F, s, m, i)] + ([_a(K.B, s, m, i + 1)] if i < N - 1 else [])
            deps.append(_a(K.B, s + 1, m, i) if s < P - 1 else _a(K.F, s, m, N - 1))
        return all(d in done for d in deps)

    step = 0
    while any(pcs[r] < len(lists[r]) for r in range(P)):
        ran = [lists[r][pcs[r]] for r in range(P)
               if pcs[r] < len(lists[r]) and ready(lists[r][pcs[r]])]
        if not ran:
            stuck = {r: lists[r][pcs[r]] for r in range(P) if pcs[r] < len(lists[r])}
            heads = ", ".join(f"rank {r} at {a}" for r, a in stuck.items())
            raise ScheduleError(f"the compute orders deadlock: {heads} all wait for inputs "
                                f"that are never produced", next(iter(stuck.values())), stuck)
        for a in ran:
            s, m, i = a.key
            done.add(a)
            pcs[s] += 1
            events.append(((step, 0, s, 0), s, a))
            if a.kind is K.F and s < P - 1:
                events.append(((step, 1, s, 0), s, _a(K.SEND_F, s, m, i)))
                events.append(((step, 1, s, 0), s + 1, _a(K.RECV_F, s + 1, m, i)))
            if a.kind is K.B and s > 0:
                events.append(((step, 1, s - 1, 1), s, _a(K.SEND_B, s, m, i)))
                events.append(((step, 1, s - 1, 1), s - 1, _a(K.RECV_B, s - 1, m, i)))
        step += 1
    events.sort(key=lambda e: e[0])
    out: dict[int, list[Action]] = {r: [] for r in range(P)}
    for _, r, a in events:
        out[r].append(a)
    return Schedule(P, M, N, out)


def with_offload(schedule: Schedule, offload: Iterable[tuple[int, int, int]], *,
                 prefetch_distance: int = 1) -> Schedule:
    """Return a copy of ``schedule`` that offloads the saved activations in ``offload``.

    For each ``(stage, microbatch, chunk)``: ``OFF`` right after its ``F``;
    ``PRE`` right before the ``prefetch_distance``-th backward that precedes its
    ``B`` on that rank (so the copy overlaps that backward; if there are fewer
    earlier backwards, before the earliest one, or before the compute action
    just before its ``B``), never earlier than right after the ``OFF``; ``WAIT``
    right before its ``B``.
    """
    K = ActionKind
    if prefetch_distance < 1:
        raise ValueError(f"prefetch_distance must be >= 1, got {prefetch_distance}")
    P, M, N = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    keys = sorted({tuple(int(x) for x in k) for k in offload})
    by_rank: dict[int, list[tuple[int, int, int]]] = {}
    for k in keys:
        if len(k) != 3 or not (0 <= k[0] < P and 0 <= k[1] < M and 0 <= k[2] < N):
            raise ValueError(f"offload key {k} out of range for stages={P}, "
                             f"microbatches={M}, chunks={N}")
        by_rank.setdefault(k[0], []).append(k)
    out = schedule.copy()
    for r, rkeys in by_rank.items():
        lst = out.actions[r]
        index = {a: j for j, a in enumerate(lst)}
        b_positions = [j for j, a in enumerate(lst) if a.kind is K.B]
        compute_positions = [j for j, a in enumerate(lst) if a.kind.is_compute]
        inserts: list[tuple[int, int, int, Action]] = []
        for s, m, i in rkeys:
            f_act, b_act = _a(K.F, s, m, i), _a(K.B, s, m, i)
            for kind in (K.OFFLOAD, K.PREFETCH, K.WAIT):
                if _a(kind, s, m, i) in index:
                    raise ScheduleError(f"{_a(kind, s, m, i)} is already in the schedule",
                                        _a(kind, s, m, i))
            if f_act not in index or b_act not in index:
                missing = f_act if f_act not in index else b_act
                raise ScheduleError(f"cannot offload {s, m, i}: {missing} is not in the schedule",
                                    missing)
            fj, bj = index[f_act], index[b_act]
            if bj < fj:
                raise ScheduleError(f"cannot offload {s, m, i}: {b_act} comes before {f_act}",
                                    b_act)
            n_prev_b = bisect.bisect_left(b_positions, bj)  # backwards before this one
            if n_prev_b:
                pj = b_positions[max(n_prev_b - prefetch_distance, 0)]
            else:
                n_prev_c = bisect.bisect_left(compute_positions, bj)
                pj = compute_positions[n_prev_c - 1] if n_prev_c else bj
            pj = max(pj, fj + 1)
            inserts.append((fj + 1, 0, bj, _a(K.OFFLOAD, s, m, i)))
            inserts.append((pj, 1, bj, _a(K.PREFETCH, s, m, i)))
            inserts.append((bj, 2, bj, _a(K.WAIT, s, m, i)))
        inserts.sort(key=lambda t: t[:3])
        new: list[Action] = []
        k = 0
        for j in range(len(lst) + 1):
            while k < len(inserts) and inserts[k][0] == j:
                new.append(inserts[k][3])
                k += 1
            if j < len(lst):
                new.append(lst[j])
        out.actions[r] = new
    return out


def gpipe_schedule(num_stages: int, num_microbatches: int, num_chunks: int, *,
                   offload: Optional[Iterable[tuple[int, int, int]]] = None,
                   prefetch_distance: int = 1) -> Schedule:
    """GPipe at chunk granularity: all forward chunks of all micro-batches, then all
    backward chunks (micro-batches in order, chunks in reverse), with SEND/RECV
    actions from :func:`insert_communication` and optional offloading
    (:func:`with_offload`)."""
    sched = insert_communication(num_stages, num_microbatches, num_chunks,
                                 gpipe_compute_order(num_stages, num_microbatches, num_chunks))
    if offload:
        sched = with_offload(sched, offload, prefetch_distance=prefetch_distance)
    return sched


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, num_chunks: int, *,
                         offload: Optional[Iterable[tuple[int, int, int]]] = None,
                         prefetch_distance: int = 1) -> Schedule:
    """Chunk-level 1F1B (see :func:`one_f_one_b_compute_order`), with SEND/RECV
    actions from :func:`insert_communication` and optional offloading
    (:func:`with_offload`)."""
    sched = insert_communication(num_stages, num_microbatches, num_chunks,
                                 one_f_one_b_compute_order(num_stages, num_microbatches, num_chunks))
    if offload:
        sched = with_offload(sched, offload, prefetch_distance=prefetch_distance)
    return sched


SCHEDULE_KINDS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}

_KIND_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "one_f_one_b": "1f1b", "onefoneb": "1f1b"}


def _normalize_kind(kind: str) -> str:
    k = str(kind).lower().replace("-", "_")
    if k not in _KIND_ALIASES:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {sorted(SCHEDULE_KINDS)}")
    return _KIND_ALIASES[k]


def build_schedule(kind: str, num_stages: int, num_microbatches: int, num_chunks: int,
                   **kwargs) -> Schedule:
    """``build_schedule("1f1b", P, M, N)``; ``kind`` is ``"gpipe"`` or ``"1f1b"``."""
    return SCHEDULE_KINDS[_normalize_kind(kind)](num_stages, num_microbatches, num_chunks, **kwargs)


def predicted_peak_inflight(kind: str, num_stages: int, num_microbatches: int,
                            num_chunks: int, stage: int) -> int:
    """Closed-form peak number of in-flight chunk activations on ``stage`` (no offload).

    * GPipe: ``M*N`` on every stage (all forwards run before any backward).
    * chunk-level 1F1B: ``min(N + P-1-stage, M*N)`` -- the warm-up
      ``W = N-1 + P-1-stage`` forwards plus the forward of the first pair; every
      later pair adds one chunk and frees one.
    """
    P = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    N = _check_positive("num_chunks", num_chunks)
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < P:
        raise ValueError(f"stage must be in range({P}), got {stage!r}")
    k = _normalize_kind(kind)
    if k == "gpipe":
        return M * N
    return min(N + P - 1 - stage, M * N)
