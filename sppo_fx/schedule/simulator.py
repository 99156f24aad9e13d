"""Event simulator of a pipeline schedule: time, bubbles and memory of every rank.

`simulate(schedule, costs, profile)` plays a :class:`~sppo_fx.schedule.actions.Schedule`
(the same per-rank action lists the runtime executes) on a model of the hardware and
returns a :class:`SimResult`: the step time, the bubble fraction, each rank's busy time,
peak memory and memory timeline, and every event for a Chrome trace
(:mod:`sppo_fx.util.chrome_trace`).

Resources
---------
Every rank ``r`` (= pipeline stage ``r``) has

* ``compute`` — one in-order stream that runs the rank's ``F`` and ``B`` actions in list
  order. The rank's host thread is modelled as driving this stream synchronously: an
  action further down the list is *issued* when the compute before it has finished (this
  is how `sppo_fx.runtime.distributed.PipelineExecutor` behaves).
* ``d2h`` and ``h2d`` — the two copy engines (device -> host, host -> device), each FIFO.
* ``disk`` — one FIFO lane shared by writes and reads of the disk tier.
* ``link->r±1`` — one directed link to each neighbour (full duplex: the forward link
  ``r -> r+1`` carries only ``SEND_F`` of rank ``r``, the backward link ``r+1 -> r`` only
  ``SEND_B`` of rank ``r+1``), with a bandwidth and a latency.

Semantics (what each action costs and when it can start)
---------------------------------------------------------
* ``F`` / ``B``: start at ``max(previous compute end, arrival of the tensor this action
  receives from a neighbour)``; take ``forward_seconds`` / ``backward_seconds`` of
  (stage, chunk).
* ``SEND_F`` / ``SEND_B`` are non-blocking (``isend``): the transfer starts when the
  tensor exists and the link is free, takes ``latency + bytes / bandwidth``; the sender's
  compute does not wait. ``RECV_*`` posts the receive (``irecv``) at the rank's current
  time; the data has arrived at ``max(post time, send start + transfer)``, and only the
  compute that consumes it waits for it.
* ``OFFLOAD`` (after an ``F``): copies ``offload_bytes`` on the D2H engine, concurrent
  with compute; with ``tier="disk"`` the host copy is then written on the disk lane.
* ``PREFETCH``: reads back (disk lane first for the disk tier, then H2D); it cannot start
  before the offload has completed.
* ``WAIT``: the compute stream blocks until that prefetch has landed (the blocked time is
  a ``stall`` event and counts as bubble, not busy time).

Memory per rank (device bytes over time)
----------------------------------------
``static_bytes`` from time 0 (weights, gradients, optimizer states); ``+activation
bytes`` at ``F`` end; ``-offload bytes`` when the D2H copy of an ``OFFLOAD`` completes
(the device copy is freed then); ``+offload bytes`` when a ``PREFETCH`` starts copying
(its device buffer is allocated); ``-activation bytes`` at ``B`` end. K/V ("skeletal",
level-1) bytes of a chunk are held from its ``F`` end to its ``B`` end; with
``kv_grad_accumulators`` the K/V gradient accumulators of a whole micro-batch are
allocated when its first backward starts on the stage (the backward of the last chunk
produces contributions to every earlier chunk's dK/dV) and chunk ``i``'s is freed at
``B(i)`` end. ``workspace_bytes`` is held during each ``F`` and ``B`` (transient buffers:
a layer's recomputed activations, the logits of the loss). At equal times frees are
applied before allocations (the caching allocator reuses the freed block). Host memory is
tracked the same way (``+`` at D2H start, ``-`` when the disk write finishes or the
prefetch finishes).

The simulation is deterministic: every resource is used by one rank only, in that rank's
list order, so the result does not depend on the order in which ranks are stepped.
Nothing here checks the schedule's dependencies beyond what timing needs; run
:func:`~sppo_fx.schedule.validate.validate` for that (its report's times come from here:
this is the one clock, docs/architecture.md, section 3 "Memory model").
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from sppo_fx.schedule.actions import Action, ActionKind, Schedule, ScheduleError
from sppo_fx.schedule.simdata import ActionCosts, SimEvent, SimResult, _table

__all__ = ["ActionCosts", "SimEvent", "SimResult", "simulate", "DEFAULT_LINK_BYTES_PER_S",
           "DEFAULT_LINK_LATENCY_S", "RESOURCE_ORDER"]

#: Default point-to-point link: 200 Gb/s InfiniBand HDR per GPU (25 GB/s), 5 µs latency.
DEFAULT_LINK_BYTES_PER_S = 25e9
DEFAULT_LINK_LATENCY_S = 5e-6

#: Resource names in display order (links are named ``link->r<peer>``, receives ``recv<-r<peer>``).
RESOURCE_ORDER = ("compute", "d2h", "h2d", "disk")

def _peak_and_timeline(deltas: list[tuple[float, float]], base: float, keep: bool):
    """Apply (time, delta) changes in time order (frees first at equal times)."""
    deltas.sort()
    cur = peak = base
    timeline = [(0.0, base)] if keep else []
    for t, d in deltas:
        cur += d
        if cur > peak:
            peak = cur
        if keep:
            if timeline and timeline[-1][0] == t:
                timeline[-1] = (t, cur)
            else:
                timeline.append((t, cur))
    return peak, timeline


def simulate(schedule: Schedule, costs: Union[ActionCosts, Callable[[Action], float]],
             profile=None, *, link_bytes_per_s: Optional[float] = DEFAULT_LINK_BYTES_PER_S,
             link_latency_s: float = DEFAULT_LINK_LATENCY_S, tier: str = "host",
             kv_grad_accumulators: bool = True, record_events: bool = True) -> SimResult:
    """Play ``schedule`` on the resource model described in the module docstring.

    Args:
        schedule: per-rank action lists (F/B, sends/receives, OFF/PRE/WAIT).
        costs: an :class:`ActionCosts`, or a callable ``action -> seconds`` for F/B (then
            every chunk saves 1 "byte", so peaks count chunks).
        profile: a :class:`~sppo_fx.solver.profiles.DeviceProfile` for the copy bandwidths
            (d2h, h2d, disk); ``None`` makes copies instantaneous.
        link_bytes_per_s: bandwidth of each neighbour link; ``None`` or ``inf``: latency only.
        link_latency_s: per-message latency.
        tier: "host" (offload to pinned host memory) or "disk" (then on to the disk).
        kv_grad_accumulators: count the K/V gradient accumulators (see module docstring).
        record_events: keep every event and the memory timelines (off: faster, for search).

    Returns:
        The :class:`SimResult`. Raises ScheduleError if the schedule deadlocks or a compute
        action comes before the receive it needs.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate expects a Schedule, got {type(schedule).__name__}")
    if tier not in ("host", "disk"):
        raise ValueError(f"tier must be 'host' or 'disk', got {tier!r}")
    if not isinstance(costs, ActionCosts):
        if not callable(costs):
            raise TypeError("costs must be an ActionCosts or a callable action -> seconds")
        costs = ActionCosts.from_callable(costs)
    K = ActionKind
    P, N = schedule.num_stages, schedule.num_chunks
    fwd = _table(costs.forward_seconds, P, N, "forward_seconds")
    bwd = _table(costs.backward_seconds, P, N, "backward_seconds")
    act = _table(costs.activation_bytes, P, N, "activation_bytes")
    off = act if costs.offload_bytes is None else _table(costs.offload_bytes, P, N, "offload_bytes")
    kv = _table(costs.kv_bytes, P, N, "kv_bytes")
    snd = _table(costs.send_bytes, P, N, "send_bytes")
    ws = _table(costs.workspace_bytes, P, N, "workspace_bytes")
    static = costs.static_list(P)
    kv_total = [sum(row) for row in kv]
    duration = costs.duration

    inf = float("inf")
    link_bw = inf if link_bytes_per_s is None else float(link_bytes_per_s)
    if profile is None:
        d2h_bw = h2d_bw = dw_bw = dr_bw = inf
    else:
        d2h_bw, h2d_bw = profile.d2h_bytes_per_s, profile.h2d_bytes_per_s
        dw_bw, dr_bw = profile.disk_write_bytes_per_s, profile.disk_read_bytes_per_s
    disk = tier == "disk"
    lat = float(link_latency_s)

    lists = [schedule.actions[r] for r in range(P)]
    pc = [0] * P
    host = [0.0] * P                 # compute stream / host thread clock
    d2h_free = [0.0] * P
    h2d_free = [0.0] * P
    disk_free = [0.0] * P
    link_free: dict[tuple[int, int], float] = {}
    busy = [0.0] * P
    stall = [0.0] * P
    offloaded = [0.0] * P
    f_end: dict[tuple, float] = {}
    b_end: dict[tuple, float] = {}
    sent: dict[tuple, tuple[float, float]] = {}    # recv action key -> (send start, send end)
    posted: dict[tuple, float] = {}                # recv action key -> post time
    off_done: dict[tuple, tuple[float, float]] = {}  # (s, m, i) -> (device freed, data readable)
    pre_done: dict[tuple, float] = {}
    first_b: set[tuple[int, int]] = set()
    mem: list[list[tuple[float, float]]] = [[] for _ in range(P)]
    hmem: list[list[tuple[float, float]]] = [[] for _ in range(P)]
    events: list[SimEvent] = []
    ev = events.append if record_events else None

    def arrival(a: Action, rkey: tuple) -> Optional[float]:
        """Arrival time of the tensor `a` consumes, None if its send is not simulated yet."""
        s_ = sent.get(rkey)
        if s_ is None:
            return None
        p = posted.get(rkey)
        if p is None:
            raise ScheduleError(f"rank {a.stage}: {a} comes before the receive of its input "
                                f"({'RECV_F' if rkey[0] == 0 else 'RECV_B'} must come first)", a)
        return max(p, s_[1])

    remaining = sum(len(lst) for lst in lists)
    while remaining:
        progress = False
        for r in range(P):
            lst = lists[r]
            j = pc[r]
            n = len(lst)
            while j < n:
                a = lst[j]
                kind = a.kind
                s, m, i = a.stage, a.microbatch, a.chunk
                if kind is K.F:
                    t0 = host[r]
                    if s > 0:
                        arr = arrival(a, (0, s, m, i))
                        if arr is None:
                            break
                        t0 = max(t0, arr)
                    d = duration(a) if duration is not None else fwd[s][i]
                    t1 = t0 + d
                    host[r] = t1
                    busy[r] += d
                    f_end[(s, m, i)] = t1
                    w = ws[s][i]
                    if w:
                        mem[r].append((t0, w))
                        mem[r].append((t1, -w))
                    mem[r].append((t1, act[s][i] + kv[s][i]))
                    if ev:
                        ev(SimEvent(r, "compute", str(a), t0, t1, "forward"))
                elif kind is K.B:
                    t0 = host[r]
                    if s < P - 1:
                        arr = arrival(a, (1, s, m, i))
                        if arr is None:
                            break
                        t0 = max(t0, arr)
                    d = duration(a) if duration is not None else bwd[s][i]
                    t1 = t0 + d
                    host[r] = t1
                    busy[r] += d
                    b_end[(s, m, i)] = t1
                    if kv_grad_accumulators and (s, m) not in first_b:
                        first_b.add((s, m))
                        if kv_total[s]:
                            mem[r].append((t0, kv_total[s]))
                    w = ws[s][i]
                    if w:
                        mem[r].append((t0, w))
                        mem[r].append((t1, -w))
                    free = act[s][i] + kv[s][i] * (2 if kv_grad_accumulators else 1)
                    mem[r].append((t1, -free))
                    if ev:
                        ev(SimEvent(r, "compute", str(a), t0, t1, "backward"))
                elif kind is K.SEND_F or kind is K.SEND_B:
                    fwd_dir = kind is K.SEND_F
                    peer = s + 1 if fwd_dir else s - 1
                    ready = (f_end if fwd_dir else b_end).get((s, m, i))
                    if ready is None:
                        raise ScheduleError(f"rank {r}: {a} comes before the compute that "
                                            f"produces its tensor", a)
                    nb = snd[s][i] if fwd_dir else snd[peer][i]
                    lk = (s, peer)
                    t0 = max(host[r], ready, link_free.get(lk, 0.0))
                    t1 = t0 + lat + (nb / link_bw if nb else 0.0)
                    link_free[lk] = t1
                    sent[(0, peer, m, i) if fwd_dir else (1, peer, m, i)] = (t0, t1)
                    if ev:
                        ev(SimEvent(r, f"link->r{peer}", str(a), t0, t1, "send", nb))
                elif kind is K.RECV_F or kind is K.RECV_B:
                    posted[(0 if kind is K.RECV_F else 1, s, m, i)] = host[r]
                elif kind is K.OFFLOAD:
                    key = (s, m, i)
                    ready = f_end.get(key)
                    if ready is None:
                        raise ScheduleError(f"rank {r}: {a} comes before {Action(K.F, s, m, i)}", a)
                    nb = off[s][i]
                    t0 = max(host[r], ready, d2h_free[r])
                    t1 = t0 + (nb / d2h_bw if nb else 0.0)
                    d2h_free[r] = t1
                    offloaded[r] += nb
                    mem[r].append((t1, -nb))
                    hmem[r].append((t0, nb))
                    readable = t1
                    if ev:
                        ev(SimEvent(r, "d2h", str(a), t0, t1, "offload", nb))
                    if disk:
                        t2 = max(t1, disk_free[r])
                        t3 = t2 + (nb / dw_bw if nb else 0.0)
                        disk_free[r] = t3
                        hmem[r].append((t3, -nb))
                        readable = t3
                        if ev:
                            ev(SimEvent(r, "disk", f"{a}:write", t2, t3, "disk_write", nb))
                    off_done[key] = (t1, readable)
                elif kind is K.PREFETCH:
                    key = (s, m, i)
                    od = off_done.get(key)
                    if od is None:
                        raise ScheduleError(f"rank {r}: {a} without a preceding "
                                            f"{Action(K.OFFLOAD, s, m, i)}", a)
                    nb = off[s][i]
                    t0 = max(host[r], od[1])
                    if disk:
                        t0 = max(t0, disk_free[r])
                        tr = t0 + (nb / dr_bw if nb else 0.0)
                        disk_free[r] = tr
                        hmem[r].append((t0, nb))
                        if ev:
                            ev(SimEvent(r, "disk", f"{a}:read", t0, tr, "disk_read", nb))
                        t2 = max(tr, h2d_free[r])
                    else:
                        t2 = max(t0, h2d_free[r])
                    t3 = t2 + (nb / h2d_bw if nb else 0.0)
                    h2d_free[r] = t3
                    pre_done[key] = t3
                    mem[r].append((t0, nb))
                    hmem[r].append((t3, -nb))
                    if ev:
                        ev(SimEvent(r, "h2d", str(a), t2, t3, "prefetch", nb))
                elif kind is K.WAIT:
                    t = pre_done.get((s, m, i))
                    if t is None:
                        raise ScheduleError(f"rank {r}: {a} without a preceding "
                                            f"{Action(K.PREFETCH, s, m, i)}", a)
                    if t > host[r]:
                        stall[r] += t - host[r]
                        if ev:
                            ev(SimEvent(r, "compute", str(a), host[r], t, "stall"))
                        host[r] = t
                else:  # pragma: no cover
                    raise AssertionError(a)
                j += 1
                remaining -= 1
                progress = True
            pc[r] = j
        if remaining and not progress:
            stuck = {r: lists[r][pc[r]] for r in range(P) if pc[r] < len(lists[r])}
            heads = ", ".join(f"rank {r} at {a}" for r, a in stuck.items())
            raise ScheduleError(f"the schedule deadlocks in simulation: {heads} wait for tensors "
                                f"that are never sent", next(iter(stuck.values())), stuck)

    if record_events:
        for (dirn, s, m, i), p in posted.items():
            arr = max(p, sent[(dirn, s, m, i)][1]) if (dirn, s, m, i) in sent else p
            peer = s - 1 if dirn == 0 else s + 1
            name = str(Action(K.RECV_F if dirn == 0 else K.RECV_B, s, m, i))
            nb = snd[peer][i] if dirn == 0 else snd[s][i]
            events.append(SimEvent(s, f"recv<-r{peer}", name, p, arr, "recv", nb))

    peak, peak_host, timelines = {}, {}, {}
    for r in range(P):
        peak[r], timelines[r] = _peak_and_timeline(mem[r], static[r], record_events)
        peak_host[r], _ = _peak_and_timeline(hmem[r], 0.0, False)
    ends = [x for x in (*host, *d2h_free, *h2d_free, *disk_free, *link_free.values())]
    return SimResult(
        num_stages=P, step_seconds=max(ends, default=0.0),
        busy_seconds=dict(enumerate(busy)), stall_seconds=dict(enumerate(stall)),
        finish_seconds=dict(enumerate(host)), peak_bytes=peak, peak_host_bytes=peak_host,
        memory_timeline=timelines, events=events, offloaded_bytes=dict(enumerate(offloaded)))
