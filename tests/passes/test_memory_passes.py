"""The memory passes: offload / wait nodes and recompute regions in the AOT
forward and backward graphs (sppo_fx.passes.offload), the ops they call
(sppo_fx.ops.offload) and the per-chunk runtime state (sppo_fx.runtime.memory)."""
from __future__ import annotations

import operator
import os
from unittest import mock

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function

import sppo_fx
from sppo_fx.codegen import compile_chunk_program
from sppo_fx.models import build
from sppo_fx.ops.offload import MatmulGrad, active_memory
from sppo_fx.passes.offload import accumulate_param_grads, fuse_grad_matmul, memory_partitioner
from sppo_fx.plan import Plan
from sppo_fx.runtime.local import StageRunner, chunked_loss
from sppo_fx.runtime.memory import ChunkMemory
from sppo_fx.runtime.store import ActivationStore
from sppo_fx.solver.budget import solve
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.partition import ChunkCostModel

from conftest import held_and_reused


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _block(x, w1, w2):
    h = x @ w1                      # saved (matmul output feeds relu's backward)
    a = torch.relu(h)
    out = torch.tanh(a @ w2)        # tanh output is saved for its own backward
    gate = torch.sigmoid(h)         # and so is sigmoid's
    return out.sum() + gate.sum(), a.detach()  # `a` is also a forward output


def _partition(fn, *args, recompute="none", offload=True):
    records = []
    def keep(g, _inputs):
        return make_boxed_func(g.forward)
    compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep,
                            partition_fn=memory_partitioner(recompute, offload, records))
    return compiled, records


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True),
            torch.randn(32, 4, requires_grad=True))


def test_offload_nodes_follow_producers_and_waits_precede_first_use():
    args = _inputs()
    compiled, records = _partition(_block, *args)
    memory = ChunkMemory()
    with active_memory(memory):
        loss, _ = compiled(*args)
        loss.backward()
    (rec,) = records
    fw_nodes = list(rec.forward.graph.nodes)
    offloads = [n for n in fw_nodes if n.target is torch.ops.sppo.offload.default]
    assert offloads and len(offloads) == len(rec.slots)
    for n in offloads:  # right after the saved tensor is produced
        assert fw_nodes[fw_nodes.index(n) - 1] is n.args[0]
    saved = [n.args[0] for n in offloads]
    assert all(s.op == "call_function" for s in saved)  # never a parameter or an input
    # `a` is a forward output, so it lives on anyway: not offloaded
    out = next(n for n in fw_nodes if n.op == "output").args[0]
    assert out[1] not in saved
    bw_nodes = list(rec.backward.graph.nodes)
    waits = [n for n in bw_nodes if n.target is torch.ops.sppo.wait.default]
    assert len(waits) == len(rec.slots)
    # each wait takes the saved handle itself: the reads are the executor's to request
    assert all(w.args[0].op == "placeholder" for w in waits)
    for w in waits:  # immediately before the first user
        assert bw_nodes[bw_nodes.index(w) + 1] is min(w.users, key=bw_nodes.index)
    assert memory.entries == {}  # every slot was consumed by its wait


def test_offloaded_graphs_compute_what_autograd_computes(tmp_path):
    args = _inputs()
    ref_loss, _ = _block(*args)
    ref = torch.autograd.grad(ref_loss, args)
    compiled, records = _partition(_block, *args)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        memory = ChunkMemory(store, min_bytes=0)
        with active_memory(memory):
            loss, _ = compiled(*args)
            assert memory.offloaded_bytes > 0 and memory.kept_bytes == 0
            got = torch.autograd.grad(loss, args)
        assert os.listdir(store.dir) == []
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_quota_keeps_what_does_not_fit(tmp_path):
    args = _inputs()
    compiled, _ = _partition(_block, *args)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        quota = 8 * 32 * 4  # room for the [8, 32] matmul output, not for everything
        memory = ChunkMemory(store, quota=quota, min_bytes=0)
        with active_memory(memory):
            loss, _ = compiled(*args)
        assert 0 < memory.offloaded_bytes <= quota and memory.kept_bytes > 0
        with active_memory(memory):
            loss.backward()


