"""The flash split chunk attention (sppo_fx/chunk_attention/kernels/flash_split.py): the prefix and the
causal square as two flash calls merged by log-sum-exp, never a concatenation.

The merge and backward run here on ATen's CPU flash kernels (the same autograd.Function,
other kernels); the CUDA kernels run on fake CUDA tensors (their meta kernels), which is
enough to check routing, shapes and what the function saves for backward."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import RecordedOps
from sppo_fx.util import compat as _compat
from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.chunk_attention.kernels import flash_split
from sppo_fx.chunk_attention.kernels.flash_split import (cuda_environment_reason, flash_split_attention,
                                                         flash_split_supported)


def _reference(q, k_prefix, k, v_prefix, v, scale=None):
    groups = q.shape[1] // k.shape[1]
    k_all = torch.cat([k_prefix, k], -2).repeat_interleave(groups, 1)
    v_all = torch.cat([v_prefix, v], -2).repeat_interleave(groups, 1)
    c, n = q.shape[-2], k_all.shape[-2]
    mask = torch.ones(c, n, dtype=torch.bool, device=q.device).tril(n - c)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)


def _inputs(c, p, heads, kv_heads, d=32, dtype=torch.float32, seed=0, device="cpu", buffer=None):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    q = rand(2, c, heads, d).transpose(1, 2)  # a model's layout: [b, c, h, d] memory
    k = rand(2, c, kv_heads, d).transpose(1, 2)
    v = rand(2, c, kv_heads, d).transpose(1, 2)
    size = buffer or p
    # the prefix is a view of a longer K/V buffer, as the runtime hands it over
    kbuf, vbuf = rand(2, kv_heads, size, d), rand(2, kv_heads, size, d)
    return q, kbuf[:, :, :p], k, vbuf[:, :, :p], v


CASES = [(48, 0), (33, 7), (16, 80), (1, 5), (5, 1)]


@pytest.mark.parametrize("c,p", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_split_matches_the_concatenation_fwd_and_bwd(c, p, heads, kv_heads):
    inputs = [t.requires_grad_() for t in _inputs(c, p, heads, kv_heads, buffer=p + 9)]
    out = flash_split_attention(*inputs, scale=0.3)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = _reference(*ref_in, scale=0.3)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want, x in zip(grads, ref_grads, inputs):
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bf16_within_bf16_rounding_of_the_concatenation():
    inputs = [t.requires_grad_() for t in _inputs(24, 40, 6, 2, dtype=torch.bfloat16)]
    out = flash_split_attention(*inputs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = _reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_compiles_and_matches_eager():
    # Dynamo traces the autograd.Function into the chunk program (how sppo_fx compiles it)
    inputs = _inputs(12, 20, 4, 2)
    eager_in = [t.detach().requires_grad_() for t in inputs]
    comp_in = [t.detach().requires_grad_() for t in inputs]
    eager = flash_split_attention(*eager_in)
    compiled = torch.compile(flash_split_attention, backend="aot_eager", fullgraph=True)(*comp_in)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    g_e = torch.autograd.grad(eager.sum(), eager_in)
    g_c = torch.autograd.grad(compiled.sum(), comp_in)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- CUDA code path, fake tensors


@pytest.fixture
def sm90(monkeypatch):
    """A CUDA device of capability 9.0, for fake CUDA tensors on a machine without one."""
    monkeypatch.setattr(_compat, "cuda_capability", lambda device: (9, 0))


def _fake_cuda_inputs(c, p, heads=8, kv_heads=2, d=64, dtype=torch.bfloat16, buffer=512):
    b = 1
    q = torch.empty(b, c, heads, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.empty(b, c, kv_heads, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.empty(b, c, kv_heads, d, device="cuda", dtype=dtype).transpose(1, 2)
    kbuf = torch.empty(b, kv_heads, buffer, d, device="cuda", dtype=dtype)
    vbuf = torch.empty(b, kv_heads, buffer, d, device="cuda", dtype=dtype)
    # narrow, not [..., :p]: Python indexing wants a real CUDA device even on fake tensors
    return [q, kbuf.narrow(2, 0, p), k, vbuf.narrow(2, 0, p), v], (kbuf, vbuf)


class _Ctx:
    """Stands in for autograd's ctx: the autograd engine needs a real CUDA device (streams)
    even for fake CUDA tensors, so the Function's forward and backward are called directly;
    what `save_for_backward` receives is exactly what autograd would keep."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _run_cuda_path(inputs):
    """Forward through `prefix_causal_attention`'s routing (no grad), then the Function's
    forward and backward as autograd would run them: (out, grads, saved, op names)."""
    ctx = _Ctx()
    with RecordedOps() as ops:
        out = prefix_causal_attention(*inputs)
        out2 = flash_split._FlashSplitAttention.forward(ctx, *inputs, 0.125)
        grads = flash_split._FlashSplitAttention.backward(ctx, torch.empty_like(out2))[:5]
    assert out.shape == out2.shape and out.stride() == out2.stride()
    return out, grads, ctx.saved_tensors, ops.names


