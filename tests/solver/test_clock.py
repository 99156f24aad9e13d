"""The solver's clock (`sppo_fx/solver/clock.py`): its terms on hand-made profiles, the plans
they make the solver choose, and the benchmark's accuracy summary. No model runs here."""
import dataclasses
import math
import time

import pytest

from sppo_fx.benchmark.report import accuracy
from sppo_fx.errors import SppoError
from sppo_fx.plan import Plan
from sppo_fx.solver.budget import budget_plan, solve, step_terms
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.clock import Clock, StepTerms
from sppo_fx.solver.profiles import DeviceProfile, get_profile

COST = __import__("sppo_fx.solver.partition", fromlist=["ChunkCostModel"]).ChunkCostModel(
    per_token=1e7, per_pair=1e3, ops=200, attention=((4, 16),))
# "none" saves a lot (it must offload to fit), "full" saves little at the price of a second forward
NONE = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c, fixed_bytes=1 << 20, sites=2,
                   tensors=50)
FULL = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 2048 * c, fixed_bytes=1 << 20, sites=2,
                   recompute="full", recompute_fraction=1.0, tensors=4)
T = 4096
CPU = dict(rate=1e11, c_half=0.0, copies_share_compute=True)


def _solve(budget, bandwidth, clock=None, **kw):
    return solve(COST, [NONE, FULL], T, budget, bandwidth=bandwidth, clock=clock, **{**CPU, **kw})


def _shape(plan):
    return len(plan.lengths), plan.recompute, sum(1 for a in plan.ratios if a > 0)


def test_a_faster_disk_gives_a_different_plan():
    # slow disk: recompute everything rather than write; fast disk: keep it and write
    slow, fast = _solve(24 << 20, 1e8), _solve(24 << 20, 1e9)
    assert slow.recompute == "full" and not any(slow.ratios)
    assert fast.recompute == "none" and any(fast.ratios)
    assert fast.step_seconds < slow.step_seconds


@pytest.mark.parametrize("bandwidth", [1e6, 1e8, 1e10])
@pytest.mark.parametrize("clock", [Clock(), Clock(op_seconds=1e-3), Clock(file_seconds=1e-2)])
def test_a_slower_disk_never_exceeds_the_budget(bandwidth, clock):
    for budget in (20 << 20, 24 << 20, 40 << 20):
        plan = _solve(budget, bandwidth, clock)
        assert plan.peak_bytes <= budget


def test_the_per_op_overhead_flips_many_chunks_to_few():
    # without fixed costs many short chunks win (less to offload); at 1 ms an op, one chunk
    free, costly = _solve(40 << 20, 1e9), _solve(40 << 20, 1e9, Clock(op_seconds=1e-3))
    assert len(free.lengths) >= 16 and len(costly.lengths) == 1
    fraction = {"none": 0.0, "full": 1.0}[costly.recompute]  # a recompute runs the forward's ops again
    assert costly.terms.overhead == pytest.approx(200 * (3 + fraction) * 1e-3)


def test_the_per_file_cost_flips_offload_to_recompute():
    free, costly = _solve(24 << 20, 1e9), _solve(24 << 20, 1e9, Clock(file_seconds=1e-2))
    assert free.recompute == "none" and any(free.ratios)
    assert costly.recompute == "full" and not any(costly.ratios)


def test_the_clock_ranks_a_streamed_skeleton_against_a_kept_one():
    # at 14 MiB keeping the skeleton needs many chunks, each offloading its saved tensors;
    # streaming it fits in one chunk. Free files: many chunks win; at 10 ms a file, streaming
    kw = dict(skeletons=("keep", "offload"))
    budget = 14 << 20
    free = _solve(budget, 1e10, **kw)
    costly = _solve(budget, 1e10, Clock(file_seconds=1e-2), **kw)
    assert free.skeleton == "keep" and costly.skeleton == "offload"
    # the old rule (stream only when keeping cannot fit) keeps it, at a higher predicted step
    old = _solve(budget, 1e10, Clock(file_seconds=1e-2), prefer_kept_skeleton=True, **kw)
    assert old.skeleton == "keep" and old.step_seconds > costly.step_seconds