@pytest.mark.parametrize("policy", ["full", "cheap"])
def test_recompute_policies_change_what_is_saved(policy):
    args = _inputs()
    compiled, records = _partition(_block, *args, recompute=policy, offload=False)
    loss, _ = compiled(*args)
    got = torch.autograd.grad(loss, args)
    ref = torch.autograd.grad(_block(*args)[0], args)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got, ref))
    (rec,) = records
    out = next(n for n in rec.forward.graph.nodes if n.op == "output").args[0]
    saved = [n for n in out[2:] if isinstance(n, fx.Node)]
    if policy == "full":
        assert all(n.op == "placeholder" for n in saved), saved
    else:  # only matmul outputs (and inputs) survive; relu / tanh are rebuilt in backward
        assert all(n.op == "placeholder" or "mm" in str(n.target) for n in saved), saved
        assert any("mm" in str(n.target) for n in saved)
    bw_targets = _targets(rec.backward)
    assert any("relu" in t for t in bw_targets)  # recomputed in the backward graph


def test_ops_outside_the_executor_name_it():
    with pytest.raises(sppo_fx.SppoError, match="executor"):
        torch.ops.sppo.offload(torch.ones(3), 0)


def test_wait_restores_the_layout_the_graph_expects():
    class Mem:
        def __init__(self, t):
            self.t = t

        def wait(self, slot):
            return self.t

    t = torch.arange(12.0).reshape(3, 4).t()  # [4, 3], column-major
    handle = torch.empty(4, 3, 0)
    with active_memory(Mem(t.contiguous())):
        out = torch.ops.sppo.wait(handle, 0, [1, 0])  # the graph expects t's layout
    assert out.stride() == t.stride() and torch.equal(out, t)
    with active_memory(Mem(torch.ones(2, 2))):
        with pytest.raises(sppo_fx.SppoError, match="slot 0"):
            torch.ops.sppo.wait(handle, 0, [0, 1])


def test_a_slot_is_consumed_once():
    memory = ChunkMemory()
    memory.offload(torch.ones(4), 0)
    memory.wait(0)
    with pytest.raises(sppo_fx.SppoError, match="retain_graph"):
        memory.wait(0)


def _llama(layers: int = 2):
    torch.manual_seed(0)
    model = build("llama", "tiny", dim=64, ffn_dim=128, n_layers=layers)
    x, y = torch.randint(0, 97, (2, 256)), torch.randint(0, 97, (2, 256))
    return model, x, y


def _eager_reference(model, x, y):
    """Loss and gradients of the unchunked eager model (gradients cleared afterwards)."""
    ref = model(x, y)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return ref.detach(), grads


def _assert_matches(model, loss, ref, ref_grads):
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_offload_nodes_survive_inductor(tmp_path):
    model, x, y = _llama(layers=1)  # one block's kernels: Inductor's cold compile is most of the test
    ref, ref_grads = _eager_reference(model, x, y)
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform
    cap = capture(model, None, None, (x, y), {}, None, 1)
    _, program = transform(cap)
    params = [cap.param_value(n) for n in program.params]
    chunk_fn = compile_chunk_program(program.chunk, offload=True)
    # partition records come from running the memory passes, which an AOTAutograd cache hit
    # (this program compiled by an earlier run of the suite) skips
    with ActivationStore("disk", dir=str(tmp_path)) as store, \
            torch._functorch.config.patch(enable_autograd_cache=False):
        loss = chunked_loss(program, params, [x, y], Plan(256, [96, 80, 80]), chunk_fn, store, min_offload_bytes=0)
        assert store.bytes_offloaded + store.peak_bytes_offloaded > 0
        loss.backward()
        assert os.listdir(store.dir) == []
    _assert_matches(model, loss, ref, ref_grads)
    modules = [open(f).read() for f in chunk_fn.generated_code()]
    forward = [c for c in modules if "torch.ops.sppo.offload.default" in c]
    backward = [c for c in modules if "torch.ops.sppo.wait.default" in c]
    assert forward and backward
    assert chunk_fn.partitions and all(r.slots for r in chunk_fn.partitions)
    # an offloaded buffer is still being copied after its last use: never recycled in
    # forward (codegen/held_buffers.py), while the forward's other buffers and the
    # backward's are; the backward adds weight gradients in GEMMs
    for c in forward:
        held, reused = held_and_reused(c)
        assert held and not held & set(reused)
    assert any("# reuse" in c for c in forward)
    assert any("# reuse" in c for c in backward)
    assert all("torch.ops.sppo.accumulate_grad_mm.default" in c for c in backward)