def test_cuda_path_runs_flash_twice_without_concatenation_or_repeated_heads(sm90):
    with FakeTensorMode():
        inputs, _ = _fake_cuda_inputs(64, 192)
        out, grads, _, names = _run_cuda_path(inputs)
    # one forward through the routing, one direct: 2 flash calls each; backward: 2 more
    assert names.count("aten._scaled_dot_product_flash_attention") == 4
    assert names.count("aten._scaled_dot_product_flash_attention_backward") == 2
    assert not {"aten.cat", "aten.repeat_interleave", "aten.expand", "aten.repeat"} & set(names), names
    assert out.shape == inputs[0].shape and out.device.type == "cuda"
    assert out.transpose(1, 2).is_contiguous()  # SDPA's output layout, [b, c, h, d] memory
    for g, x in zip(grads, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype  # dk, dv with the K/V heads (GQA)


def _new_bytes(saved, inputs, buffers):
    """Bytes of saved tensors whose storage is none of the inputs' (the K/V buffer included)."""
    known = {t.untyped_storage()._cdata for t in list(inputs) + list(buffers)}
    new = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved
           if t.untyped_storage()._cdata not in known}
    return sum(new.values())


def _saved_new_bytes_split(c, p):
    with FakeTensorMode():
        inputs, buffers = _fake_cuda_inputs(c, p)
        _, _, saved, _ = _run_cuda_path(inputs)
        return _new_bytes(saved, inputs, buffers)


def test_saved_memory_does_not_grow_with_the_prefix(sm90):
    sizes = {p: _saved_new_bytes_split(64, p) for p in (0, 64, 448)}
    assert sizes[64] == sizes[448], sizes
    # out [1, 8, 64, 64] bf16 + lse [1, 8, 64] fp32 (+ rng state): the chunk's, not the prefix's
    assert sizes[448] < 2 * (64 * 8 * 64 * 2 + 8 * 64 * 4), sizes


def test_saved_memory_counter_sees_a_concatenation():
    # the control: what the path this replaced saved (the Triton op's inputs: torch.cat'ed
    # K/V) grows with the prefix, and the counter above shows it
    from sppo_fx.chunk_attention.op import _opaque_setup, chunk_attention_opaque

    def concatenated_saved(p):
        with FakeTensorMode():
            (q, kp, k, vp, v), buffers = _fake_cuda_inputs(64, p)
            k_all, v_all = torch.cat([kp, k], -2), torch.cat([vp, v], -2)
            out = torch.ops.sppo_fx.chunk_attention_opaque(q, k_all, v_all, 0.125, True)
            ctx = _Ctx()
            _opaque_setup(ctx, (q, k_all, v_all, 0.125, True), out)
            return _new_bytes(ctx.saved_tensors, (q, kp, k, vp, v), buffers)
    assert chunk_attention_opaque is not None
    small, large = concatenated_saved(64), concatenated_saved(448)
    assert large - small == 2 * (448 - 64) * 2 * 64 * 2  # k and v, 2 K/V heads, d 64, bf16


