"""The clock's per-attention-call term (`solver.clock.Clock.attention_call_seconds`) and
its calibration: on hand-made profiles, what it charges and the plans it makes the solver
choose. No model runs here."""
import pytest

from sppo_fx.solver.budget import solve, step_terms
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.clock import Clock
from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.profiles import DeviceProfile

# two attention sites: every chunk makes two calls, forward and backward
COST = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=0, attention=((4, 16), (4, 16)))
MEM = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c, fixed_bytes=1 << 20, sites=2,
                  tensors=0)
T = 4096


def _overhead(lengths, clock, **kw):
    n = len(lengths)
    return step_terms(COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock, **kw).overhead


def test_every_site_of_every_chunk_pays_one_call():
    clock = Clock(attention_call_seconds=1e-3)
    for n in (1, 4, 16):
        assert _overhead([T // n] * n, clock) == pytest.approx(2 * n * 1e-3)


def test_streamed_blocks_are_calls_too():
    clock = Clock(attention_call_seconds=1e-3)
    n = 4
    blocks = [2 * i for i in range(n)]  # two sites, every earlier chunk's block, per pass
    streamed = _overhead([T // n] * n, clock, skeleton_blocks=blocks) - _overhead([T // n] * n, clock)
    assert streamed == pytest.approx(sum(blocks) * 1e-3)


def test_the_call_cost_flips_many_chunks_to_few():
    # the copies share the compute's cores: fewer chunks cost more offload. Without a call
    # cost the solver takes many chunks; at 50 ms a call one chunk is faster
    kw = dict(rate=1e11, c_half=0.0, bandwidth=1e9, copies_share_compute=True)
    free = solve(COST, MEM, T, 40 << 20, clock=Clock(), **kw)
    costly = solve(COST, MEM, T, 64 << 20, clock=Clock(attention_call_seconds=5e-2), **kw)
    many = solve(COST, MEM, T, 64 << 20, clock=Clock(), **kw)
    assert len(many.lengths) > 1 and len(costly.lengths) < len(many.lengths)
    assert costly.terms.overhead == pytest.approx(2 * len(costly.lengths) * 5e-2)
    assert free.peak_bytes <= 40 << 20


def test_a_profile_carries_the_call_cost_to_the_clock():
    prof = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, attention_call_seconds=2e-4)
    assert Clock.of(prof).attention_call_seconds == 2e-4
    assert DeviceProfile.from_json(prof.to_json()).attention_call_seconds == 2e-4
    assert "us per call" in prof.table()
    with pytest.raises(Exception, match="attention_call_seconds"):
        DeviceProfile.from_dict(dict(prof.to_dict(), attention_call_seconds=-1.0))


def test_the_call_cost_is_measured():
    import torch
    from sppo_fx.solver import clock_calibration as cc
    call = cc.attention_call_seconds(torch.device("cpu"), 0.01)
    assert 0 < call < 0.1
    # an op-by-op program's op runs forward and backward through autograd: dearer per op
    # than nothing, cheaper than a millisecond
    assert 0 < cc.op_seconds(0.01) < 1e-3


def test_attention_is_calibrated_on_the_path_the_programs_run(monkeypatch):
    # the chunk programs call the backward op without an lse gradient (ATen's flash kernels
    # on a CPU); autograd through chunk_attention(...).sum() would take the reference path,
    # 3-5x slower, and the clock would charge attention at that rate
    import torch
    from sppo_fx.chunk_attention import op
    from sppo_fx.solver import clock_calibration as cc

    def reference(*a, **k):
        raise AssertionError("the calibration ran the reference attention")
    monkeypatch.setattr(op, "_reference_bwd", reference)
    monkeypatch.setattr(op, "_reference_fwd", reference)
    e, f = cc.attention_pair_seconds(torch.device("cpu"), 0.01)
    assert e >= 0 and f >= 0 and e + 16 * f > 0


@pytest.mark.slow  # matplotlib's import and a PNG: ~25 s on 2 busy cores
def test_the_grid_picture_marks_rows_outside_the_band(tmp_path):
    pytest.importorskip("matplotlib", reason="the picture needs matplotlib (the `plot` extra)")
    from sppo_fx.benchmark.plot import accuracy_points, write_accuracy_picture
    rows = [dict(label="a", step_s=1.0, predicted_step_s=1.1), dict(label="b", step_s=3.0, predicted_step_s=1.0),
            dict(label="eager", step_s=0.5), dict(label="c", error="timed out")]
    assert [p[0] for p in accuracy_points(rows)] == ["a", "b"]
    (path,) = write_accuracy_picture(rows, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 1000
    assert write_accuracy_picture([rows[2]], str(tmp_path / "none.png")) == []


def test_a_failed_grid_run_is_recorded_not_fatal(tmp_path, monkeypatch):
    import importlib.util
    import os
    import subprocess
    spec = importlib.util.spec_from_file_location(
        "clock_grid", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "clock_grid.py"))
    grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 2))
    assert grid.main(["--grid", "tiny:64,small:64", "--out", str(tmp_path)]) == 0
    import json
    record = json.loads((tmp_path / "clock-grid.json").read_text())
    assert [r["label"] for r in record["rows"]] == ["tiny T=64", "small T=64"]
    assert all("bench exited 2" in r["error"] for r in record["rows"])
    assert isinstance(record["profiles"], list)  # the profiles the rows were predicted with


def test_a_recompute_runs_the_forward_ops_and_calls_again():
    cost = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=100, attention=((4, 16),))
    lengths = [T // 4] * 4

    def overhead(clock, fraction):
        return step_terms(cost, lengths, [0.0] * 4, [0] * 4, 1e11, 0.0, 1e9, fraction, clock=clock).overhead
    ops = Clock(op_seconds=1e-4)
    assert overhead(ops, 1.0) == pytest.approx(overhead(ops, 0.0) * 4 / 3)  # fwd, recompute, bwd (2x)
    calls = Clock(attention_call_seconds=1e-3)
    assert overhead(calls, 1.0) == pytest.approx(overhead(calls, 0.0) * 1.5)  # a forward: half a call


def test_calibrate_takes_the_op_cost_from_a_real_chunk_program(monkeypatch):
    # a plain-op chain sees a tenth of what an op of a chunk program costs on a CPU
    # (tiny, T = 256, 16 chunks: measured/predicted 7.6 with it, 0.82 with the program's)
    from sppo_fx.solver import clock_calibration as cc
    from sppo_fx.solver.calibration import calibrate
    monkeypatch.setattr(cc, "program_op_seconds", lambda call, budget_s: 1.25e-3)
    assert calibrate("cpu", seconds=0.2).op_seconds == 1.25e-3
    monkeypatch.setattr(cc, "program_op_seconds", lambda call, budget_s: None)  # the probe failed
    assert 0 < calibrate("cpu", seconds=0.2).op_seconds < 1.25e-3


@pytest.mark.slow  # captures and runs two tiny programs: ~5 s on 2 busy cores
def test_the_program_op_cost_is_measured():
    from sppo_fx.solver import clock_calibration as cc
    assert 0 < cc.program_op_seconds(0.0, 0.05) < 1e-2


@pytest.mark.slow  # captures and runs two tiny programs through the memory passes: ~8 s
def test_the_memory_passes_op_cost_is_measured_on_their_programs(monkeypatch):
    """The probe with a tier times the programs the memory passes build: the compile it
    asks for carries the tier, and the figure is a real per-op cost."""
    import sppo_fx
    from sppo_fx.solver import clock_calibration as cc
    tiers, compile_ = [], sppo_fx.compile

    def spy(model, **kw):
        tiers.append(kw.get("offload"))
        return compile_(model, **kw)
    monkeypatch.setattr(sppo_fx, "compile", spy)
    assert 0 < cc.program_op_seconds(0.0, 0.05, offload="device") < 1e-2
    assert tiers == ["device", "device"]


# -- attention by head dim, the causal square, and load-proof timing ------------------------

def _attention(cost, lengths, clock):
    n = len(lengths)
    return step_terms(cost, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock).attention


def test_attention_is_charged_at_the_measured_head_dim_not_the_line():
    # on a CPU a head dim of 8 costs what 32 does: twice e + 8·f fitted through 16 and 64
    cost = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=0, attention=((4, 8),))
    line = dict(attention_pair_seconds=2e-9, attention_pair_dim_seconds=1.5e-10)
    table = Clock(**line, attention_by_dim=((8, 8e-9), (16, 5e-9), (64, 13e-9)))
    pairs = T * (T + 1) / 2
    assert _attention(cost, [T], table) == pytest.approx(pairs * 4 * 8e-9)
    assert _attention(cost, [T], Clock(**line)) == pytest.approx(pairs * 4 * (2e-9 + 8 * 1.5e-10))
    # between measured dims: linear; below the first: the first's; above the last: extended
    assert table.pair_seconds(40) == pytest.approx(9e-9)
    assert table.pair_seconds(4) == pytest.approx(8e-9)
    assert table.pair_seconds(128) == pytest.approx(13e-9 + 64 * (8e-9 / 48))


