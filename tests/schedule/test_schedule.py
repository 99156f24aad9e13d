"""Tests for sppo_fx.schedule: action grammar, generators, validator."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sppo_fx.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    gpipe_compute_order,
    gpipe_schedule,
    insert_communication,
    one_f_one_b_compute_order,
    one_f_one_b_schedule,
    one_f_one_b_warmup,
    predicted_peak_inflight,
    validate,
    with_offload,
)

K = ActionKind
GENERATORS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 5]))


def A(text: str) -> Action:
    return Action.parse(text)


def sched_from_lines(P: int, M: int, N: int, *lines: str) -> Schedule:
    return Schedule(P, M, N, {r: [A(t) for t in line.split()] for r, line in enumerate(lines)})


def remove(s: Schedule, text: str) -> Schedule:
    a = A(text)
    out = s.copy()
    out.actions[a.stage].remove(a)
    return out


def swap(s: Schedule, t1: str, t2: str) -> Schedule:
    a, b = A(t1), A(t2)
    assert a.stage == b.stage
    out = s.copy()
    lst = out.actions[a.stage]
    i, j = lst.index(a), lst.index(b)
    lst[i], lst[j] = lst[j], lst[i]
    return out


def all_keys(P, M, N, stages=None):
    return {(s, m, i) for s in (range(P) if stages is None else stages)
            for m in range(M) for i in range(N)}


# ---------------------------------------------------------------------------
# Grammar, printing, parsing
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,kind,stage,mb,chunk", [
    ("0F1.2", K.F, 0, 1, 2),
    ("0B1.2", K.B, 0, 1, 2),
    ("0SEND_F1.2", K.SEND_F, 0, 1, 2),
    ("1RECV_F1.2", K.RECV_F, 1, 1, 2),
    ("1SEND_B1.2", K.SEND_B, 1, 1, 2),
    ("0RECV_B1.2", K.RECV_B, 0, 1, 2),
    ("0OFF1.2", K.OFFLOAD, 0, 1, 2),
    ("0PRE1.2", K.PREFETCH, 0, 1, 2),
    ("0WAIT1.2", K.WAIT, 0, 1, 2),
    ("12F34.567", K.F, 12, 34, 567),
])
def test_action_print_parse(text, kind, stage, mb, chunk):
    a = Action(kind, stage, mb, chunk)
    assert str(a) == text
    assert repr(a) == text
    assert Action.parse(text) == a
    assert Action.parse(f"  {text}\n") == a
    assert a.key == (stage, mb, chunk)


def test_action_kind_from_token_or_name():
    assert Action("F", 0, 1, 2) == A("0F1.2")
    assert Action("OFF", 0, 1, 2) == Action("OFFLOAD", 0, 1, 2) == A("0OFF1.2")
    with pytest.raises(ValueError):
        Action("X", 0, 0, 0)


@pytest.mark.parametrize("bad", ["F1.2", "0X1.2", "0F1", "-1F0.0", "0F1.2.3", "0f1.2",
                                 "0F 1.2", "", "0SEND1.2", "0RECV_F1.", "0OFFLOAD1.2"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError):
        Action.parse(bad)


@pytest.mark.parametrize("field", ["stage", "microbatch", "chunk"])
def test_action_rejects_negative_or_non_int(field):
    kw = dict(kind=K.F, stage=0, microbatch=0, chunk=0)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            Action(**{**kw, field: bad})


def test_counterparts():
    assert A("0SEND_F1.2").counterpart() == A("1RECV_F1.2")
    assert A("1RECV_F1.2").counterpart() == A("0SEND_F1.2")
    assert A("2SEND_B0.1").counterpart() == A("1RECV_B0.1")
    assert A("1RECV_B0.1").counterpart() == A("2SEND_B0.1")
    assert A("0SEND_F1.2").peer == 1 and A("2SEND_B0.1").peer == 1
    assert A("0F1.2").counterpart() is None and A("0F1.2").peer is None


action_st = st.builds(Action, st.sampled_from(list(ActionKind)), st.integers(0, 10_000),
                      st.integers(0, 10_000), st.integers(0, 10_000))


@given(action_st)
@settings(max_examples=200, deadline=None)
def test_action_roundtrip_hypothesis(a):
    assert Action.parse(str(a)) == a


@st.composite
def schedule_st(draw):
    P = draw(st.integers(1, 4))
    M = draw(st.integers(1, 5))
    N = draw(st.integers(1, 6))
    actions = {}
    for r in range(P):
        actions[r] = draw(st.lists(st.builds(Action, st.sampled_from(list(ActionKind)), st.just(r),
                                             st.integers(0, M - 1), st.integers(0, N - 1)),
                                   max_size=12))
    return Schedule(P, M, N, actions)


@given(schedule_st())
@settings(max_examples=100, deadline=None)
def test_schedule_roundtrip_hypothesis(s):
    assert Schedule.parse(str(s)) == s
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_schedule_str_format():
    s = gpipe_schedule(2, 1, 2)
    lines = str(s).splitlines()
    assert lines[0] == "# stages=2 microbatches=1 chunks=2"
    assert lines[1] == "rank 0: 0F0.0 0SEND_F0.0 0F0.1 0SEND_F0.1 0RECV_B0.1 0B0.1 0RECV_B0.0 0B0.0"
    assert lines[2] == "rank 1: 1RECV_F0.0 1F0.0 1RECV_F0.1 1F0.1 1B0.1 1SEND_B0.1 1B0.0 1SEND_B0.0"


def test_module_docstring_example_is_current():
    import sppo_fx.schedule.actions as mod
    for line in str(gpipe_schedule(2, 1, 2)).splitlines():
        assert "    " + line + "\n" in mod.__doc__


def test_schedule_parse_without_header_infers_sizes():
    s = one_f_one_b_schedule(3, 2, 4)
    text = "\n".join(s.rank_line(r) for r in range(3))
    assert Schedule.parse(text) == s


def test_schedule_parse_empty_rank_and_errors():
    s = Schedule(3, 1, 1, {0: [A("0F0.0")]})
    assert s.actions == {0: [A("0F0.0")], 1: [], 2: []}
    assert Schedule.parse(str(s)) == s
    with pytest.raises(ValueError, match="line 2"):
        Schedule.parse("rank 0: 0F0.0\nnot a rank line")
    with pytest.raises(ValueError, match="twice"):
        Schedule.parse("rank 0: 0F0.0\nrank 0: 0B0.0")
    with pytest.raises(ValueError, match="line 1"):
        Schedule.parse("rank 0: 0F0.0 0Q0.0")
    with pytest.raises(ValueError):
        Schedule(2, 1, 1, {5: []})
    with pytest.raises(ValueError):
        Schedule(0, 1, 1)


# ---------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------

def channel_ops(s: Schedule, src: int, dst: int):
    """(sends from src to dst as seen by src, receives of them as seen by dst)."""
    sends = [a.counterpart() for a in s.actions[src] if a.kind.is_send and a.peer == dst]
    recvs = [a for a in s.actions[dst]
             if a.kind in (K.RECV_F, K.RECV_B) and a.peer == src]
    return sends, recvs


@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("P,M,N", GRID)
def test_generators_valid(kind, P, M, N):
    s = GENERATORS[kind](P, M, N)
    assert (s.num_stages, s.num_microbatches, s.num_chunks) == (P, M, N)
    rep = validate(s)
    rep_buf = validate(s, comm="buffered")
    assert rep.peak_inflight == rep_buf.peak_inflight
    for r in range(P):
        comp = s.compute_order(r)
        # each F and B exactly once per (stage, mb, chunk)
        assert sorted(str(a) for a in comp) == sorted(
            str(Action(k, r, m, i)) for k in (K.F, K.B) for m in range(M) for i in range(N))
        # forward in chunk order, backward in reverse chunk order, per micro-batch
        for m in range(M):
            fs = [a.chunk for a in comp if a.kind is K.F and a.microbatch == m]
            bs = [a.chunk for a in comp if a.kind is K.B and a.microbatch == m]
            assert fs == list(range(N))
            assert bs == list(reversed(range(N)))
        # every rank ends with nothing in flight
        assert rep.timeline[r][-1][1] == 0
        assert len(rep.timeline[r]) == len(s.actions[r])
        # in-flight peak matches the closed form
        assert rep.peak_inflight[r] == predicted_peak_inflight(kind, P, M, N, r)
        assert rep.peak_offloaded[r] == 0
    # sends to a peer appear in the same order as the peer's receives
    for r in range(P - 1):
        for src, dst in ((r, r + 1), (r + 1, r)):
            sends, recvs = channel_ops(s, src, dst)
            assert sends == recvs
    # no bubbles beyond the pipeline fill/drain: (M*N + P - 1) * (F + B)
    assert rep.makespan == (M * N + P - 1) * 3
    assert len(rep.execution_order) == sum(len(v) for v in s.actions.values())


@pytest.mark.parametrize("P,M,N", GRID)
def test_1f1b_peak_not_above_gpipe(P, M, N):
    g = validate(gpipe_schedule(P, M, N)).peak_inflight
    o = validate(one_f_one_b_schedule(P, M, N)).peak_inflight
    for r in range(P):
        assert o[r] <= g[r] == M * N
    if M >= 2:  # with more than one micro-batch 1F1B strictly saves on the last stage
        assert o[P - 1] == N < g[P - 1]


def test_predicted_peak_formula_examples():
    assert [predicted_peak_inflight("1f1b", 4, 3, 4, s) for s in range(4)] == [7, 6, 5, 4]
    assert [predicted_peak_inflight("gpipe", 4, 3, 4, s) for s in range(4)] == [12] * 4
    assert predicted_peak_inflight("1f1b", 4, 1, 4, 0) == 4  # capped at M*N
    assert predicted_peak_inflight("one_f_one_b", 2, 2, 2, 0) == 3
    assert predicted_peak_inflight("1F1B", 2, 2, 2, 1) == 2
    with pytest.raises(ValueError):
        predicted_peak_inflight("zero_bubble", 2, 2, 2, 0)
    with pytest.raises(ValueError):
        predicted_peak_inflight("gpipe", 2, 2, 2, 2)


@pytest.mark.parametrize("P,M,N", [(4, 3, 5), (3, 2, 2), (2, 3, 1), (4, 1, 3)])
def test_1f1b_warmup_more_for_earlier_stages(P, M, N):
    s = one_f_one_b_schedule(P, M, N)
    warm = []
    for r in range(P):
        comp = s.compute_order(r)
        first_b = next(j for j, a in enumerate(comp) if a.kind is K.B)
        warm.append(first_b)
        assert all(a.kind is K.F for a in comp[:first_b])
        assert first_b == min(one_f_one_b_warmup(P, M, N, r) + 1, M * N)
    assert warm == sorted(warm, reverse=True)
    if M * N > N + P - 1:
        assert len(set(warm)) == P  # strictly more for each earlier stage


@pytest.mark.parametrize("P,N", [(1, 3), (2, 2), (4, 3)])
def test_1f1b_interleaves_next_microbatch_forward_with_backward(P, N):
    s = one_f_one_b_schedule(P, 3, N)
    comp = s.compute_order(P - 1)
    pos = {a: j for j, a in enumerate(comp)}
    for m in range(2):
        # last stage: forward chunks of m+1 alternate with backward chunks of m
        fwd_next = [pos[Action(K.F, P - 1, m + 1, i)] for i in range(N)]
        bwd = [pos[Action(K.B, P - 1, m, i)] for i in reversed(range(N))]
        assert fwd_next[0] < bwd[-1] and bwd[0] < fwd_next[-1]
        for i in range(N):
            assert abs(fwd_next[i] - bwd[i]) == 1


def test_gpipe_all_forwards_first():
    s = gpipe_schedule(3, 2, 3)
    for r in range(3):
        kinds = [a.kind for a in s.compute_order(r)]
        assert kinds == [K.F] * 6 + [K.B] * 6


def test_single_stage_has_no_communication():
    for gen in GENERATORS.values():
        s = gen(1, 3, 4)
        assert all(a.kind.is_compute for a in s.actions[0])
        validate(s)


def test_build_schedule():
    assert build_schedule("1f1b", 3, 2, 2) == one_f_one_b_schedule(3, 2, 2)
    assert build_schedule("gpipe", 3, 2, 2) == gpipe_schedule(3, 2, 2)
    with pytest.raises(ValueError):
        build_schedule("nope", 1, 1, 1)


def test_insert_communication_custom_order():
    P, M, N = 2, 2, 2
    comp = one_f_one_b_compute_order(P, M, N)
    s = insert_communication(P, M, N, comp)
    assert [a for r in range(P) for a in s.compute_order(r)] == \
        [a for r in range(P) for a in comp[r]]
    validate(s)
    # backward in the wrong chunk order can never run
    bad = gpipe_compute_order(P, M, N)
    i, j = bad[0].index(A("0B0.0")), bad[0].index(A("0B0.1"))
    bad[0][i], bad[0][j] = bad[0][j], bad[0][i]
    with pytest.raises(ScheduleError, match="deadlock") as e:
        insert_communication(P, M, N, bad)
    assert e.value.stuck[0] == A("0B0.0")
    with pytest.raises(ScheduleError, match="only F/B"):
        insert_communication(P, M, N, {0: [A("0OFF0.0")]})


# ---------------------------------------------------------------------------
# Validator catches broken schedules
# ---------------------------------------------------------------------------

def test_missing_compute_action():
    s = remove(gpipe_schedule(2, 1, 3), "1F0.1")
    with pytest.raises(ScheduleError, match=r"missing action 1F0\.1") as e:
        validate(s)
    assert e.value.action == A("1F0.1")


def test_missing_receive_action():
    s = remove(one_f_one_b_schedule(3, 2, 2), "2RECV_F1.0")
    with pytest.raises(ScheduleError, match=r"missing action 2RECV_F1\.0.*needed by 2F1\.0"):
        validate(s)


def test_duplicate_action():
    s = gpipe_schedule(2, 1, 2)
    s.actions[0].insert(1, A("0F0.0"))
    with pytest.raises(ScheduleError, match=r"0F0\.0 appears twice"):
        validate(s)


def test_swapped_backward_chunk_order():
    s = swap(gpipe_schedule(1, 1, 3), "0B0.1", "0B0.2")
    with pytest.raises(ScheduleError, match=r"0B0\.1 runs before its dependency 0B0\.2.*reverse chunk"):
        validate(s)


def test_swapped_forward_chunk_order():
    s = swap(gpipe_schedule(1, 2, 2), "0F1.0", "0F1.1")
    with pytest.raises(ScheduleError, match=r"0F1\.1 runs before its dependency 0F1\.0"):
        validate(s)


def test_backward_before_gradient_from_next_stage():
    # stage 0 runs its backward before receiving the gradient of stage 1's backward
    s = swap(gpipe_schedule(2, 1, 1), "0RECV_B0.0", "0B0.0")
    with pytest.raises(ScheduleError, match=r"0B0\.0 runs before its dependency 0RECV_B0\.0"):
        validate(s)


def test_backward_before_forward_on_next_stage():
    s = sched_from_lines(2, 1, 1,
                         "0F0.0 0SEND_F0.0 0RECV_B0.0 0B0.0",
                         "1RECV_F0.0 1B0.0 1F0.0 1SEND_B0.0")
    with pytest.raises(ScheduleError, match=r"1B0\.0 runs before its dependency 1F0\.0"):
        validate(s)


def test_waiting_for_gradient_before_sending_activation_deadlocks():
    # rank 0 waits for the gradient of a chunk whose activation it has not sent yet
    s = sched_from_lines(2, 1, 1,
                         "0F0.0 0RECV_B0.0 0SEND_F0.0 0B0.0",
                         "1RECV_F0.0 1F0.0 1B0.0 1SEND_B0.0")
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(s)
    assert e.value.stuck == {0: A("0RECV_B0.0"), 1: A("1RECV_F0.0")}
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(s, comm="buffered")


def test_last_stage_backward_needs_whole_forward():
    s = sched_from_lines(1, 1, 2, "0F0.0 0B0.1 0F0.1 0B0.0")
    with pytest.raises(ScheduleError, match=r"0B0\.1 runs before its dependency 0F0\.1"):
        validate(s)


def test_send_before_compute():
    s = swap(gpipe_schedule(2, 1, 1), "0F0.0", "0SEND_F0.0")
    with pytest.raises(ScheduleError, match=r"0SEND_F0\.0 runs before its dependency 0F0\.0"):
        validate(s)


def test_mismatched_send_recv_order_deadlocks():
    s = swap(gpipe_schedule(2, 1, 2), "1RECV_F0.0", "1RECV_F0.1")
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(s)
    assert e.value.stuck == {0: A("0SEND_F0.0"), 1: A("1RECV_F0.1")}
    assert "0SEND_F0.0" in str(e.value) and "1RECV_F0.1" in str(e.value)
    # with non-blocking sends the receive would get the wrong tensor
    with pytest.raises(ScheduleError, match=r"1RECV_F0\.1 is matched out of order"):
        validate(s, comm="buffered")


def test_blocking_send_send_deadlock_but_buffered_ok():
    # naive 1F1B comm placement: both ranks send at once
    s = sched_from_lines(2, 2, 1,
                         "0F0.0 0SEND_F0.0 0F1.0 0SEND_F1.0 0RECV_B0.0 0B0.0 0RECV_B1.0 0B1.0",
                         "1RECV_F0.0 1F0.0 1B0.0 1SEND_B0.0 1RECV_F1.0 1F1.0 1B1.0 1SEND_B1.0")
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(s)
    assert e.value.stuck == {0: A("0SEND_F1.0"), 1: A("1SEND_B0.0")}
    validate(s, comm="buffered")


def test_unmatched_extra_send_reported():
    s = gpipe_schedule(2, 1, 1)
    s.actions[1].remove(A("1SEND_B0.0"))
    with pytest.raises(ScheduleError, match=r"missing action 1SEND_B0\.0"):
        validate(s)


def test_wrong_rank_and_out_of_range():
    s = gpipe_schedule(2, 1, 1)
    s.actions[0].append(A("1F0.0"))
    with pytest.raises(ScheduleError, match="runs on rank 1"):
        validate(s)
    s = gpipe_schedule(2, 1, 1)
    s.actions[0].append(A("0F3.0"))
    with pytest.raises(ScheduleError, match="out of range"):
        validate(s)
    s = gpipe_schedule(2, 1, 1)
    s.actions[1].append(A("1SEND_F0.0"))
    with pytest.raises(ScheduleError, match="no next stage"):
        validate(s)
    with pytest.raises(ValueError, match="comm"):
        validate(s, comm="magic")


# ---------------------------------------------------------------------------
# Offload
# ---------------------------------------------------------------------------

def offloaded_1f1b():
    return one_f_one_b_schedule(2, 2, 3, offload=all_keys(2, 2, 3, stages=[0]))


def test_wait_without_prefetch():
    s = remove(offloaded_1f1b(), "0PRE0.1")
    with pytest.raises(ScheduleError, match=r"0WAIT0\.1 without a preceding 0PRE0\.1"):
        validate(s)


def test_prefetch_without_offload():
    s = remove(offloaded_1f1b(), "0OFF1.0")
    with pytest.raises(ScheduleError, match=r"0PRE1\.0 without a preceding 0OFF1\.0"):
        validate(s)


def test_wait_without_offload():
    s = remove(remove(offloaded_1f1b(), "0OFF1.0"), "0PRE1.0")
    with pytest.raises(ScheduleError, match=r"0WAIT1\.0 without a preceding 0OFF1\.0"):
        validate(s)


def test_backward_without_wait():
    s = remove(offloaded_1f1b(), "0WAIT0.2")
    with pytest.raises(ScheduleError, match=r"0B0\.2 runs before 0WAIT0\.2"):
        validate(s)
    s = remove(remove(offloaded_1f1b(), "0WAIT0.2"), "0PRE0.2")
    with pytest.raises(ScheduleError, match=r"0B0\.2 runs while its activations are offloaded"):
        validate(s)


def test_offload_before_forward_or_after_backward():
    s = swap(offloaded_1f1b(), "0F0.0", "0OFF0.0")
    with pytest.raises(ScheduleError, match=r"0OFF0\.0 runs before its dependency 0F0\.0"):
        validate(s)
    s = sched_from_lines(1, 1, 1, "0F0.0 0B0.0 0OFF0.0")
    with pytest.raises(ScheduleError, match=r"0OFF0\.0 runs after 0B0\.0"):
        validate(s)


def test_with_offload_placement():
    base = gpipe_schedule(2, 2, 2)
    keys = {(0, 0, 0), (0, 1, 1), (1, 1, 0)}
    s = with_offload(base, keys)
    assert gpipe_schedule(2, 2, 2, offload=keys) == s
    # removing the memory actions gives back the original schedule
    for r in range(2):
        assert [a for a in s.actions[r] if not a.kind.is_memory] == base.actions[r]
    for st_, m, i in keys:
        lst = s.actions[st_]
        pos = {a: j for j, a in enumerate(lst)}
        f, b = pos[Action(K.F, st_, m, i)], pos[Action(K.B, st_, m, i)]
        off, pre, wait = (pos[Action(k, st_, m, i)] for k in (K.OFFLOAD, K.PREFETCH, K.WAIT))
        assert off == f + 1
        assert wait == b - 1
        assert off < pre < wait
        prev_b = max(j for j, a in enumerate(lst) if a.kind is K.B and j < b)
        # the prefetch is issued before the preceding backward, so it overlaps with it
        assert pre < prev_b
        assert all(a.kind.is_memory or a.kind.is_comm for a in lst[pre + 1:prev_b])
    validate(s)
    # the first backward of a rank has no earlier backward: prefetch before the
    # compute action just before it (here the last forward, right after its OFF)
    s = with_offload(base, {(0, 0, 1), (0, 1, 1)})
    assert s.rank_line(0).startswith(
        "rank 0: 0F0.0 0SEND_F0.0 0F0.1 0OFF0.1 0SEND_F0.1 0F1.0 0SEND_F1.0 0PRE0.1 0F1.1 "
        "0OFF1.1 0SEND_F1.1 0RECV_B0.1 0WAIT0.1 0B0.1")
    validate(s)


def test_offload_prefetch_distance():
    keys = all_keys(1, 2, 3)
    s1 = gpipe_schedule(1, 2, 3, offload=keys)
    s3 = gpipe_schedule(1, 2, 3, offload=keys, prefetch_distance=3)
    p1, p3 = validate(s1).peak_inflight[0], validate(s3).peak_inflight[0]
    assert p1 == 2 and p3 == 4  # more prefetches in flight -> more device memory
    with pytest.raises(ValueError):
        with_offload(s1, keys, prefetch_distance=0)


def test_with_offload_errors():
    s = gpipe_schedule(2, 1, 2)
    with pytest.raises(ValueError, match="out of range"):
        with_offload(s, {(2, 0, 0)})
    with pytest.raises(ScheduleError, match="already"):
        with_offload(with_offload(s, {(0, 0, 0)}), {(0, 0, 0)})
    with pytest.raises(ScheduleError, match="not in the schedule"):
        with_offload(remove(s, "0B0.0"), {(0, 0, 0)})


@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("P,M,N", [(1, 2, 3), (2, 2, 3), (3, 3, 2), (4, 2, 5), (4, 3, 1)])
def test_offload_reduces_peak(kind, P, M, N):
    gen = GENERATORS[kind]
    base = validate(gen(P, M, N))
    full = validate(gen(P, M, N, offload=all_keys(P, M, N)))
    late = validate(gen(P, M, N, offload=all_keys(P, M, N)), prefetch_allocates=False)
    for r in range(P):
        assert full.peak_inflight[r] <= 2
        assert late.peak_inflight[r] <= full.peak_inflight[r]
        if base.peak_inflight[r] >= 3:
            assert full.peak_inflight[r] < base.peak_inflight[r]
        assert full.peak_offloaded[r] > 0
        assert full.timeline[r][-1][1] == 0
    # same compute order, so the same makespan under the default cost model
    assert full.makespan == base.makespan
    # offloading only stage 0 leaves the other stages untouched
    part = validate(gen(P, M, N, offload=all_keys(P, M, N, stages=[0])))
    assert part.peak_inflight[0] <= 2
    for r in range(1, P):
        assert part.peak_inflight[r] == base.peak_inflight[r]


def test_activation_bytes_callable_and_constant():
    P, M, N = 3, 2, 4

    def nbytes(stage, chunk):
        return 100 * (stage + 1) + chunk

    rep = validate(gpipe_schedule(P, M, N), activation_bytes=nbytes)
    for s in range(P):
        assert rep.peak_inflight[s] == M * sum(nbytes(s, i) for i in range(N))
    rep = validate(one_f_one_b_schedule(P, M, N), activation_bytes=2.5)
    for s in range(P):
        assert rep.peak_inflight[s] == 2.5 * predicted_peak_inflight("1f1b", P, M, N, s)
    off = validate(gpipe_schedule(P, M, N, offload=all_keys(P, M, N)), activation_bytes=nbytes)
    for s in range(P):
        # everything but the first backward's chunk (prefetched before the last forward)
        assert off.peak_offloaded[s] == M * sum(nbytes(s, i) for i in range(N)) - nbytes(s, N - 1)
        assert off.peak_inflight[s] <= 2 * max(nbytes(s, i) for i in range(N))


def test_timeline_counts():
    s = gpipe_schedule(1, 1, 2)
    rep = validate(s)
    assert [(str(a), v) for a, v in rep.timeline[0]] == [
        ("0F0.0", 1), ("0F0.1", 2), ("0B0.1", 1), ("0B0.0", 0)]
    s = with_offload(s, {(0, 0, 0)})
    assert str(s).splitlines()[1] == "rank 0: 0F0.0 0OFF0.0 0F0.1 0PRE0.0 0B0.1 0WAIT0.0 0B0.0"
    rep = validate(s)
    assert [v for _, v in rep.timeline[0]] == [1, 0, 1, 2, 1, 1, 0]
    rep = validate(s, prefetch_allocates=False)
    assert [v for _, v in rep.timeline[0]] == [1, 0, 1, 1, 0, 1, 0]
    assert rep.peak_offloaded[0] == 1
    assert "peak in-flight" in rep.summary()


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------

@st.composite
def random_compute_orders(draw):
    """Per rank, a random interleaving of the in-order forwards and backwards."""
    P = draw(st.integers(1, 4))
    M = draw(st.integers(1, 3))
    N = draw(st.integers(1, 4))
    orders = {}
    for s in range(P):
        fw = [Action(K.F, s, m, i) for m in range(M) for i in range(N)]
        bw = [Action(K.B, s, m, i) for m in range(M) for i in reversed(range(N))]
        picks = draw(st.permutations([0] * len(fw) + [1] * len(bw)))
        it = {0: iter(fw), 1: iter(bw)}
        orders[s] = [next(it[p]) for p in picks]
    return P, M, N, orders


def compute_orders_can_finish(P, M, N, orders) -> bool:
    """Whether the ranks' compute orders can all run to the end when every send is
    buffered: repeatedly run any rank's next action whose dependencies are done (F after
    the previous chunk's F and the previous stage's F; B after the next stage's B, or the
    last chunk's F on the last stage, and after the next chunk's B)."""
    done, pos = set(), {s: 0 for s in range(P)}

    def ready(a):
        s, m, i = a.key
        if a.kind is K.F:
            deps = [(K.F, s, m, i - 1)] * (i > 0) + [(K.F, s - 1, m, i)] * (s > 0)
        else:
            deps = [(K.F, s, m, N - 1) if s == P - 1 else (K.B, s + 1, m, i)]
            deps += [(K.B, s, m, i + 1)] * (i < N - 1)
        return all(Action(*d) in done for d in deps)

    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pos[s] < len(orders[s]) and ready(orders[s][pos[s]]):
                done.add(orders[s][pos[s]])
                pos[s] += 1
                progress = True
    return all(pos[s] == len(orders[s]) for s in range(P))


@given(random_compute_orders())
@settings(max_examples=150, deadline=None)
def test_insert_communication_is_deadlock_free_or_rejects(args):
    """Orders that can finish get a valid schedule; orders that cannot are rejected."""
    P, M, N, orders = args
    feasible = compute_orders_can_finish(P, M, N, orders)
    try:
        s = insert_communication(P, M, N, orders)
    except ScheduleError as e:
        assert "deadlock" in str(e)
        assert not feasible, f"rejected compute orders that can run: {e}"
        return
    assert feasible, "accepted compute orders that cannot all run"
    rep = validate(s)
    for r in range(P):
        assert s.compute_order(r) == orders[r]
        assert rep.timeline[r][-1][1] == 0


@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_validator_on_shuffled_schedules_only_raises_schedule_error(P, M, N, rnd):
    s = one_f_one_b_schedule(P, M, N, offload=all_keys(P, M, N, stages=[0]))
    original = s.copy()
    r = rnd.randrange(P)
    lst = s.actions[r]
    for _ in range(rnd.randint(1, 3)):
        i, j = rnd.randrange(len(lst)), rnd.randrange(len(lst))
        lst[i], lst[j] = lst[j], lst[i]
    deleted = rnd.random() < 0.3
    if deleted:
        del lst[rnd.randrange(len(lst))]
    try:
        validate(s)
    except ScheduleError as e:
        assert e.action is not None
        assert str(e.action) in str(e)
        assert s != original, f"the unchanged schedule was rejected: {e}"
    else:
        # every action of a generated schedule is needed: one deleted can never validate
        assert not deleted, f"a schedule with a deleted action was accepted:\n{s}"


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_any_feasible_compute_order_gets_deadlock_free_communication(P, M, N, rnd):
    """Random linear extensions of the dependency graph always validate."""
    fw = [(m, i) for m in range(M) for i in range(N)]
    bw = [(m, i) for m in range(M) for i in reversed(range(N))]
    nf, nb = [0] * P, [0] * P
    done = set()
    orders = {s: [] for s in range(P)}

    def ready(a):
        s, m, i = a.key
        if a.kind is K.F:
            deps = [(K.F, s, m, i - 1)] * (i > 0) + [(K.F, s - 1, m, i)] * (s > 0)
        else:
            deps = [(K.F, s, m, N - 1) if s == P - 1 else (K.B, s + 1, m, i)]
            deps += [(K.B, s, m, i + 1)] * (i < N - 1)
        return all(Action(*d) in done for d in deps)

    while len(done) < 2 * P * M * N:
        cands = [Action(K.F, s, *fw[nf[s]]) for s in range(P) if nf[s] < len(fw)]
        cands += [Action(K.B, s, *bw[nb[s]]) for s in range(P) if nb[s] < len(bw)]
        a = rnd.choice([c for c in cands if ready(c)])
        done.add(a)
        orders[a.stage].append(a)
        if a.kind is K.F:
            nf[a.stage] += 1
        else:
            nb[a.stage] += 1
    s = insert_communication(P, M, N, orders)
    validate(s)
    validate(s, comm="buffered")