@pytest.mark.slow
@pytest.mark.parametrize("policy,offload", [("cheap", "disk"), ("full", None)])
def test_recompute_through_the_api_is_exact(policy, offload, tmp_path):
    """Each recompute policy through the API equals eager; with offload, the API's graphs
    show the offload and wait nodes the memory passes inserted, and the executor requested
    each chunk's reads before its backward graph waited for any of them."""
    model, x, y = _llama(layers=1)  # each policy acts per chunk program, whatever its depth
    ref, ref_grads = _eager_reference(model, x, y)
    kwargs = dict(offload=offload, offload_dir=str(tmp_path)) if offload else {}
    compiled = sppo_fx.compile(model, chunks=3, compile=False, recompute=policy, **kwargs)
    requested, waited_unrequested, offloaded = [], [], []
    real_prefetch, real_wait = ChunkMemory.prefetch, ChunkMemory.wait

    def prefetch(memory):
        requested.append(memory)  # the objects themselves: an id may be reused once one is freed
        offloaded.append(memory.offloaded_bytes)
        return real_prefetch(memory)

    def wait(memory, slot=None):
        if not any(m is memory for m in requested):
            waited_unrequested.append(slot)
        return real_wait(memory, slot)

    # without the executor's look-ahead (`StageRunner.prefetch`, one chunk ahead): the
    # request that must precede the backward graph is `StageRunner.backward`'s own
    with mock.patch.object(ChunkMemory, "prefetch", prefetch), mock.patch.object(ChunkMemory, "wait", wait), \
            mock.patch.object(StageRunner, "prefetch", lambda runner, mb, i: None):
        loss = compiled(x, y)
        loss.backward()
    assert not waited_unrequested
    if offload:
        assert sum(offloaded) > 0  # some chunk had reads to request
    _assert_matches(model, loss, ref, ref_grads)
    fw, bw = compiled.graphs["chunk.forward.0"], compiled.graphs["chunk.backward.0"]
    n_saved = len(next(n for n in fw.graph.nodes if n.op == "output").args[0])
    assert n_saved > 0
    if offload:
        assert "torch.ops.sppo.offload.default" in fw.code
        assert "torch.ops.sppo.wait.default" in bw.code


def test_unknown_recompute_policy_is_refused():
    with pytest.raises(sppo_fx.SppoError, match="recompute='some'"):
        sppo_fx.compile(build("gpt"), chunks=2, recompute="some")


