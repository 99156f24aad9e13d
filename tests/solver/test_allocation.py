"""The clock's allocation term (`solver.allocation`, `Clock.allocation_seconds`): the
allocations a captured graph's chunk makes, their price by size as measured in this process,
and the plans the term makes the solver choose."""
import os
import subprocess
import sys

import pytest
import torch

from sppo_fx.solver.allocation import PROBE_SIZES, allocated_seconds
from sppo_fx.solver.budget import solve, step_terms
from sppo_fx.solver.calibration import allocation_prices
from sppo_fx.solver.clock import Clock
from sppo_fx.solver.clock import allocation_price as price
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.partition import Allocation, ChunkCostModel, cost_model_from_graph
from sppo_fx.solver.profiles import DeviceProfile
from tests.solver.test_clock_terms import _exported

KiB, MiB = 1 << 10, 1 << 20
# free below 64 KiB (the heap's own blocks), 1 ns a byte from 1 MiB (fresh pages)
TABLE = ((64 * KiB, 0.0), (MiB, 1e-9), (16 * MiB, 1e-9))


def test_the_price_of_a_size_is_interpolated_in_log_size_and_held_beyond():
    assert price(TABLE, 16 * KiB) == 0.0 and price(TABLE, 64 * MiB) == 1e-9
    assert price(TABLE, 256 * KiB) == pytest.approx(0.5e-9)  # halfway from 64 KiB to 1 MiB in log size
    assert price((), MiB) == 0.0 and price(TABLE, 0) == 0.0


def test_a_chunk_pays_each_allocation_at_its_size():
    cost = ChunkCostModel(1e7, 1e3, allocations=(
        Allocation(per_token=4 * KiB, count=3),                         # forward outputs
        Allocation(per_token=4 * KiB, count=2, backward=True),          # their gradients
        Allocation(per_token=0.0, fixed=4 * MiB, backward=True, matmul=True)))  # a weight's gradient
    op_by_op = Clock(allocation_by_size=TABLE, op_by_op=True)
    # 256 tokens: 1 MiB activations at 1 ns a byte, and the 4 MiB weight gradient
    assert op_by_op.allocation_seconds(cost, 256) == pytest.approx((5 * MiB + 4 * MiB) * 1e-9)
    assert op_by_op.allocation_seconds(cost, 256, forward_only=True) == pytest.approx(3 * MiB * 1e-9)
    # a recompute allocates the forward's outputs again; gradients once
    assert op_by_op.allocation_seconds(cost, 256, recompute_fraction=1.0) == pytest.approx(12 * MiB * 1e-9)
    # 16 tokens: 64 KiB activations cost nothing, the weight's gradient the same
    assert op_by_op.allocation_seconds(cost, 16) == pytest.approx(4 * MiB * 1e-9)
    # compiled programs allocate the matmuls' tensors only; no table, no term
    assert Clock(allocation_by_size=TABLE).allocation_seconds(cost, 256) == pytest.approx(4 * MiB * 1e-9)
    assert Clock(op_by_op=True).allocation_seconds(cost, 256) == 0.0


def test_the_step_counts_the_traced_partitions_allocations_where_the_memory_model_has_them():
    from types import SimpleNamespace
    from sppo_fx.solver.budget import with_traced_allocations
    captured = ChunkCostModel(1e7, 1e3, allocations=(Allocation(per_token=4 * KiB, count=2),
                                                     Allocation(per_token=4 * KiB, backward=True)))
    # the partition's graphs: the forward's two outputs, and a backward that holds the
    # recomputed one again and three gradients (derivatives' intermediates included)
    traced = (Allocation(per_token=4 * KiB, count=2), Allocation(per_token=4 * KiB, count=4, backward=True))
    clock = Clock(allocation_by_size=TABLE, op_by_op=True)

    def allocation(cost, recompute_fraction):
        return step_terms(cost, [256], [0.0], [0], 1e12, 0.0, float("inf"), recompute_fraction,
                          clock=clock).allocation
    # 256 tokens: 1 MiB a tensor at 1 ns a byte
    assert allocation(captured, 0.5) == pytest.approx((2 * 1.5 + 1) * MiB * 1e-9)  # the forward again, half
    mine = with_traced_allocations(captured, SimpleNamespace(allocations=traced))
    assert mine.allocations == traced and mine.per_token == captured.per_token
    assert allocation(mine, 0.5) == pytest.approx(6 * MiB * 1e-9)  # the backward has the recompute
    assert clock.allocation_seconds(mine, 256, recompute_fraction=0.5) == pytest.approx(6 * MiB * 1e-9)
    assert with_traced_allocations(captured, SimpleNamespace(allocations=())) is captured