def test_a_chunks_causal_square_costs_its_measured_factor():
    clock = Clock(attention_by_dim=((16, 4e-9),), attention_square=((256, 2.0), (1024, 1.0)))
    flat = Clock(attention_by_dim=((16, 4e-9),))
    per = 2 * 4 * 4e-9  # COST: two sites of 4 heads at d = 16
    for n, factor in ((16, 2.0), (4, 1.5), (2, 1.0)):  # chunks of 256, 1024 (log-midway: 512), 2048
        c = T // n
        square = n * c * (c + 1) / 2 * per
        extra = {16: 1.0, 4: 0.0, 2: 0.0}[n]  # 256-token chunks pay the factor 2; >= 1024 pay 1
        assert _attention(COST, [c] * n, flat) == pytest.approx(T * (T + 1) / 2 * per)
        assert _attention(COST, [c] * n, clock) - _attention(COST, [c] * n, flat) == pytest.approx(extra * square)
    assert clock.square_factor(512) == pytest.approx(1.5)
    assert clock.square_factor(64) == 2.0 and clock.square_factor(8192) == 1.0


def test_short_chunks_pay_their_measured_pair_cost():
    # a pair in a chunk of 64 queries costs 1.7x one in 256 (an idle CPU), 1024: 0.9x
    size = ((64, 1.7), (256, 1.0), (1024, 0.9))
    clock = Clock(attention_by_dim=((16, 4e-9),), attention_size=size)
    flat = Clock(attention_by_dim=((16, 4e-9),))
    for c, factor in ((32, 1.7), (64, 1.7), (128, 1.35), (256, 1.0), (1024, 0.9), (4096, 0.9)):
        n = T // c
        assert _attention(COST, [c] * n, clock) == pytest.approx(factor * _attention(COST, [c] * n, flat))
    assert Clock.of(DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, attention_by_dim=((16, 4e-9),),
                                  attention_size=size)).size_factor(64) == 1.7