def test_solver_recomputes_when_offload_alone_cannot_fit():
    cost = ChunkCostModel(per_token=1e7, per_pair=1e3)

    def model(policy, l2_per_token, rebuilt_per_token, fraction):
        return MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: l2_per_token * c, fixed_bytes=1 << 20,
                           recomputed=(lambda c, p: rebuilt_per_token * c) if rebuilt_per_token else None,
                           recompute=policy, recompute_fraction=fraction)
    models = [model("none", 65536, 0, 0.0), model("full", 0, 65536, 1.0)]
    roomy = solve(cost, models, 2048, 10**12, rate=1e12, bandwidth=1e12)
    assert roomy.recompute == "none"  # recompute costs time: only when memory needs it
    floor_none = None
    try:
        solve(cost, models[:1], 2048, 4 * 2**20, rate=1e12, bandwidth=1e12)
    except sppo_fx.InfeasibleBudget as e:
        floor_none = e.minimum_bytes
    assert floor_none is not None
    tight = solve(cost, models, 2048, floor_none - 1, rate=1e12, bandwidth=1e12)
    assert tight.recompute == "full" and tight.peak_bytes < floor_none


def test_parameter_gradients_accumulate_inside_the_backward_graph():
    args = _inputs()
    records = []

    def keep(g, _inputs):
        return make_boxed_func(g.forward)
    # inputs 1 and 2 (w1, w2) are "parameters" 0 and 1 of the executor
    compiled = aot_function(_block, fw_compiler=keep, bw_compiler=keep,
                            partition_fn=memory_partitioner("none", False, records, {1: 0, 2: 1}))
    got = {}

    class Sink(ChunkMemory):
        def __init__(self):
            super().__init__(grad_sink=lambda i, g: got.__setitem__(
                i, g.materialize() if isinstance(g, MatmulGrad) else g.clone()))
    loss, _ = compiled(*args)
    with active_memory(Sink()):
        gx, gw1, gw2 = torch.autograd.grad(loss, args, allow_unused=True, materialize_grads=True)
    ref = torch.autograd.grad(_block(*args)[0], args)
    assert torch.equal(gx, ref[0])  # not a parameter: returned as usual
    assert not gw1.any() and not gw2.any()  # returned as None: the sink has them
    assert torch.equal(got[0], ref[1]) and torch.equal(got[1], ref[2])
    bw = records[0].backward
    out = next(n for n in bw.graph.nodes if n.op == "output").args[0]
    assert out[1] is None and out[2] is None
    nodes = list(bw.graph.nodes)
    for n in nodes:  # each add right after its gradient is produced
        if n.target is torch.ops.sppo.accumulate_grad.default:
            assert nodes[nodes.index(n) - 1] is n.args[0]
    # both weight gradients are matmuls: folded into their accumulation (fuse_grad_matmul)
    fused = [n for n in nodes if n.target is torch.ops.sppo.accumulate_grad_mm.default]
    assert sorted(n.args[2] for n in fused) == [0, 1]


def test_weight_gradients_fold_into_their_accumulation_op_by_op():
    """Without Inductor (op by op; chunk 0's program) every linear weight's gradient is
    folded too: AOTAutograd's graphs give it as t(t(mm(...))), which fuse_grad_matmul looks
    through (the runtime then adds the product into `.grad` as autograd does, from one
    reused buffer). Exact against eager."""
    model, x, y = _llama(layers=1)
    ref, ref_grads = _eager_reference(model, x, y)
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform
    cap = capture(model, None, None, (x, y), {}, None, 1)
    _, program = transform(cap)
    params = [cap.param_value(n) for n in program.params]
    chunk_fn = compile_chunk_program(program.chunk, backend="eager", offload=False, recompute="cheap")
    with torch._functorch.config.patch(enable_autograd_cache=False):
        loss = chunked_loss(program, params, [x, y], Plan(256, [96, 80, 80]), chunk_fn)
        loss.backward()
    _assert_matches(model, loss, ref, ref_grads)
    linears = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    for record in chunk_fn.partitions:
        nodes = list(record.backward.graph.nodes)
        fused = [n for n in nodes if n.target is torch.ops.sppo.accumulate_grad_mm.default]
        assert len(fused) == linears, record.backward.code