@pytest.mark.parametrize("change,reason", [
    (dict(dtype=torch.float32), "dtype"),
    (dict(d=12), "head dim"),
    (dict(d=320), "head dim"),
    (dict(heads=6, kv_heads=4), "K/V heads"),
])
def test_capability_check_names_what_flash_cannot_run(sm90, change, reason):
    with FakeTensorMode():
        inputs, _ = _fake_cuda_inputs(16, 8, **change)
        q, _, k, _, v = inputs
        assert reason in flash_split_supported(q, k, v)
        ok, _ = _fake_cuda_inputs(16, 8)
        assert flash_split_supported(ok[0], ok[2], ok[4]) is None


def test_capability_check_on_old_gpus_and_disabled_flash(monkeypatch):
    with FakeTensorMode():
        inputs, _ = _fake_cuda_inputs(16, 8)
        q, _, k, _, v = inputs
        monkeypatch.setattr(_compat, "cuda_capability", lambda device: (7, 5))
        assert "sm_80" in flash_split_supported(q, k, v)
        monkeypatch.setattr(_compat, "cuda_capability", lambda device: (9, 0))
        monkeypatch.setattr(_compat, "flash_sdp_enabled", lambda: False)
        assert "disabled" in flash_split_supported(q, k, v)
    cpu = _inputs(4, 4, 2, 2)
    assert "CUDA" in flash_split_supported(cpu[0], cpu[2], cpu[4])


def test_unsupported_inputs_fall_back_to_the_triton_op(sm90):
    with FakeTensorMode():
        inputs, _ = _fake_cuda_inputs(16, 40, dtype=torch.float32)
        with RecordedOps() as ops:
            out = prefix_causal_attention(*inputs)
    assert "aten._scaled_dot_product_flash_attention" not in ops.names
    assert "sppo_fx.chunk_attention_opaque" in ops.names
    assert out.shape == inputs[0].shape


def test_fallback_matches_on_cpu_where_flash_split_does_not_run(monkeypatch):
    # the capability check failing leaves prefix_causal_attention on its existing path:
    # same numbers as the split on CPU
    inputs = _inputs(9, 13, 4, 2)
    monkeypatch.setattr(flash_split, "flash_split_supported", lambda q, k, v: "forced off")
    torch.testing.assert_close(prefix_causal_attention(*inputs), flash_split_attention(*inputs),
                               atol=2e-6, rtol=2e-5)


def test_attention_bench_runs_on_cpu(capsys):
    # bench/attention.py's CPU variant: the flash split against SDPA with a mask, tiny sizes
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--chunk", "16", "--prefixes", "0,24", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--dtype", "fp16", "--warmup", "0", "--iters", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "flash split" in line]
    assert len(rows) == 2 and not any("error" in r for r in rows), rows
    assert all(float(r.rstrip("| ").rsplit("|", 1)[-1]) < 1e-5 for r in rows), rows  # fp32 on CPU


def test_cuda_environment_is_read_once_while_dynamo_traces(monkeypatch):
    """Dynamo cannot trace `torch.backends.cuda.flash_sdp_enabled()` (a bool from a torch.*
    op; on the GPU machine's torch 2.11 this broke every compiled chunk program on CUDA):
    the environment check runs at trace time and its answer is a constant of the graph."""
    monkeypatch.setattr(_compat, "cuda_capability", lambda device: (9, 0))

    def route(x):
        return x * 2 if cuda_environment_reason(0) is None else x * 3
    torch._dynamo.reset()
    compiled = torch.compile(route, fullgraph=True, backend="eager")
    assert compiled(torch.ones(2)).tolist() == [2.0, 2.0]


def test_prefix_attention_traces_as_one_graph_on_cpu():
    """The routing in front of the kernels (autocast's dtype, the flash capability check)
    traces without a graph break; torch 2.11's Dynamo refuses
    `torch.amp.is_autocast_available`, which the routing used to call."""
    q, k_prefix, k, v_prefix, v = _inputs(4, 4, 2, 2)
    torch._dynamo.reset()
    compiled = torch.compile(prefix_causal_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k_prefix, k, v_prefix, v),
                               prefix_causal_attention(q, k_prefix, k, v_prefix, v), atol=0, rtol=0)