def test_the_step_has_an_allocation_term_and_the_profile_carries_its_table():
    prof = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, n_half=0.0, allocation_by_size=TABLE)
    cost = ChunkCostModel(1e7, 1e3, allocations=(Allocation(per_token=4 * KiB, count=10),))
    terms = step_terms(cost, [1024] * 4, [0.0] * 4, [0] * 4, 1e11, 0.0, 1e9, clock=Clock.of(prof, compiled=False))
    assert terms.allocation == pytest.approx(4 * 10 * 4 * MiB * 1e-9)
    assert terms.total == pytest.approx(terms.compute + terms.attention + terms.allocation)
    assert "allocation" in terms.describe()
    assert Clock.of(prof, compiled=True).allocation_seconds(cost, 1024) == 0.0  # no matmul among them
    assert DeviceProfile.from_json(prof.to_json()) == prof and "allocation" in prof.table()
    old = {k: v for k, v in prof.to_dict().items() if k != "allocation_by_size"}  # a profile stored before
    assert DeviceProfile.from_dict(old).allocation_by_size == ()
    with pytest.raises(Exception, match="allocation_by_size"):
        DeviceProfile.from_dict(dict(prof.to_dict(), allocation_by_size=((MiB, -1.0),)))


def test_weight_gradients_are_allocated_once_a_step_where_the_gemm_adds_them():
    """The memory passes' programs fold a chunk's weight gradients into their accumulation
    (`fuse_grad_matmul`: inside the GEMM compiled, through one reused product buffer op by
    op with a tier): only the backward's first chunk (the last one) allocates them. Op by
    op without a tier, autograd's plain chunk program allocates them in every chunk."""
    prof = DeviceProfile("x", 1e11, 1e9, 1e9, 1e8, 1e8, 1 << 30, n_half=0.0, allocation_by_size=TABLE)
    weight = Allocation(per_token=0.0, fixed=4 * MiB, backward=True, matmul=True)
    cost = ChunkCostModel(1e7, 1e3, allocations=(weight, Allocation(per_token=4 * KiB, backward=True, matmul=True)))
    args = (cost, [1024] * 4, [0.0] * 4, [0] * 4, 1e11, 0.0, 1e9)
    activations = 4 * 4 * MiB * 1e-9  # 4 chunks of 1024 tokens x 4 KiB, every time
    compiled = Clock.of(prof, compiled=True)
    assert not compiled.op_by_op
    assert step_terms(*args, clock=compiled).allocation == pytest.approx(activations + 4 * MiB * 1e-9)
    for tier in ("disk", "host"):
        op_by_op = Clock.of(prof, compiled=False, tier=tier)
        assert op_by_op.op_by_op and not op_by_op.weight_grads_every_chunk
        assert step_terms(*args, clock=op_by_op).allocation == pytest.approx(activations + 4 * MiB * 1e-9)
    plain = Clock.of(prof, compiled=False, tier=None)
    assert step_terms(*args, clock=plain).allocation == pytest.approx(activations + 4 * 4 * MiB * 1e-9)
    # a recompute policy without a tier runs the memory passes' graphs: once a step again
    recomputed = Clock.of(prof, compiled=False, tier=None, recompute="full")
    assert step_terms(*args, clock=recomputed).allocation == pytest.approx(activations + 4 * MiB * 1e-9)


def test_the_price_of_large_blocks_flips_few_chunks_to_many():
    """Per-chunk fixed costs make few long chunks faster; where fresh large blocks cost 1 ns
    a byte and blocks of 64 KiB nothing, many short chunks are."""
    cost = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=50, allocations=(Allocation(per_token=4 * KiB, count=40),))
    mem = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 2048 * c, fixed_bytes=1 << 20, sites=2)
    kw = dict(rate=1e11, c_half=0.0, bandwidth=1e9, copies_share_compute=True)
    free = solve(cost, mem, 4096, 1 << 30, clock=Clock(op_seconds=1e-5, op_by_op=True), **kw)
    clock = Clock(op_seconds=1e-5, allocation_by_size=TABLE, op_by_op=True)
    priced = solve(cost, mem, 4096, 1 << 30, clock=clock, **kw)
    assert len(free.lengths) == 1 and len(priced.lengths) >= 64
    assert priced.terms.allocation < clock.allocation_seconds(cost, 4096) / 3  # the one chunk's