def _grad_graph(transposes: int, extra_user: bool = False) -> fx.GraphModule:
    """A hand-built backward tail: gw = mm(a, b) under `transposes` 2-D transposes (permute
    [1, 0], then t, alternating) into accumulate_grad."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(3, 5), torch.empty(5, 4)
    mm = g.call_function(torch.ops.aten.mm.default, (a, b))
    gw = mm
    for k in range(transposes):
        gw = (g.call_function(torch.ops.aten.permute.default, (gw, [1, 0])) if k % 2 == 0
              else g.call_function(torch.ops.aten.t.default, (gw,)))
    g.call_function(torch.ops.sppo.accumulate_grad.default, (gw, 7))
    g.output((mm,) if extra_user else (None,))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("transposes", [0, 1, 2, 3])
def test_fuse_grad_matmul_folds_the_matmul_into_the_accumulation(transposes):
    """Also under a chain of transposes: AOTAutograd's graphs without Inductor (op by op,
    and chunk 0's program) give a linear layer's weight gradient as t(t(mm(...)))."""
    transposed = transposes % 2 == 1
    gm = fuse_grad_matmul(_grad_graph(transposes))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default not in targets and torch.ops.sppo.accumulate_grad.default not in targets
    # what is left: the operands' transposes of an odd chain, nothing of an even one
    assert len(targets) == (3 if transposed else 1)
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.sppo.accumulate_grad_mm.default)
    assert fused.args[2] == 7
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    got = {}

    class Sink(ChunkMemory):
        def __init__(self):
            super().__init__(grad_sink=lambda i, g: got.__setitem__(i, g))
    with active_memory(Sink()):
        gm(a, b)
    want = (a @ b).t() if transposed else a @ b
    assert isinstance(got[7], MatmulGrad)
    assert torch.allclose(got[7].materialize(), want)


def test_fuse_grad_matmul_leaves_a_matmul_with_other_users():
    gm = fuse_grad_matmul(_grad_graph(0, extra_user=True))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.mm.default, torch.ops.sppo.accumulate_grad.default]


def _param_grad_graph(kind: str) -> fx.GraphModule:
    """A backward graph whose output 0 is parameter 0's gradient: `kind` "tangent" (the
    tangent itself), "view of tangent" (its transpose), "returned" (a transpose of a matmul
    the graph also returns), "fresh" (t(t(mm)), nothing else)."""
    g = fx.Graph()
    a, b, tangent = g.placeholder("a"), g.placeholder("b"), g.placeholder("tangent")
    aten = torch.ops.aten
    mm = g.call_function(aten.mm.default, (a, b))
    extra = None
    if kind == "tangent":
        grad = tangent
    elif kind == "view of tangent":
        grad = g.call_function(aten.t.default, (tangent,))
    elif kind == "unsafe view of tangent":
        grad = g.call_function(aten._unsafe_view.default, (tangent, [4, 3]))
    elif kind == "piece of a split tangent":
        grad = g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (tangent, 2)), 0))
    elif kind == "read back":  # a saved tensor's read-back buffer (the store may recycle it)
        import sppo_fx.ops.offload  # noqa: F401 - registers torch.ops.sppo.*
        grad = g.call_function(torch.ops.sppo.wait.default, (tangent, 0, [0, 1]))
    elif kind == "returned":
        grad, extra = g.call_function(aten.t.default, (mm,)), mm
    else:
        grad = g.call_function(aten.t.default, (g.call_function(aten.t.default, (mm,)),))
    g.output((grad, extra))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("kind,cloned", [("tangent", True), ("view of tangent", True), ("returned", True),
                                         ("unsafe view of tangent", True), ("piece of a split tangent", True),
                                         ("read back", True), ("fresh", False)])
def test_a_gradient_sharing_its_callers_memory_is_cloned_before_its_accumulation(kind, cloned):
    """Op by op the runtime takes a parameter's first gradient over as `.grad` and adds the
    next chunks' into it (`runtime.memory.adopted_grad`): a graph input (a tangent, a saved
    tensor a read buffer may be recycled into) or memory the graph returns must reach it as
    a copy, or that add would write into its caller's tensor."""
    gm = accumulate_param_grads(_param_grad_graph(kind), {0: 0})
    acc = next(n for n in gm.graph.nodes if n.target is torch.ops.sppo.accumulate_grad.default)
    assert (acc.args[0].target is torch.ops.aten.clone.default) == cloned, gm.code
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0] is None  # the gradient left the outputs


