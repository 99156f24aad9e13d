"""The K/V skeleton off the device: the skeleton pass, the streamed attention op, the
runtime's KVSkeleton, the store's kept copies, the solver's placement, and exactness."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (SHARES_OFFLOAD_PROGRAMS, RecordedOps, offload_program, one_site_chunk_program, tiny_model,
                      tiny_program)

import sppo_fx
from sppo_fx import InfeasibleBudget, Plan, SppoError
from sppo_fx.chunk_attention.functions import chunk_causal_attention, prefix_causal_attention
from sppo_fx.models import build
from sppo_fx.ops.skeleton import prefix_attention, streamed_prefix_attention
from sppo_fx.ops.offload import active_memory
from sppo_fx.passes.skeleton import stream_kv_skeleton, unstreamable_attention
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.runtime.memory import ChunkMemory
from sppo_fx.runtime.skeleton import KVSkeleton
from sppo_fx.runtime.store import ActivationStore
from sppo_fx.solver.budget import solve
from sppo_fx.solver.memory_model import MemoryModel, predict_peak
from sppo_fx.solver.partition import ChunkCostModel


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


# ---- the pass --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_pass_moves_prefix_and_kv_outputs_to_the_skeleton(kind):
    _, _, program = tiny_program(kind)
    sites = len(program.attention)
    gm = stream_kv_skeleton(program.chunk, sites)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(n.target is prefix_causal_attention for n in calls)
    streamed = [n for n in calls if n.target is streamed_prefix_attention]
    assert [n.kwargs["site"] for n in streamed] == list(range(sites))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    kv = outputs[len(outputs) - 2 * sites:]
    assert [(n.target, n.args[1]) for n in kv] == [(torch.ops.sppo.kv_out.default, s) for s in range(2 * sites)]
    # the signature keeps its shape; the original program is untouched
    placeholders = lambda g: [n.name for n in g.graph.nodes if n.op == "placeholder"]  # noqa: E731
    assert placeholders(gm) == placeholders(program.chunk)
    assert any(n.target is prefix_causal_attention for n in program.chunk.graph.nodes)


def test_pass_refuses_a_site_count_that_disagrees():
    _, _, program = tiny_program("gpt")
    with pytest.raises(SppoError, match="attention sites"):
        stream_kv_skeleton(program.chunk, len(program.attention) + 1)


@pytest.mark.parametrize("variant,named", [("softcap", "soft-capping"), ("alibi", "ALiBi"), ("sinks", "sink")])
def test_pass_refuses_score_variants_the_streamed_op_does_not_compute(variant, named):
    streamable = one_site_chunk_program(scale=0.5, window=16, doc_pos=None)
    assert unstreamable_attention(streamable) is None
    assert stream_kv_skeleton(streamable, 1) is not None
    program = one_site_chunk_program(scale=0.5, **{variant: 5.0})
    assert named in unstreamable_attention(program)
    with pytest.raises(SppoError, match=rf"{named}.*skeleton='keep'"):
        stream_kv_skeleton(program, 1)


# ---- the op ----------------------------------------------------------------------------
class _Blocks:
    """A stand-in for ChunkMemory's skeleton side: fixed blocks, gradients recorded."""

    def __init__(self, ks, vs):
        self.ks, self.vs, self.grads = ks, vs, {}

    def kv_blocks(self, site):
        return list(zip(self.ks, self.vs))

    def kv_add_grad(self, site, j, dk, dv):
        self.grads[j] = (dk, dv)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_streamed_attention_equals_attention_over_the_concatenated_prefix(dtype, tol, heads, kv_heads):
    torch.manual_seed(0)
    b, c, d, lens = 2, 8, 16, [5, 11, 3]
    q = torch.randn(b, heads, c, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, c, d, dtype=dtype, requires_grad=True) for _ in range(2))
    ks = [torch.randn(b, kv_heads, n, d, dtype=dtype, requires_grad=True) for n in lens]
    vs = [torch.randn(b, kv_heads, n, d, dtype=dtype, requires_grad=True) for n in lens]
    dout = torch.randn(b, heads, c, d, dtype=dtype)
    ref = chunk_causal_attention(q, torch.cat([*ks, k], 2), torch.cat([*vs, v], 2), enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, [q, k, v, *ks, *vs], dout)

    memory = _Blocks([t.detach() for t in ks], [t.detach() for t in vs])
    p = sum(lens)
    hk = torch.empty(b, kv_heads, p, d, 0, dtype=dtype, requires_grad=True)
    hv = torch.empty(b, kv_heads, p, d, 0, dtype=dtype, requires_grad=True)
    with active_memory(memory):
        out = streamed_prefix_attention(q, hk, k, hv, v, site=0)
        dq, dk, dv, dhk, dhv = torch.autograd.grad(out, [q, k, v, hk, hv], dout)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for got, want in zip([dq, dk, dv], ref_grads[:3]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for j in range(len(lens)):
        torch.testing.assert_close(memory.grads[j][0], ref_grads[3 + j], rtol=tol, atol=tol)
        torch.testing.assert_close(memory.grads[j][1], ref_grads[3 + len(lens) + j], rtol=tol, atol=tol)
    assert dhk.shape == hk.shape and dhk.numel() == 0


def test_cpu_blocks_run_the_flash_kernels_without_the_ops_dispatch():
    """On a CPU the skeleton's blocks call the kernels the chunk attention op runs there,
    directly (the op's dispatch was half a block's cost), with the op's exact results."""
    from sppo_fx.ops.skeleton import _block_kernels
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g) for h in (4, 2, 2))
    fwd, bwd = _block_kernels(q, k)
    with RecordedOps() as ops:
        out, lse = fwd(q, k, v, 0.25, False)
        grads = bwd(out, q, k, v, out, lse, 0.25, False)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops.names
    assert not [n for n in ops.names if n.startswith("sppo_fx.")]
    want_out, want_lse = torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, 0.25, False)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for got, want in zip(grads, torch.ops.sppo_fx.chunk_attention_bwd(out, q, k, v, out, lse, None, 0.25, False)):
        assert torch.equal(got, want)