def test_a_profile_carries_the_attention_tables():
    prof = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, attention_by_dim=((8, 8e-9), (32, 8e-9)),
                         attention_square=((256, 1.6), (1024, 1.1)))
    back = DeviceProfile.from_json(prof.to_json())
    assert back == prof
    clock = Clock.of(back)
    assert clock.attention_by_dim == ((8.0, 8e-9), (32.0, 8e-9)) and clock.square_factor(1024) == 1.1
    assert "d = 8/32" in prof.table() and "square x1.60/1.10" in prof.table()
    for field, bad in (("attention_by_dim", ((8, -1e-9),)), ("attention_square", ((256, 0.5),)),
                       ("attention_by_dim", ((0, 1e-9),)), ("attention_size", ((64, 0.0),))):
        with pytest.raises(Exception, match=field):
            DeviceProfile.from_dict(dict(prof.to_dict(), **{field: bad}))


def test_the_attention_tables_are_measured():
    import torch
    from sppo_fx.solver import clock_calibration as cc
    e, f, by_dim, square, size = cc.attention_figures(torch.device("cpu"), 0.02)
    assert [d for d, _ in by_dim] == list(cc.ATTENTION_DIMS) and all(s > 0 for _, s in by_dim)
    assert [c for c, _ in square] == list(cc.SQUARE_QUERIES) and all(x >= 1 for _, x in square)
    assert [c for c, _ in size] == list(cc.SIZE_QUERIES) and dict(size)[256] == 1.0 and all(x > 0 for _, x in size)
    assert e >= 0 and f >= 0