def test_a_captured_graph_lists_its_allocations():
    # x -> linear (16 -> 16) -> h * 2.0 -> silu, fp32 [2, T, 16]: 128 bytes a token each
    cost = cost_model_from_graph(*_exported(lambda h: torch.nn.functional.silu(h * 2.0)))
    forward = [a for a in cost.allocations if not a.backward]
    backward = [a for a in cost.allocations if a.backward]
    # the linear's, the mul's and the silu's outputs
    assert sum(a.count for a in forward) == 3 and all(a.per_token == 128 and not a.fixed for a in forward)
    assert sum(a.count for a in forward if a.matmul) == 1
    # backward: gradients of the mul's and the silu's inputs, and of the linear's weight
    # and bias (the input x needs none)
    assert sorted((a.per_token, a.fixed, a.count) for a in backward) == [(0.0, 64.0, 1.0), (0.0, 1024.0, 1.0),
                                                                      (128.0, 0.0, 2.0)]
    assert cost.scaled(0.5).allocations[0].count == cost.allocations[0].count / 2


def test_what_a_probe_allocates_is_counted_once_per_fresh_tensor():
    table = ((4 * KiB, 1e-9),)
    x = torch.ones(1024)  # 4 KiB

    def fn():
        y = x * 2.0          # fresh: 4 KiB
        y.add_(1.0)          # in place: nothing
        y.view(32, 32)       # a view: nothing
        torch.cat([y, y])    # fresh: 8 KiB
    assert allocated_seconds(fn, table) == pytest.approx(12 * KiB * 1e-9)


def test_fresh_blocks_are_priced_where_the_allocator_maps_them():
    # glibc's mmap threshold fixed at 128 KiB (the benchmark workers' setting): every block
    # of 1 MiB and more is fresh pages, which the kernel faults in (and zeroes) as they are
    # written. Zeroing alone is at least 0.02 ns a byte on any machine.
    code = ("import torch; from sppo_fx.solver.calibration import allocation_prices as f; "
            "print(dict(f(torch.device('cpu'), 0.2))[4 << 20])")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[-1]) > 0.02e-9
    here = allocation_prices(torch.device("cpu"), 0.05)
    assert [n for n, _ in here] == list(PROBE_SIZES) and all(s >= 0 for _, s in here)
    assert allocation_prices(torch.device("meta")) == ()


def test_blocks_the_heap_kept_from_earlier_steps_do_not_price_fresh_pages_at_zero():
    # eager steps of the tiny Llama at 1024 tokens leave free blocks inside glibc's heap
    # that served a lone 256 KiB probe from resident pages (0.003 ns a byte, against 0.35
    # in a fresh process; in about half the processes); a step's many such blocks get fresh
    # pages all the same. Three rounds of two steps and a calibration, every one priced.
    code = ("import torch; from sppo_fx.models import build; "
            "from sppo_fx.solver.calibration import allocation_prices as f; "
            "torch.manual_seed(0); m = build('llama', 'tiny'); "
            "x = torch.randint(0, m.config.vocab_size, (1, 1024)); "
            "loss = lambda out: out if torch.is_tensor(out) else out[0]; "
            "step = lambda: [loss(m(x, x)).backward() for _ in range(2)]; "
            "print(min([step(), dict(f(torch.device('cpu'), 0.2))[256 << 10]][1] for _ in range(3)))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[-1]) > 0.02e-9


def test_the_elementwise_probe_leaves_its_own_allocations_out(monkeypatch):
    from sppo_fx.solver import allocation, clock_calibration as cc
    monkeypatch.setattr(cc, "_best", lambda *a, **kw: 1.0)
    monkeypatch.setattr(allocation, "allocated_seconds", lambda fn, table: 0.25)
    with_all = cc.elementwise_bytes_per_s(torch.device("cpu"), tokens=64, width=64)
    without = cc.elementwise_bytes_per_s(torch.device("cpu"), tokens=64, width=64, allocation=TABLE)
    assert without == pytest.approx(with_all / 0.75)  # 1 s timed, a quarter of it allocating
