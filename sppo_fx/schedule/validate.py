"""The single-process schedule validator: structure and in-flight memory.

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

Time is not the validator's business: the finish times and makespan of its report come from
the one clock, :func:`sppo_fx.schedule.simulator.simulate` (docs/architecture.md, section 3
"Memory model", Time).
"""
from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from sppo_fx.schedule.actions import Action, ActionKind, Schedule, ScheduleError, _a
from sppo_fx.schedule.simulator import ActionCosts, simulate

__all__ = ["ValidationReport", "validate"]


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
        execution_order: one global interleaving in which the check ran the
            actions (a matched send/receive appears as two consecutive entries).
        finish_time: per rank, when its last compute ends (the simulator's clock, with
            F/B durations from the validator's ``cost``, free communication and copies).
        makespan: the simulated step time under the same assumptions.
    """

    peak_inflight: dict[int, Number]
    peak_offloaded: dict[int, Number]
    timeline: dict[int, list[tuple[Action, Number]]]
    execution_order: list[Action]
    schedule: Schedule = field(repr=False, compare=False, default=None)
    cost: Optional[Callable[[Action], float]] = field(repr=False, compare=False, default=None)
    _timing: object = field(init=False, repr=False, compare=False, default=None)

    def _simulated(self):
        if self._timing is None:
            costs = ActionCosts.from_callable(self.cost or _default_cost)
            self._timing = simulate(self.schedule, costs, link_bytes_per_s=None, link_latency_s=0.0,
                                    record_events=False)
        return self._timing

    @property
    def finish_time(self) -> dict[int, float]:
        return dict(self._simulated().finish_seconds)

    @property
    def makespan(self) -> float:
        return self._simulated().step_seconds

    def summary(self) -> str:
        lines = [f"makespan {self.makespan:g}"]
        finish = self.finish_time
        for r in sorted(self.peak_inflight):
            lines.append(f"rank {r}: peak in-flight {self.peak_inflight[r]}, "
                         f"peak offloaded {self.peak_offloaded[r]}, "
                         f"finish {finish[r]:g}")
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


class _Checker:
    def __init__(self, sched: Schedule, activation_bytes, comm: str, prefetch_allocates: bool):
        if comm not in ("rendezvous", "buffered"):
            raise ValueError(f"comm must be 'rendezvous' or 'buffered', got {comm!r}")
        self.s = sched
        self.P, self.M, self.N = sched.num_stages, sched.num_microbatches, sched.num_chunks
        self.nbytes = _bytes_fn(activation_bytes)
        self.comm = comm
        self.prefetch_allocates = prefetch_allocates
        self.lists = [list(sched.actions[r]) for r in range(self.P)]
        self.pc = [0] * self.P
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
            self.pc[peer] += 1
            self._record(send.stage, send)
            self._record(recv.stage, recv)
            return True
        # buffered: sends complete immediately, receives match the channel in FIFO order
        if a.kind.is_send:
            self.queues.setdefault((r, peer), deque()).append(a)
            self._record(r, a)
            return True
        q = self.queues.get((peer, r))
        if not q:
            return False
        msg = q[0]
        if msg != cp:
            raise ScheduleError(
                f"rank {r}: {a} is matched out of order: the next message from rank {peer} is "
                f"{msg}, so {a} would receive the wrong tensor (sends and receives must be posted "
                f"in the same order on both ranks)", a)
        q.popleft()
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
                raise ScheduleError(f"{q[0]} was never received by rank {dst}", q[0])
        return ValidationReport(
            peak_inflight={r: self.peak[r] for r in range(P)},
            peak_offloaded={r: self.peak_host[r] for r in range(P)},
            timeline=self.timeline,
            execution_order=self.order,
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
    """Check ``schedule``'s structure and count its in-flight memory, in one process.

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

    ``cost(action)`` gives the duration of each F/B action for the report's
    ``finish_time`` / ``makespan`` (default F=1, B=2), which the simulator
    (:func:`sppo_fx.schedule.simulator.simulate`) computes on first use with
    communication and copies taking no time.

    Checks: every required action (F and B for each (stage, micro-batch, chunk),
    and the sends/receives between neighbouring stages) occurs exactly once on
    the right rank; the dependencies listed in the module docstring;
    OFF -> PRE -> WAIT -> B ordering for offloaded activations; send/receive
    matching.  Raises :class:`ScheduleError` naming the offending action.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    report = _Checker(schedule, activation_bytes, comm, prefetch_allocates).run()
    report.schedule, report.cost = schedule, cost
    return report