def test_streamed_attention_outside_a_chunk_names_the_executor():
    q = torch.randn(1, 2, 4, 8)
    h = torch.empty(1, 2, 0, 8, 0)
    with pytest.raises(SppoError, match="outside a chunk"):
        prefix_attention(q, q, q, h, h, 0, 0.5)


# ---- the runtime's skeleton and the store's kept copies ----------------------------------
def test_store_kept_copy_reads_back_many_times_and_goes_on_release(tmp_path):
    x = torch.randn(64, 33).t()  # a transpose: the layout must come back too
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        h = store.offload(x, keep=True)
        reads = [store.wait(h) for _ in range(3)]
        for r in reads:
            assert torch.equal(r, x) and r.stride() == x.stride()
        assert reads[0].data_ptr() != reads[1].data_ptr()  # fresh tensors, owned by the caller
        assert len(os.listdir(store.dir)) == 1
        store.release(h)
        assert os.listdir(store.dir) == [] and store.bytes_offloaded == 0


@pytest.mark.parametrize("tier", ["disk", "device"])
def test_kv_skeleton_streams_blocks_in_order_and_accumulates_grads(tier, tmp_path):
    with ActivationStore(tier, dir=str(tmp_path)) as store:
        sk = KVSkeleton(store, offload=True, num_chunks=4)
        blocks = {(slot, j): torch.full((1, 2, 3 + j, 4), 10.0 * j + slot) for slot in (0, 1) for j in range(4)}
        for (slot, j), t in blocks.items():
            sk.put(slot, j, t)
        assert (0, 3) not in sk.blocks  # the last chunk's K/V is never a prefix
        stream = sk.stream(0, 3)
        assert len(stream) == 3
        for j, (k_j, v_j) in enumerate(stream):
            assert torch.equal(k_j, blocks[(0, j)]) and torch.equal(v_j, blocks[(1, j)])
        # twice: a kept copy serves forward and backward
        assert len(list(sk.stream(0, 2))) == 2
        sk.add_grad(0, 1, torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))
        sk.add_grad(0, 1, torch.ones(1, 2, 4, 4), torch.full((1, 2, 4, 4), 2.0))
        assert torch.equal(sk.take_grad(1, 1), torch.full((1, 2, 4, 4), 3.0))
        assert sk.take_grad(0, 2) is None
        for j in (3, 2, 1, 0):
            sk.release(j)
        assert not sk.blocks and not sk.grads
        if tier == "disk":
            assert os.listdir(store.dir) == []


def test_memory_without_a_skeleton_says_what_is_missing():
    with pytest.raises(SppoError, match="no skeleton"):
        ChunkMemory().kv_blocks(0)


# ---- exactness ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_offloaded_skeleton_matches_eager(kind, tmp_path):
    model = tiny_model(kind)
    torch.manual_seed(1)
    x, y = torch.randint(0, 97, (2, 96)), torch.randint(0, 97, (2, 96))
    ref = model(x, y)
    ref.backward()
    ref_grads = _grads(model)
    compiled = sppo_fx.compile(model, chunks=4, compile=False, offload="disk", skeleton="offload",
                               offload_dir=str(tmp_path))
    loss = compiled(x, y)
    store = compiled.store
    # the skeleton's blocks are in its one file in the store's dir now (runtime/skeleton_log.py)
    assert any(name.startswith("skeleton_") for name in os.listdir(store.dir))
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # every file's data was released: the files left wait in the pool
    assert store.bytes_offloaded == 0 and len(os.listdir(store.dir)) == store.pooled_files
    assert any(n.target is torch.ops.sppo.kv_out.default
               for n in compiled.graphs["chunk.forward.1"].graph.nodes if n.op == "call_function")


@SHARES_OFFLOAD_PROGRAMS
@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["gpt", "llama"]), cuts=st.sets(st.integers(1, 63), min_size=1, max_size=4),
       quotas=st.lists(st.sampled_from([0, 2**14, None]), min_size=5, max_size=5), seed=st.integers(0, 99))
