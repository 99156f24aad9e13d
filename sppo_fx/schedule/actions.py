"""Schedules as plain data: actions, their grammar, and per-rank action lists.

docs/architecture.md, section 4 "Schedule grammar".

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

The checks a schedule must pass are in :mod:`sppo_fx.schedule.validate`, the generators in
:mod:`sppo_fx.schedule.generators`, and its timing in :mod:`sppo_fx.schedule.simulator`.
"""
from __future__ import annotations

import enum
import json
import numbers
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from sppo_fx.errors import SppoError

__all__ = ["ActionKind", "Action", "Schedule", "ScheduleError"]


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
