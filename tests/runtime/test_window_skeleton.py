"""skeleton="offload" for sliding-window sites: the streamed attention reads only the
blocks that reach into a chunk's window, a block stores only the rows later windows read,
expired blocks go, and the memory model and budget solver count that bounded skeleton."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx.chunk_attention.functions import windowed_causal_attention
from sppo_fx.ops.offload import active_memory
from sppo_fx.ops.skeleton import streamed_prefix_attention
from sppo_fx.runtime.memory import ChunkMemory
from sppo_fx.runtime.skeleton import KVSkeleton

from conftest import assert_matches_eager, record_skeleton_traffic


def _bounds(lengths):
    return [(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(len(lengths))]


def _streamed(q, k, v, lengths, window, backward=True, kv_out_first=False):
    """Windowed attention chunk by chunk through `KVSkeleton` and the streamed op, as the
    runtime runs it (forward of every chunk, then backward in reverse). Returns the
    output, the gradients of q, k, v (dout = ones), the bytes each chunk's forward read,
    and the skeleton. `kv_out_first`: the chunk's K/V reach the skeleton before its
    attention runs (Inductor may order the two ops so)."""
    b, h_kv, _, d = k.shape
    bounds = _bounds(lengths)
    sk = KVSkeleton(None, num_chunks=len(lengths), bounds=bounds, windows=[window], backward=backward)
    outs, saved, reads = [], [], []
    for i, (s, e) in enumerate(bounds):
        qi, ki, vi = (t[..., s:e, :].detach().requires_grad_() for t in (q, k, v))
        hk, hv = (torch.empty(b, h_kv, s, d, 0, dtype=q.dtype, requires_grad=True) for _ in range(2))
        before = sk.bytes_read
        if kv_out_first:
            sk.put(0, i, ki.detach())
            sk.put(1, i, vi.detach())
        with active_memory(ChunkMemory(skeleton=sk, chunk=i)), torch.set_grad_enabled(backward):
            out = streamed_prefix_attention(qi, hk, ki, hv, vi, site=0, window=window)
        reads.append(sk.bytes_read - before)
        if not kv_out_first:
            sk.put(0, i, ki.detach())
            sk.put(1, i, vi.detach())
        sk.end_forward(i)  # the executor, once the chunk program has returned
        outs.append(out)
        saved.append((qi, ki, vi, out))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    if backward:
        for i in range(len(bounds) - 1, -1, -1):
            s, e = bounds[i]
            qi, ki, vi, out = saved[i]
            with active_memory(ChunkMemory(skeleton=sk, chunk=i)):
                dq, dk, dv = torch.autograd.grad(out, (qi, ki, vi), torch.ones_like(out))
            for g, part, slot in ((grads[0], dq, None), (grads[1], dk, 0), (grads[2], dv, 1)):
                extra = sk.take_grad(slot, i) if slot is not None else None
                g[..., s:e, :] = part + (extra if extra is not None else 0)
            sk.release(i)
            assert (0, i - 1) not in sk.blocks  # chunk i was the last backward reader of chunk i-1
    return torch.cat(outs, -2), grads, reads, sk


@pytest.mark.parametrize("window,lengths", [
    (8, [8, 8, 8, 8]),            # chunks of W: each reads the previous chunk's last W-1 rows
    (8, [3, 3, 3, 3, 3, 3]),      # shorter than W: the window reaches several blocks, cutting one
    (5, [12, 12, 9]),             # longer than W: the window cuts the chunk's own causal square
    (6, [5, 20, 3, 1, 4]),        # mixed, with a one-token chunk
    (1, [4, 4, 4]),               # W = 1: no block is stored or read
])
def test_streamed_window_attention_equals_windowed_attention_with_reads_bounded_by_w(window, lengths):
    torch.manual_seed(0)
    t, b, h, h_kv, d = sum(lengths), 2, 4, 2, 8
    q = torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h_kv, t, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref = windowed_causal_attention(q, k, v, window, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    out, grads, reads, sk = _streamed(q, k, v, lengths, window)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    row = b * h_kv * d * 8  # bytes of one K (or V) position, float64
    assert max(reads) <= 2 * 2 * max(window - 1, 0) * row  # K and V, at most 2(W-1) rows each
    assert sk.peak_bytes_held <= 2 * sum(min(n, window - 1) for n in lengths[:-1]) * row
    assert not sk.blocks and not sk.grads


@pytest.mark.parametrize("kv_out_first", [False, True], ids=["attention-first", "kv_out-first"])
def test_streamed_window_blocks_go_after_their_last_reader_without_a_backward(kv_out_first):
    """Evaluation (no backward): the skeleton held is bounded by the window at T = 4W and
    16W alike, while every chunk's output stays exact, whichever order the chunk program
    runs its kv_out and its attention in (blocks expire when the program has returned;
    expiring them at kv_out failed under Inductor with torch.no_grad)."""
    window, peaks = 8, []
    for t in (32, 128):
        q = torch.randn(1, 2, t, 8, dtype=torch.float64)
        k, v = torch.randn(1, 2, t, 8, dtype=torch.float64), torch.randn(1, 2, t, 8, dtype=torch.float64)
        out, _, _, sk = _streamed(q, k, v, [4] * (t // 4), window, backward=False, kv_out_first=kv_out_first)
        torch.testing.assert_close(out, windowed_causal_attention(q, k, v, window))
        peaks.append(sk.peak_bytes_held)
    # K and V of three chunks of 4 (the window reaches two back, and the running chunk's
    # block is stored before the oldest expires): 24 rows of [1, 2, 8] float64
    assert peaks[0] == peaks[1] == 2 * 3 * 4 * (2 * 8 * 8)


# ---------------------------------------------------------------- through the executor

class WindowLM(nn.Module):
    """One attention layer with a sliding window written as an SDPA mask (the HF families'
    windows are covered by tests/passes/test_sliding_window.py; this model captures in seconds)."""

    def __init__(self, window, dim=32, heads=4):
        super().__init__()
        self.emb, self.head = nn.Embedding(101, dim), nn.Linear(dim, 101)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.window, self.heads = window, heads

    def forward(self, ids, targets):
        x = self.emb(ids)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        i = torch.arange(t, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


# the tests that use `offloaded_window` run on one xdist worker (--dist loadgroup): it is built once
ON_ONE_WORKER = pytest.mark.xdist_group("offloaded_window")


@pytest.fixture(scope="module")
def offloaded_window(tmp_path_factory):
    """A 1-layer model (W = 8) compiled once with its skeleton offloaded to disk."""
    torch.manual_seed(0)
    model = WindowLM(window=8)
    compiled = sppo_fx.compile(model, chunk_lengths=[8] * 4, compile=False, offload="disk", skeleton="offload",
                               offload_dir=str(tmp_path_factory.mktemp("store")))
    ids = torch.randint(0, 101, (2, 32))
    compiled(ids, ids).backward()  # captures the model
    model.zero_grad(set_to_none=True)
    return model, compiled


def _run(model, compiled, lengths, monkeypatch):
    """One exact training step with these chunks; returns the bytes each chunk's forward
    read back from the skeleton and the skeleton's peak stored bytes."""
    reads, peaks = record_skeleton_traffic(monkeypatch)
    compiled.options.chunk_lengths = lengths
    ids = torch.randint(0, 101, (2, sum(lengths)))
    assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))
    monkeypatch.undo()
    assert [s.window for s in compiled.program.attention] == [8]
    assert [int(x) for x in (compiled.program.attention[0].k_shape[1], compiled.program.attention[0].k_shape[3])] == [4, 8]
    assert compiled.store.bytes_offloaded == 0  # every block went at the end of the step
    return reads, peaks[0]


