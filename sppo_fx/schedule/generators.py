"""Schedule generators: GPipe and chunk-level 1F1B, communication and offload insertion.

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
import numbers
from typing import Iterable, Mapping, Optional

from sppo_fx.schedule.actions import Action, ActionKind, Schedule, ScheduleError, _a, _check_positive

__all__ = ["gpipe_schedule", "one_f_one_b_schedule", "gpipe_compute_order", "one_f_one_b_compute_order",
           "one_f_one_b_warmup", "insert_communication", "with_offload", "predicted_peak_inflight",
           "build_schedule", "SCHEDULE_KINDS"]


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