def test_random_plans_with_the_skeleton_on_disk_are_bitwise_neutral(tmp_path_factory, kind, cuts, quotas, seed):
    """The skeleton (and any share of the activations) on disk gives bitwise the loss and
    gradients of the same chunking with everything on the device."""
    model, cap, program = tiny_program(kind)
    torch.manual_seed(seed)
    x, y = torch.randint(0, 97, (2, 64)), torch.randint(0, 97, (2, 64))
    bounds = [0, *sorted(cuts), 64]
    plan = Plan(64, [b - a for a, b in zip(bounds, bounds[1:])])
    params = [cap.param_value(n) for n in program.params]
    offload = {(0, i): (float("inf") if q is None else q) for i, q in enumerate(quotas[:plan.num_chunks])}
    results = []
    for tier in ("device", "disk"):
        with ActivationStore(tier, dir=str(tmp_path_factory.mktemp("store"))) as store:
            loss = chunked_loss(program, params, [x, y], plan, offload_program(program, "offload"), store=store,
                                offload=offload, min_offload_bytes=0, skeleton="offload")
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
            assert store.bytes_offloaded == 0 and store.bytes_on_device == 0
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


@pytest.mark.slow
def test_offloaded_skeleton_under_inductor_matches_eager(tmp_path):
    model = tiny_model("llama")  # one block: Inductor's cold compile is most of the test
    torch.manual_seed(2)
    x, y = torch.randint(0, 97, (1, 128)), torch.randint(0, 97, (1, 128))
    ref = model(x, y)
    ref.backward()
    ref_grads = _grads(model)
    compiled = sppo_fx.compile(model, chunks=3, offload="disk", skeleton="offload", offload_dir=str(tmp_path))
    loss = compiled(x, y)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    code = "".join(open(p).read() for p in compiled.codegen.generated_code())
    assert "torch.ops.sppo.kv_out.default" in code and "torch.ops.sppo.prefix_attention.default" in code


# ---- API errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"skeleton": "host"}, "skeleton='host'"),
    ({"skeleton": "offload"}, "give offload='disk'"),
    ({"skeleton": "offload", "offload": "disk", "stages": 2}, "pipeline stages"),
])
def test_skeleton_option_errors(kwargs, match):
    with pytest.raises(SppoError, match=match):
        sppo_fx.compile(build("gpt"), **kwargs)


# ---- the solver ------------------------------------------------------------------------------
COST = ChunkCostModel(per_token=1e7, per_pair=1e3)
# a K/V-heavy model: 8 KiB of skeleton and 4 KiB of other saved activations per token
MEM = MemoryModel(level1=lambda c, p: 8192 * c, level2=lambda c, p: 4096 * c, fixed_bytes=1 << 20, sites=4)


def test_offloading_the_skeleton_lowers_the_predicted_peak():
    lengths, ratios = [512] * 8, [1.0] * 7 + [0.0]
    keep = predict_peak(MEM, lengths, ratios, "keep")
    off = predict_peak(MEM, lengths, ratios, "offload")
    skeleton = 8192 * 4096
    # kept: the skeleton buffer and the chunks' own K/V outputs (saved by their graphs too);
    # offloaded: a stream buffer (two blocks of one site) and the last two chunks' own K/V
    # (the current one, and the previous one's prefetched activations) among their saved
    # tensors; the dK/dV accumulators stay in both
    stream, own_kv = 2 * 8192 * 512 // 4, 8192 * 512
    assert keep - off == 2 * skeleton - stream - 2 * own_kv


@pytest.mark.slow
def test_solver_offloads_the_skeleton_only_when_the_budget_requires_it():
    kw = dict(rate=1e12, bandwidth=1e9, skeletons=("keep", "offload"))
    with pytest.raises(InfeasibleBudget) as err:
        solve(COST, MEM, 4096, 1, rate=1e12, bandwidth=1e9)
    keep_min = err.value.minimum_bytes
    roomy = solve(COST, MEM, 4096, keep_min * 2, **kw)
    assert roomy.skeleton == "keep"
    tight = solve(COST, MEM, 4096, int(keep_min * 0.8), **kw)
    assert tight.skeleton == "offload" and tight.peak_bytes <= keep_min * 0.8
    assert tight.step_seconds >= solve(COST, MEM, 4096, keep_min, **kw).step_seconds  # streaming costs time
    with pytest.raises(InfeasibleBudget, match="K/V skeleton: keep, offload") as err2:
        solve(COST, MEM, 4096, 1, **kw)
    assert err2.value.minimum_bytes < keep_min


def test_plan_prints_and_round_trips_the_skeleton():
    plan = Plan(10, [6, 4], offload_ratios=[1.0, 0.0], tier="disk", skeleton="offload")
    assert Plan.from_json(plan.to_json()) == plan
    assert "K/V skeleton offloaded" in plan.table()