@pytest.mark.parametrize("threads, heads", [(1, 4), (2, 4), (8, 8)])
def test_cpu_attention_is_timed_on_as_many_heads_as_threads(monkeypatch, threads, heads):
    # the CPU kernel splits its work over heads: on one head, threads sit idle and the
    # figure per pair and head came out 1.5x (some processes 2.6x) what the models' 4-12
    # heads cost on 2 threads
    import torch
    from sppo_fx.solver import clock_calibration as cc
    seen = []
    real = cc._attention_pass

    def recording(device, c, p, d, h=4):
        seen.append((c, h))
        return real(device, 8, 8, 8, 1)  # tiny work: what is checked is the heads asked for
    monkeypatch.setattr(cc, "_attention_pass", recording)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cc.attention_figures(torch.device("cpu"), 0.0)
    finally:
        torch.set_num_threads(before)
    assert {h for c, h in seen if c >= 256} == {heads}  # shorter shapes run more heads
    assert all(h >= heads for c, h in seen if c >= 128)  # (the call-cost probe: 1 query)


def test_compute_is_timed_in_cpu_time_on_one_thread():
    # a core shared with another process slows a repetition's wall time however many run;
    # CPU time does not count the time the core was elsewhere (here: asleep)
    import time
    import torch
    from sppo_fx.solver import clock_calibration as cc
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cc._best(lambda: time.sleep(0.02), 2, 0.0, cc.compute_timer()) < 0.01
        start, stop = cc.stopwatch(torch.device("cpu"))  # what calibration.calibrate times with
        t0 = start()
        time.sleep(0.02)
        assert stop(t0) < 0.01
        torch.set_num_threads(2)  # several threads' CPU time adds up: wall time then
        assert cc.compute_timer() is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_best_each_interleaves_warms_up_and_keeps_the_best():
    # the calibration's one timing primitive (solver.clock_calibration.best_each): a warm-up
    # call each, then rounds a, b, a, b (a burst of load hits both alike), the best repetition
    import itertools
    from sppo_fx.solver import clock_calibration as cc
    calls, ticks = [], itertools.count()
    slow_first = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 7.0, 4.0])}
    now = [0.0]

    def timer():
        next(ticks)
        return now[0]

    def fn(name):
        def run():
            calls.append(name)
            if len(calls) > 2:  # the warm-ups are not timed
                now[0] += next(slow_first[name])
        return run
    best = cc.best_each([fn("a"), fn("b")], 0.0, min_rounds=3, timer=timer)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert best == [1.0, 2.0]


# ---------------------------------------------------------------- the element-wise term

EW_COST = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=0, elementwise_bytes=2e5)


def _ew_step(profile, lengths=(1024,) * 4, recompute_fraction=0.0):
    n = len(lengths)
    return step_terms(EW_COST, list(lengths), [0.0] * n, [0] * n, profile.flops_per_s, profile.n_half, 1e9,
                      recompute_fraction, clock=Clock.of(profile))