def test_attention_by_its_pair_cost_is_the_same_for_every_partition():
    # causal pairs over any partition sum to T (T + 1) / 2
    clock = Clock(attention_pair_seconds=2e-9, attention_pair_dim_seconds=1e-10)
    want = T * (T + 1) / 2 * 4 * (2e-9 + 16 * 1e-10)
    for lengths in ([T], [1024] * 4, [3000, 1000, 96]):
        terms = step_terms(COST, lengths, [0.0] * len(lengths), [0] * len(lengths), 1e11, 0.0, 1e9, clock=clock)
        assert terms.attention == pytest.approx(want)
        # and its FLOPs left the compute term (no double count)
        assert terms.compute == pytest.approx(COST.per_token * T * 3 / 1e11)


def test_without_an_attention_figure_its_flops_count():
    terms = step_terms(COST, [T], [0.0], [0], 1e11, 0.0, 1e9)
    assert terms.attention == 0
    assert terms.compute == pytest.approx(COST.forward_flops(T, 0) * 3 / 1e11)


def test_streamed_skeleton_files_grow_with_the_chunks_not_their_square():
    clock = Clock(file_seconds=1e-3)
    def overhead(n):
        lengths = [T // n] * n
        return step_terms(COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock,
                          skeleton_blocks=[2 * i for i in range(n)]).overhead
    # one file per step, one read task per chunk that streams (n - 1) and pass (two)
    assert overhead(8) == pytest.approx(1e-3 * (1 + 2 * 7))
    assert overhead(16) == pytest.approx(1e-3 * (1 + 2 * 15))


def test_streamed_skeleton_blocks_still_cost_their_attention_calls():
    clock = Clock(op_seconds=1e-6)
    def overhead(n):
        lengths = [T // n] * n
        return step_terms(COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock,
                          skeleton_blocks=[2 * i for i in range(n)]).overhead - step_terms(
            COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock).overhead
    # blocks read per pass: 2 sites x n (n - 1) / 2; two passes: N^2 by attention's nature
    assert overhead(16) / overhead(8) == pytest.approx(16 * 15 / (8 * 7))


def test_a_measured_block_read_replaces_the_ops_and_half_a_call():
    """With the profile's `skeleton_read_seconds` a streamed block read costs that figure,
    not `BLOCK_OPS` ops and half an attention call (which overcharged the minimum plans'
    reads about 2x on this machine, docs/solver-clock.md)."""
    n, lengths, blocks = 8, [T // 8] * 8, [2 * i for i in range(8)]
    reads = 2 * sum(blocks)  # forward and backward

    def stream_cost(clock):
        def overhead(skeleton_blocks):
            return step_terms(COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock,
                              skeleton_blocks=skeleton_blocks).overhead
        return overhead(blocks) - overhead(None)
    composite = Clock(op_seconds=1e-6, attention_call_seconds=1e-4)
    measured = dataclasses.replace(composite, read_seconds=3e-5)
    assert stream_cost(measured) == pytest.approx(reads * 3e-5)
    assert stream_cost(composite) == pytest.approx(reads * (8 * 1e-6 + 1e-4 / 2))


def test_a_cheaper_block_read_makes_the_solver_stream_the_skeleton():
    """The ranking of a streamed and a kept skeleton flips with the read's measured cost."""
    kw = dict(skeletons=("keep", "offload"))
    budget = 14 << 20
    cheap = _solve(budget, 1e10, Clock(file_seconds=1e-5, read_seconds=1e-7), **kw)
    dear = _solve(budget, 1e10, Clock(file_seconds=1e-5, read_seconds=1e-2), **kw)
    assert cheap.skeleton == "offload" and dear.skeleton == "keep"
    assert dear.step_seconds > cheap.step_seconds


def test_a_full_recompute_streams_the_skeleton_a_third_time():
    """Recompute "full" calls every chunk's prefix attention again in the backward, so a
    streamed skeleton is read in three passes, not two: its blocks' calls and ops, its read
    tasks and its bytes (`memory_model.skeleton_passes_of`)."""
    from sppo_fx.solver.memory_model import skeleton_passes_of
    assert [skeleton_passes_of(p) for p in ("none", "cheap", "full")] == [2, 2, 3]
    n, clock = 8, Clock(op_seconds=1e-6, attention_call_seconds=1e-4, file_seconds=1e-3)
    lengths, blocks, reads = [T // n] * n, [2 * i for i in range(n)], [1e6 * i for i in range(n)]

    def terms(passes, skeleton=True):
        return step_terms(COST, lengths, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, 1.0, reads if skeleton else None,
                          copies_share_compute=True, clock=clock, skeleton_blocks=blocks if skeleton else None,
                          skeleton_passes=passes)
    base = terms(2, skeleton=False)
    two, three = terms(2), terms(3)
    # everything the stream adds (minus the one file per step) grows by half
    assert three.overhead - base.overhead - 1e-3 == pytest.approx(1.5 * (two.overhead - base.overhead - 1e-3))
    assert three.exposed_copy == pytest.approx(1.5 * two.exposed_copy)


def test_the_solver_charges_a_full_recomputes_third_skeleton_pass():
    """The same plan under a "full" model costs more than under a model that recomputes as
    much but keeps attention's outputs: only the skeleton's third pass differs."""
    from sppo_fx.solver.budget import _plan_for
    cheap_as_full = MemoryModel(level1=FULL.level1, level2=FULL.level2, fixed_bytes=FULL.fixed_bytes, sites=2,
                                recompute="cheap", recompute_fraction=1.0, tensors=4)
    clock = Clock(op_seconds=1e-6, attention_call_seconds=1e-4, file_seconds=1e-3)
    lengths = [T // 16] * 16

    def step(model):
        plan, _floor = _plan_for(COST, model, lengths, 1 << 40, 1e11, 1e9, 0.0, "offload", clock=clock,
                                 copies_share_compute=True)
        return plan.terms
    full, cheap = step(FULL), step(cheap_as_full)
    assert full.overhead > cheap.overhead and full.exposed_copy > cheap.exposed_copy
    assert full.compute == pytest.approx(cheap.compute) and full.attention == pytest.approx(cheap.attention)


def test_the_plan_prints_its_predicted_terms():
    chosen = _solve(40 << 20, 1e9, Clock(op_seconds=1e-4))
    plan = budget_plan(T, chosen, 40 << 20, "disk")
    text = plan.table()
    assert "compute" in text and "exposed copy" in text and "overheads" in text
    assert sum(plan.step_terms.values()) == pytest.approx(plan.step_seconds)
    assert Plan.from_json(plan.to_json()).step_terms == plan.step_terms


def test_clock_of_a_profile_and_its_checks():
    prof = get_profile("h100")
    assert Clock.of(prof) == Clock()  # spec profiles: no fixed costs known, terms left out
    cpu = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, op_seconds=1e-5, file_seconds=1e-4,
                        compiled_speedup=2.0)
    assert Clock.of(cpu).file_seconds == 1e-4 and Clock.of(cpu, tier="host").file_seconds == 0
    assert Clock.of(cpu, compiled=False).compiled_speedup == 1.0
    assert Clock.of(cpu).read_seconds == 0 and Clock.of(dataclasses.replace(cpu, skeleton_read_seconds=4e-5)
                                                        ).read_seconds == 4e-5
    bad = dict(cpu.to_dict(), op_seconds=-1.0)
    with pytest.raises(SppoError, match="op_seconds"):
        DeviceProfile.from_dict(bad)


def test_a_plan_with_a_tier_is_charged_the_memory_passes_op():
    """Op by op, a plan with a tier runs the memory passes' programs (AOTAutograd's graphs,
    offload nodes), about 2.3x the plain programs' fixed cost per chunk on a CPU: its ops
    cost `pass_op_seconds`; a plan without one, and compiled programs, `op_seconds`."""
    cpu = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, op_seconds=1e-5, pass_op_seconds=3e-5)
    assert Clock.of(cpu, compiled=False, tier="host").op_seconds == 3e-5
    assert Clock.of(cpu, compiled=False, tier="disk").op_seconds == 3e-5
    assert Clock.of(cpu, compiled=False, tier=None).op_seconds == 1e-5
    assert Clock.of(cpu, compiled=True, tier="disk").op_seconds == 1e-5
    assert Clock.of(dataclasses.replace(cpu, pass_op_seconds=0.0), compiled=False, tier="host").op_seconds == 1e-5
    # the solver sees it: at 1 ms an op through the passes, one chunk instead of many
    plain, passes = (_solve(40 << 20, 1e9, Clock.of(p, compiled=False, tier="host"))
                     for p in (dataclasses.replace(cpu, op_seconds=0.0, pass_op_seconds=0.0),
                               dataclasses.replace(cpu, op_seconds=0.0, pass_op_seconds=1e-3)))
    assert len(plain.lengths) >= 16 and len(passes.lengths) == 1
    with pytest.raises(SppoError, match="pass_op_seconds"):
        DeviceProfile.from_dict(dict(cpu.to_dict(), pass_op_seconds=-1.0))


def test_the_clock_figures_are_measured():
    from sppo_fx.solver import clock_calibration as cc
    assert 0 < cc.op_seconds(0.01) < 1e-2
    assert 0 < cc.file_seconds(budget_s=0.01, files=4) < 1.0


def test_the_block_read_figure_is_measured_on_the_reads(monkeypatch):
    """`skeleton_read_seconds` times the streamed op's block reads: a millisecond more per
    block the log yields shows as about a millisecond more per read."""
    from sppo_fx.runtime.skeleton_log import SkeletonLog
    from sppo_fx.solver import clock_calibration as cc
    plain = cc.skeleton_read_seconds(0.02)
    assert 0 < plain < 1e-3
    stream = SkeletonLog.stream

    def slow_stream(self, blocks):
        for pair in stream(self, blocks):
            time.sleep(1e-3)
            yield pair
    monkeypatch.setattr(SkeletonLog, "stream", slow_stream)
    assert cc.skeleton_read_seconds(0.02) > plain + 0.8e-3


def test_accuracy_summary_is_median_and_worst_abs_log():
    rows = [dict(label="a", step_s=1.0, predicted_step_s=2.0, peak_extra_bytes=100 << 20,
                 predicted_peak_bytes=100 << 20),
            dict(label="b", step_s=1.0, predicted_step_s=1.0, peak_extra_bytes=100 << 20,
                 predicted_peak_bytes=50 << 20),
            dict(label="c", step_s=4.0, predicted_step_s=1.0, peak_extra_bytes=1, predicted_peak_bytes=1),
            dict(label="eager", step_s=1.0, peak_extra_bytes=1 << 30),
            dict(label="d", error="boom")]
    acc = accuracy(rows)
    assert acc["step"]["rows"] == 3 and acc["step"]["worst_row"] == "c"
    assert acc["step"]["median_abs_log"] == pytest.approx(math.log(2))
    assert acc["step"]["worst_abs_log"] == pytest.approx(math.log(4))
    assert acc["peak"]["rows"] == 2  # row c's peak is within noise of zero
    assert acc["peak"]["worst_abs_log"] == pytest.approx(math.log(2))


def test_step_terms_total():
    assert StepTerms(1, 2, 3, 4).total == 10


def test_a_model_is_charged_the_block_read_of_its_own_attention_shape():
    """A read's cost grows with heads and head dim (the merge, the kernel's per-head work):
    the orchestrator's profile carries the read measured at the model's widest site."""
    import types
    from sppo_fx.options import compile_options
    from sppo_fx.orchestrate.stage import device_profile
    from sppo_fx.solver.clock_calibration import with_model_reads
    from sppo_fx.solver.partition import ChunkCostModel
    cpu = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, op_seconds=1e-5, skeleton_read_seconds=4e-5,
                        attention_by_dim=((8, 1e-9), (64, 2e-9)))
    narrow, wide = (ChunkCostModel(per_token=1e6, per_pair=1e3, ops=10, attention=sites)
                    for sites in (((4, 8),), ((4, 8), (24, 64))))
    small, large = (with_model_reads(cpu, cost).skeleton_read_seconds for cost in (narrow, wide))
    assert 0 < small < large and small != 4e-5
    assert with_model_reads(get_profile("h100"), wide) == get_profile("h100")  # no read figure: unchanged
    from conftest import one_site_chunk_program

    def program(**attention_kwargs):
        return types.SimpleNamespace(chunk=one_site_chunk_program(**attention_kwargs))
    entry = types.SimpleNamespace(cost=wide, device=lambda: "cpu", program=program(window=16))
    streams = compile_options(budget="1GiB", offload="disk")
    assert device_profile(entry, streams, cpu).skeleton_read_seconds == large
    assert device_profile(entry, compile_options(budget="1GiB", offload="disk", skeleton="keep"), cpu) is cpu
    soft_capped = types.SimpleNamespace(cost=wide, device=lambda: "cpu", program=program(softcap=5.0))
    assert device_profile(soft_capped, streams, cpu) is cpu  # its skeleton is never streamed: no read to price


def test_weights_beyond_the_cache_are_read_by_every_chunk():
    """A model whose weights exceed the cache pays their read from memory in each chunk's
    forward, backward and full recompute; one whose weights fit does not."""
    heavy = dataclasses.replace(COST, weight_bytes=4e8)
    clock = Clock(weight_read_seconds=6e-11, cache_bytes=32 << 20)

    def compute(cost, n, clock, fraction=0.0):
        return step_terms(cost, [T // n] * n, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, fraction, clock=clock).compute
    adds = 2 * 4e8 * 6e-11  # every chunk but the backward's first adds into the sums (compiled: 2 passes)
    for n in (4, 64):
        assert compute(heavy, n, clock) - compute(heavy, n, Clock()) == pytest.approx(n * 2 * 4e8 * 6e-11
                                                                                       + (n - 1) * adds)
        assert compute(heavy, n, clock, 1.0) - compute(heavy, n, Clock(), 1.0) == pytest.approx(
            n * 3 * 4e8 * 6e-11 + (n - 1) * adds)
    light = dataclasses.replace(COST, weight_bytes=16 << 20)
    assert compute(light, 64, clock) == compute(light, 64, Clock())


def test_weight_gradients_are_added_from_memory_by_every_chunk_but_one():
    """Beyond the cache, adding a chunk's weight gradients into their sums passes over
    weight-sized sums from memory: 3 passes op by op (`add_`), 2 compiled (in the GEMM);
    the backward's first chunk makes the sums and pays none; weights that fit the cache,
    or a clock without the figure, pay nothing."""
    heavy = dataclasses.replace(COST, weight_bytes=4e8)
    op_by_op = Clock(weight_read_seconds=6e-11, cache_bytes=32 << 20, op_by_op=True)
    compiled = dataclasses.replace(op_by_op, op_by_op=False)
    assert op_by_op.weight_grad_seconds(heavy) == pytest.approx(3 * 4e8 * 6e-11)
    assert compiled.weight_grad_seconds(heavy) == pytest.approx(2 * 4e8 * 6e-11)
    assert op_by_op.weight_grad_seconds(dataclasses.replace(COST, weight_bytes=16 << 20)) == 0.0
    assert Clock(op_by_op=True).weight_grad_seconds(heavy) == 0.0

    def compute(n, clock):
        return step_terms(heavy, [T // n] * n, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, clock=clock).compute
    one = compute(1, op_by_op) - compute(1, Clock(op_by_op=True))  # one chunk: reads only
    assert one == pytest.approx(2 * 4e8 * 6e-11)
    assert compute(8, op_by_op) - compute(8, Clock(op_by_op=True)) == pytest.approx(8 * one + 7 * 3 * 4e8 * 6e-11)


def test_streaming_weights_flips_many_chunks_to_few():
    """Many short chunks win while weights cost nothing to read; at 0.1 ns a byte of 400 MB
    each chunk pays 80 ms, and the solver takes fewer."""
    heavy = dataclasses.replace(COST, weight_bytes=4e8)

    def chunks(clock):
        return len(solve(heavy, [NONE, FULL], T, 40 << 20, bandwidth=1e9, clock=clock, **CPU).lengths)
    free, costly = chunks(Clock()), chunks(Clock(weight_read_seconds=1e-10))
    assert free >= 16 and costly < free


def test_the_weight_read_figure_is_measured(monkeypatch):
    from sppo_fx.solver import clock_calibration as cc
    assert cc.weight_read_seconds(0.01) >= 0
    # the figure is the streamed rotation's time over the cached one's, per byte of the
    # rotation, which spans twice the cache (at least 64 MiB of 1 MiB weights)
    monkeypatch.setattr(cc, "best_each", lambda fns, *a, **k: [1.0, 3.0])
    assert cc.weight_read_seconds(0.01, cache_bytes=0) == pytest.approx(2.0 / (64 << 20))
    assert cc.weight_read_seconds(0.01, cache_bytes=48 << 20) == pytest.approx(2.0 / (96 << 20))
    assert cc.last_level_cache_bytes() >= 0
    assert Clock.of(DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, weight_read_seconds=5e-11,
                                  cache_bytes=1 << 25)).weight_read_seconds == 5e-11


def test_a_streamed_skeleton_rereads_its_file_from_the_page_cache():
    """The passes re-read one skeleton file: its re-reads come from the page cache while the
    file fits it, however many bytes they add up to (before: every byte beyond the cache's
    size at the disk's rate, 31 s of a 63 s prediction for small T=4096 at its minimum)."""
    n = 8
    prefix = [1e6 * i for i in range(n)]  # a 7 MB file, 56 MB re-read over two passes

    def exposed(cache_bytes):
        return step_terms(COST, [T // n] * n, [0.0] * n, [0] * n, 1e11, 0.0, 1e9, skeleton_reads=prefix,
                          copies_share_compute=True, cache=(1e10, cache_bytes)).exposed_copy
    assert exposed(32 << 20) == pytest.approx(2 * sum(prefix) / 1e10)  # fits: the cache's rate
    assert exposed(4 << 20) == pytest.approx(2 * sum(prefix) / 1e9)  # does not: the disk's
