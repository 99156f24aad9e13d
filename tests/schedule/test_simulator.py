"""The event simulator: paper formula, offload overlap and stalls, memory, p2p semantics, speed."""
from __future__ import annotations

import time

import pytest

from sppo_fx.schedule import ActionKind, Schedule, ScheduleError, build_schedule, validate
from sppo_fx.solver.profiles import DeviceProfile
from sppo_fx.schedule.simulator import ActionCosts, SimResult, simulate

K = ActionKind
GB = 1e9


def _profile(d2h=10 * GB, h2d=None, disk=1 * GB) -> DeviceProfile:
    return DeviceProfile(name="test", flops_per_s=1e12, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d or d2h,
                         disk_write_bytes_per_s=disk, disk_read_bytes_per_s=disk, memory_bytes=80 << 30)


def _offload_all_but_last(P, N, M=1):
    return [(s, m, i) for s in range(P) for m in range(M) for i in range(N - 1)]


def _events(res: SimResult, rank=None, category=None, name=None):
    return [e for e in res.events if (rank is None or e.rank == rank)
            and (category is None or e.category == category) and (name is None or e.name == name)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,N", [(2, 4), (4, 8), (3, 3), (8, 16), (1, 5)])
def test_equal_chunks_reproduce_the_paper_formula(kind, P, N):
    # T = (P - 1 + N) / N * F(N): F(N) is the compute of all N chunks on one stage.
    f, b = 0.5, 1.0
    costs = ActionCosts(forward_seconds=f, backward_seconds=b, activation_bytes=1)
    res = simulate(build_schedule(kind, P, 1, N), costs, link_latency_s=0.0)
    F_N = N * (f + b)
    assert res.step_seconds == pytest.approx((P - 1 + N) / N * F_N)
    assert res.bubble_fraction == pytest.approx((P - 1) / (P - 1 + N))
    assert all(v == pytest.approx(F_N) for v in res.busy_seconds.values())


def test_callable_costs_and_the_validator_clock_agree_without_communication_time():
    sched = build_schedule("1f1b", 4, 3, 4)
    dur = {K.F: 1.0, K.B: 2.0}
    res = simulate(sched, lambda a: dur.get(a.kind, 0.0), link_latency_s=0.0)
    rep = validate(sched, comm="buffered")  # default cost F=1, B=2
    assert res.step_seconds == pytest.approx(rep.makespan)


def test_offload_hidden_behind_compute_adds_no_time_and_lowers_the_peak():
    P, N = 3, 6
    costs = ActionCosts(forward_seconds=1.0, backward_seconds=2.0, activation_bytes=2 * GB)
    base = simulate(build_schedule("1f1b", P, 1, N), costs, _profile(), link_latency_s=0.0)
    sched = build_schedule("1f1b", P, 1, N, offload=_offload_all_but_last(P, N))
    # 2 GB at 10 GB/s = 0.2 s per copy, well inside a 1 s forward / 2 s backward
    off = simulate(sched, costs, _profile(d2h=10 * GB), link_latency_s=0.0)
    assert off.step_seconds == pytest.approx(base.step_seconds)
    assert all(s == 0.0 for s in off.stall_seconds.values())
    assert not _events(off, category="stall")
    assert off.max_peak_bytes < base.max_peak_bytes
    assert len(_events(off, category="offload")) == P * (N - 1)
    assert max(off.peak_host_bytes.values()) > 0


def test_offload_over_a_slow_link_stalls_at_wait_and_adds_time():
    P, N = 3, 6
    costs = ActionCosts(forward_seconds=1.0, backward_seconds=2.0, activation_bytes=2 * GB)
    sched = build_schedule("1f1b", P, 1, N, offload=_offload_all_but_last(P, N))
    base = simulate(build_schedule("1f1b", P, 1, N), costs, _profile(), link_latency_s=0.0)
    slow = simulate(sched, costs, _profile(d2h=0.5 * GB), link_latency_s=0.0)  # 4 s per copy
    assert slow.step_seconds > base.step_seconds + 1.0
    stalls = _events(slow, category="stall")
    assert stalls and all(e.resource == "compute" and e.name.split("WAIT")[0].isdigit() for e in stalls)
    assert sum(slow.stall_seconds.values()) == pytest.approx(sum(e.end - e.start for e in stalls))
    # stall time is bubble: busy time is unchanged
    assert slow.busy_seconds == pytest.approx(base.busy_seconds)
    assert slow.bubble_fraction > base.bubble_fraction


def test_disk_tier_goes_through_the_disk_lane_and_is_slower_than_host():
    P, N = 2, 4
    costs = ActionCosts(forward_seconds=1.0, backward_seconds=2.0, activation_bytes=2 * GB)
    sched = build_schedule("1f1b", P, 1, N, offload=_offload_all_but_last(P, N))
    host = simulate(sched, costs, _profile(disk=0.5 * GB), tier="host")
    disk = simulate(sched, costs, _profile(disk=0.5 * GB), tier="disk")
    assert _events(disk, category="disk_write") and _events(disk, category="disk_read")
    assert not _events(host, category="disk_write")
    assert disk.step_seconds > host.step_seconds
    # host memory is released once the data is on disk
    assert max(disk.peak_host_bytes.values()) <= max(host.peak_host_bytes.values())


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M,N", [(2, 1, 4), (4, 2, 3), (3, 3, 5), (1, 2, 4)])
def test_peak_equals_the_validators_inflight_count_times_bytes(kind, P, M, N):
    nbytes = 3 * GB
    sched = build_schedule(kind, P, M, N)
    rep = validate(sched)
    res = simulate(sched, ActionCosts(forward_seconds=1.0, backward_seconds=2.0, activation_bytes=nbytes))
    for r in range(P):
        assert res.peak_bytes[r] == pytest.approx(rep.peak_inflight[r] * nbytes)
    # ... and offloading (hidden behind compute) lowers it
    keys = [(s, m, i) for s in range(P) for m in range(M) for i in range(N - 1)]
    if N > 2:
        off = simulate(build_schedule(kind, P, M, N, offload=keys),
                       ActionCosts(forward_seconds=1.0, backward_seconds=2.0, activation_bytes=nbytes),
                       _profile(d2h=100 * GB))
        assert all(off.peak_bytes[r] <= res.peak_bytes[r] for r in range(P))
        assert off.max_peak_bytes < res.max_peak_bytes


def test_memory_counts_kv_gradients_workspace_and_static_bytes():
    N = 4
    sched = build_schedule("gpipe", 1, 1, N)
    base = dict(forward_seconds=1.0, backward_seconds=2.0)
    kv = simulate(sched, ActionCosts(**base, kv_bytes=10.0), kv_grad_accumulators=False)
    assert kv.max_peak_bytes == pytest.approx(N * 10.0)
    kvg = simulate(sched, ActionCosts(**base, kv_bytes=10.0))
    assert kvg.max_peak_bytes == pytest.approx(2 * N * 10.0)  # K/V + dK/dV accumulators at the first backward
    ws = simulate(sched, ActionCosts(**base, activation_bytes=1.0, workspace_bytes=100.0, static_bytes=1000.0))
    assert ws.max_peak_bytes == pytest.approx(1000.0 + N * 1.0 + 100.0)  # first backward: all chunks + workspace
    tl = ws.memory_timeline[0]
    assert tl[0] == (0.0, 1100.0) and tl[-1][1] == pytest.approx(1000.0)  # F0 workspace from t=0
    assert [t for t, _ in tl] == sorted(t for t, _ in tl)


def test_sends_do_not_block_and_receives_complete_at_max_of_post_and_arrival():
    P, N = 2, 3
    # 1 GB per send over a 0.25 GB/s link: 4 s per transfer, 1 s forwards
    costs = ActionCosts(forward_seconds=1.0, backward_seconds=1.0, send_bytes=1 * GB)
    res = simulate(build_schedule("gpipe", P, 1, N), costs, link_bytes_per_s=0.25 * GB, link_latency_s=0.0)
    f = {e.name: e for e in _events(res, category="forward")}
    # rank 0 keeps computing while its sends are in flight
    assert f["0F0.1"].start == pytest.approx(1.0) and f["0F0.2"].start == pytest.approx(2.0)
    sends = {e.name: e for e in _events(res, category="send")}
    assert sends["0SEND_F0.0"].start == pytest.approx(1.0) and sends["0SEND_F0.0"].end == pytest.approx(5.0)
    assert sends["0SEND_F0.1"].start == pytest.approx(5.0)  # the link is busy until then
    assert f["1F0.0"].start == pytest.approx(5.0)  # the consumer waits for the data

    # a receive posted after the data arrived completes when it is posted
    sched = Schedule.parse("""
        # stages=2 microbatches=2 chunks=1
        rank 0: 0F0.0 0SEND_F0.0 0F1.0 0SEND_F1.0 0RECV_B0.0 0B0.0 0RECV_B1.0 0B1.0
        rank 1: 1RECV_F0.0 1F0.0 1RECV_F1.0 1F1.0 1B0.0 1SEND_B0.0 1B1.0 1SEND_B1.0
    """)
    validate(sched, comm="buffered")
    costs = ActionCosts(forward_seconds=[[1.0], [5.0]], backward_seconds=1.0)
    res = simulate(sched, costs, link_bytes_per_s=None, link_latency_s=0.5)
    recv = {e.name: e for e in _events(res, category="recv")}
    sends = {e.name: e for e in _events(res, category="send")}
    assert sends["0SEND_F1.0"].end == pytest.approx(2.5)
    assert recv["1RECV_F1.0"].start == pytest.approx(6.5)  # posted after 1F0.0 (1.5 + 5)
    assert recv["1RECV_F1.0"].end == pytest.approx(6.5)  # = max(post, send end)
    assert recv["1RECV_F0.0"].end == pytest.approx(1.5)


def test_deterministic():
    P, N = 4, 12
    sched = build_schedule("1f1b", P, 2, N, offload=[(s, m, i) for s in range(P) for m in range(2) for i in range(0, N - 1, 2)])
    costs = ActionCosts(forward_seconds=lambda s, i: 1.0 + 0.1 * i, backward_seconds=lambda s, i: 2.0 + 0.2 * i,
                        activation_bytes=GB, kv_bytes=0.1 * GB, send_bytes=0.5 * GB)
    a = simulate(sched, costs, _profile(d2h=1 * GB))
    b = simulate(sched.copy(), costs, _profile(d2h=1 * GB))
    assert a.events == b.events and a.step_seconds == b.step_seconds and a.peak_bytes == b.peak_bytes
    assert a.memory_timeline == b.memory_timeline
    fast = simulate(sched, costs, _profile(d2h=1 * GB), record_events=False)
    assert fast.events == [] and fast.step_seconds == a.step_seconds and fast.peak_bytes == a.peak_bytes
    assert "bubble" in a.summary()


def test_cost_tables_accept_constants_lists_nested_lists_and_callables():
    P, N = 2, 3
    sched = build_schedule("gpipe", P, 1, N)
    ref = simulate(sched, ActionCosts(forward_seconds=lambda s, i: i + 1.0, backward_seconds=2.0))
    flat = simulate(sched, ActionCosts(forward_seconds=[1.0, 2.0, 3.0], backward_seconds=2.0))
    nested = simulate(sched, ActionCosts(forward_seconds=[[1.0, 2.0, 3.0]] * P, backward_seconds=[2.0] * N))
    assert ref.step_seconds == flat.step_seconds == nested.step_seconds
    with pytest.raises(ValueError, match="one entry per chunk"):
        simulate(sched, ActionCosts(forward_seconds=[1.0, 2.0]))


def test_a_compute_before_its_receive_is_an_error_and_a_missing_send_deadlocks():
    bad = Schedule.parse("""
        # stages=2 microbatches=1 chunks=1
        rank 0: 0F0.0 0SEND_F0.0 0RECV_B0.0 0B0.0
        rank 1: 1F0.0 1RECV_F0.0 1B0.0 1SEND_B0.0
    """)
    with pytest.raises(ScheduleError, match="before the receive"):
        simulate(bad, ActionCosts(1.0, 2.0))
    stuck = Schedule.parse("""
        # stages=2 microbatches=1 chunks=1
        rank 0: 0F0.0 0RECV_B0.0 0B0.0
        rank 1: 1RECV_F0.0 1F0.0 1B0.0 1SEND_B0.0
    """)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(stuck, ActionCosts(1.0, 2.0))


def test_simulating_65b_scale_schedules_is_fast():
    # GPT-65B x 128 chunks x 8 stages: the raw simulation (the planner adds cost tables).
    P, N = 8, 128
    sched = build_schedule("1f1b", P, 1, N, offload=_offload_all_but_last(P, N))
    costs = ActionCosts(forward_seconds=lambda s, i: 0.5, backward_seconds=lambda s, i: 1.1,
                        activation_bytes=3 * GB, kv_bytes=0.4 * GB, send_bytes=0.1 * GB, workspace_bytes=GB)
    t0 = time.perf_counter()
    res = simulate(sched, costs, _profile())
    dt = time.perf_counter() - t0
    print(f"\nsimulate(8 stages x 128 chunks, offload, events recorded): {dt * 1e3:.0f} ms, "
          f"{len(res.events)} events")
    assert dt < 10.0
    assert res.step_seconds > 0 and len(res.events) > P * N * 2