def test_a_slower_elementwise_bandwidth_gives_a_longer_step():
    fast = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, n_half=0.0, elementwise_bytes_per_s=8e9)
    slow = DeviceProfile.from_dict(dict(fast.to_dict(), elementwise_bytes_per_s=4e9))
    a, b = _ew_step(fast), _ew_step(slow)
    # forward, then backward at 2x the forward's bytes: 3 passes over 2e5 B/token x 4096 tokens
    assert a.elementwise == pytest.approx(3 * 2e5 * 4096 / 8e9)
    assert b.elementwise == pytest.approx(2 * a.elementwise)
    assert b.total > a.total and b.total - a.total == pytest.approx(a.elementwise)
    # a recompute policy replays the forward's element-wise ops once more
    assert _ew_step(fast, recompute_fraction=0.1).elementwise == pytest.approx(4 / 3 * a.elementwise)
    # a profile without the figure (built-in GPU ones, older caches) leaves the term out
    assert _ew_step(DeviceProfile.from_dict(dict(fast.to_dict(), elementwise_bytes_per_s=0.0))).elementwise == 0


def test_the_elementwise_bandwidth_travels_in_the_profile():
    prof = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, elementwise_bytes_per_s=5e9)
    assert DeviceProfile.from_json(prof.to_json()).elementwise_bytes_per_s == 5e9
    assert "element-wise" in prof.table()
    old = {k: v for k, v in prof.to_dict().items() if k != "elementwise_bytes_per_s"}  # a profile stored before
    assert DeviceProfile.from_dict(old).elementwise_bytes_per_s == 0.0
    with pytest.raises(Exception, match="elementwise_bytes_per_s"):
        DeviceProfile.from_dict(dict(prof.to_dict(), elementwise_bytes_per_s=-1.0))


def test_the_elementwise_bandwidth_is_measured():
    import torch
    from sppo_fx.solver import clock_calibration as cc
    bw = cc.elementwise_bytes_per_s(torch.device("cpu"), 0.02, tokens=64, width=64)
    assert 1e7 < bw < 1e13  # bytes/s: neither nil nor a free pass


def _exported(fn):
    """A module's exported graph with a dynamic sequence dim, and that dim's symbol."""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return fn(self.lin(x))

    seq = torch.export.Dim("seq", min=2, max=1 << 16)
    ep = torch.export.export(M(), (torch.randn(2, 8, 16),), dynamic_shapes=({1: seq},))
    gm = ep.graph_module
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
    return gm, x.meta["val"].shape[1].node.expr


def test_more_elementwise_ops_per_token_give_more_bytes():
    import torch
    from sppo_fx.solver.partition import cost_model_from_graph
    one = cost_model_from_graph(*_exported(lambda h: h * 2.0))
    three = cost_model_from_graph(*_exported(lambda h: torch.nn.functional.silu(h * 2.0 + h)))
    # fp32 [2, T, 16]: mul reads and writes 2 x 128 B per token; add 3 x 128, silu 2 x 128
    assert one.elementwise_bytes == pytest.approx(2 * 128)
    assert three.elementwise_bytes == pytest.approx(7 * 128)
    # the matmul is not element-wise work: the same FLOPs, and the bytes scale with the batch
    assert one.per_token == three.per_token
    assert one.scaled(0.5).elementwise_bytes == pytest.approx(128)


def test_the_chunk_programs_cost_has_the_elementwise_bytes():
    import torch
    from sppo_fx.capture import capture
    from sppo_fx.models import build
    from sppo_fx.passes import cost as cost_model
    from sppo_fx.passes import transform
    from sppo_fx.solver.partition import cost_model_from_graph
    model = build("llama", "tiny")
    x = torch.randint(0, 97, (1, 32))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    graph, program = transform(cap)
    cc = cost_model.chunk_cost(program, cap.seq, first_chunk=False)
    at = [cc.evaluate(c=n, p=64)["elementwise_bytes"] for n in (64, 128)]
    per_token = (at[1] - at[0]) / 64
    # the chunk program's per-token bytes are the captured graph's (within what the chunk
    # pass adds around attention)
    whole = cost_model_from_graph(graph, cap.seq).elementwise_bytes
    assert whole > 0 and 0.8 * whole < per_token < 1.5 * whole