def _sink_only_runner(leaf, op_by_op: bool):
    from sppo_fx.runtime.local import StageRunner
    from sppo_fx.runtime.memory import ProductBuffer
    runner = StageRunner.__new__(StageRunner)  # only the sink's state is needed
    runner.params, runner._op_by_op, runner._adopted, runner._products = [leaf], op_by_op, {}, ProductBuffer()
    return runner


def test_executor_adds_a_matmul_gradient_with_addmm():
    """StageRunner's sink, compiled: the first MatmulGrad becomes .grad, later ones add into it."""
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    leaf = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    runner = _sink_only_runner(leaf, op_by_op=False)
    runner._accumulate_grad(0, MatmulGrad(a, b))
    first = leaf.grad
    assert torch.equal(first, a @ b)
    runner._accumulate_grad(0, MatmulGrad(a, 2 * b))
    assert leaf.grad is first  # in place
    assert torch.allclose(leaf.grad, 3 * (a @ b))
    runner._accumulate_grad(0, a @ b)  # a plain gradient still adds
    assert torch.allclose(leaf.grad, 4 * (a @ b))
    assert runner._products.storage is None  # compiled: added inside the GEMM


def test_executor_op_by_op_adds_a_matmul_gradient_as_autograd_does():
    """Op by op: the product, then add_ (autograd's arithmetic, bit for bit), the product
    in one reused buffer rather than a fresh tensor per chunk."""
    a, b, c = (torch.randn(*s) for s in ((64, 48), (48, 32), (48, 32)))
    leaf = torch.zeros(64, 32, requires_grad=True)
    runner = _sink_only_runner(leaf, op_by_op=True)
    runner._accumulate_grad(0, MatmulGrad(a, b))
    first = leaf.grad
    runner._accumulate_grad(0, MatmulGrad(a, c))
    assert leaf.grad is first
    expected = torch.mm(a, b)
    expected += torch.mm(a, c)  # autograd's AccumulateGrad: grad += new
    assert torch.equal(leaf.grad, expected)
    buffer = runner._products.storage
    assert buffer is not None and buffer.nbytes() == 64 * 32 * 4
    runner._accumulate_grad(0, MatmulGrad(a, b))
    assert runner._products.storage is buffer  # reused, not allocated again
    runner._products.release()
    assert runner._products.storage is None


@pytest.mark.parametrize("policy", ["cheap", "full"])
def test_recompute_never_repeats_an_all_to_all(policy):
    """A sequence-parallel all-to-all is saved, not recomputed: a repeated one doubles the
    traffic and would sit outside the token chain that orders the ranks' collectives."""
    import operator

    import torch.fx as fx
    from torch.utils.checkpoint import CheckpointPolicy

    import sppo_fx.ops.seq_parallel  # noqa: F401 - registers torch.ops.sppo.*
    from sppo_fx.passes.offload import tag_recompute
    g = fx.Graph()
    x = g.placeholder("x")
    g.placeholder("tangents_1")
    moved = g.call_function(torch.ops.sppo.seq_to_heads.default, (x, None, 8, 2, "sp"))
    out, token = (g.call_function(operator.getitem, (moved, i)) for i in range(2))
    act = g.call_function(torch.ops.aten.relu.default, (out,))
    g.output((act, token))
    tag_recompute(fx.GraphModule(torch.nn.Module(), g), policy)
    assert all(n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE for n in (out, token))
    assert "recompute" not in moved.meta
    assert act.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