ROW = 2 * 4 * 8 * 4  # one K (or V) position: batch 2, 4 heads, head dim 8, float32


@ON_ONE_WORKER
@pytest.mark.parametrize("lengths", [[4] * 8, [12, 12, 8], [5, 20, 3, 4]])
def test_offloaded_window_skeleton_matches_eager(offloaded_window, lengths, monkeypatch):
    """Chunks shorter than, longer than and mixed around W = 8: exact, and every chunk
    reads at most 2(W-1) rows of K and of V."""
    reads, peak = _run(*offloaded_window, lengths, monkeypatch)
    assert reads[0] == 0 and 0 < max(reads) <= 2 * 2 * 7 * ROW
    assert peak == 2 * sum(min(n, 7) for n in lengths[:-1]) * ROW  # only the rows later windows read


@ON_ONE_WORKER
def test_offloaded_window_reads_per_chunk_do_not_grow_with_the_sequence(offloaded_window, monkeypatch):
    """T = 4W and 16W with chunks of W: each chunk reads the previous chunk's last W-1
    rows of K and V, at both lengths (a causal skeleton's reads grow with the prefix)."""
    short, _ = _run(*offloaded_window, [8] * 4, monkeypatch)
    long, peak = _run(*offloaded_window, [8] * 16, monkeypatch)
    assert short == [0] + [2 * 7 * ROW] * 3 and long == [0] + [2 * 7 * ROW] * 15
    assert peak == 15 * 2 * 7 * ROW < 2 * 128 * ROW  # stored: 7 of every chunk's 8 rows


@ON_ONE_WORKER
def test_budget_solver_offloads_a_windowed_skeleton_when_the_budget_requires_it(offloaded_window):
    """Below the least budget any plan with the skeleton kept needs, the solver streams the
    windowed skeleton (its reads counted over the window's blocks only) and the step is exact."""
    from sppo_fx.errors import InfeasibleBudget
    from sppo_fx.solver.budget import solve
    from sppo_fx.solver.memory_model import memory_models, streamed_skeleton
    model, compiled = offloaded_window
    entry = compiled._require_entry()
    params = [entry.captured.param_value(n) for n in entry.program.params]
    (memory,) = memory_models(entry.program, entry.captured.seq, params, ("none",))
    _, reads, _ = streamed_skeleton(memory, [8] * 8)
    row_bytes = memory.level1(1, 0)  # K and V of one position
    assert reads == [0] + [7 * row_bytes] * 7  # the previous chunk's last W-1 rows, not the whole prefix
    # as the API solves on a CPU (its copies share the compute's cores), over its chunk counts
    kw = dict(rate=1e9, bandwidth=1e9, copies_share_compute=True)

    def least(t, skeletons):
        """The least budget any plan fits (found by bisection: the solver's own reported
        minimum assumes every chunk offloaded, not always the least peak)."""
        lo, hi = 1, 1 << 26
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                solve(entry.cost, memory, t, mid, skeletons=skeletons, **kw)
                hi = mid
            except InfeasibleBudget:
                lo = mid + 1
        return lo
    # streamed, the windowed skeleton's reads and dK/dV are bounded by W: the least budget
    # does not grow with T, while a kept skeleton's (each chunk's own K/V) does
    assert least(128, ("offload",)) == least(512, ("offload",))
    assert least(512, ("keep",)) > least(128, ("keep",)) > least(128, ("offload",))
    t = 128
    budget = least(t, ("keep",)) - 1
    assert solve(entry.cost, memory, t, budget, skeletons=("keep", "offload"), **kw).skeleton == "offload"

    # the same compiled model, now under the budget with the skeleton left to the solver
    # (its memory model is the one above: no second trace)
    entry.memory["none"] = memory
    o = compiled.options
    saved = (o.chunk_lengths, o.budget, o.recompute, o.skeleton)
    o.chunk_lengths, o.budget, o.recompute, o.skeleton = None, budget, "none", "auto"
    try:
        ids = torch.randint(0, 101, (2, t))
        assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))
        plan = compiled.plan
    finally:
        o.chunk_lengths, o.budget, o.recompute, o.skeleton = saved
    assert plan.skeleton == "offload" and plan.peak_bytes <= budget


@pytest.mark.slow
def test_offloaded_window_skeleton_compiled_by_inductor(tmp_path, monkeypatch):
    """The streamed windowed skeleton with Inductor's chunk programs, which may run a chunk's
    `kv_out` before its attention: a training step is exact, an evaluation under no_grad
    gives eager's loss, and each chunk reads only the previous chunk's last W-1 rows."""
    torch.manual_seed(0)
    model = WindowLM(window=8)
    compiled = sppo_fx.compile(model, chunk_lengths=[8] * 4, compile=True, offload="disk", skeleton="offload",
                               offload_dir=str(tmp_path))
    ids = torch.randint(0, 101, (2, 32))
    reads, peaks = record_skeleton_traffic(monkeypatch)
    assert_matches_eager(model, lambda m: m(ids, ids), lambda: compiled(ids, ids))
    assert reads == [0] + [2 * 7 * ROW] * 3 and peaks == [3 * 2 * 7 * ROW]
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, ids), model(ids, ids))
    codegen = compiled.codegen
    assert codegen.backend == "inductor" and codegen.stats.compiles >= 1 and codegen.generated_code()
    assert compiled.store.bytes_offloaded == 0  # every block went at the end of each call
