"""Tests for sppo_fx.ops.chunk_attention.

* The custom op's CPU (reference) path, forward and backward, against
  ``scaled_dot_product_attention`` with ``causal_lower_right``.
* The raw Triton kernels under ``TRITON_INTERPRET=1`` (in one subprocess, because the
  variable must be set before triton is imported).
* ``segmented_chunk_attention`` against attention over the concatenated prefix.
* ``torch.compile`` (inductor) and ``torch.export`` on CPU tensors.
"""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sppo_fx.ops import chunk_attention, chunk_attention_with_lse, segmented_chunk_attention

CA = importlib.import_module("sppo_fx.ops.chunk_attention")  # the module (the package attr is the function)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sdpa_reference(q, k, v, scale=None, causal=True):
    """SDPA with k/v repeated to the query heads and a lower-right causal mask."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    mask = causal_lower_right(q.shape[2], k.shape[2]) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def make_inputs(b, h, h_kv, c, p, d, dtype=torch.float32, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, c, d, generator=gen, dtype=dtype)
    k = torch.randn(b, h_kv, p + c, d, generator=gen, dtype=dtype)
    v = torch.randn(b, h_kv, p + c, d, generator=gen, dtype=dtype)
    do = torch.randn(b, h, c, d, generator=gen, dtype=dtype)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, do


def grads(fn, inputs, do):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, do))


# ----------------------------------------------------------------------------------------
# Reference (CPU) path of the custom op
# ----------------------------------------------------------------------------------------

SHAPES = [
    # b, h, h_kv, c, p, d
    (1, 4, 4, 1, 0, 16),
    (2, 4, 4, 17, 63, 16),
    (1, 8, 2, 64, 1, 32),
    (2, 8, 2, 33, 0, 64),
    (1, 6, 3, 5, 40, 24),  # non-power-of-two head dim
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}kv{}c{}p{}d{}".format(*s))
def test_reference_path_matches_sdpa(shape):
    q, k, v, do = make_inputs(*shape)
    got = grads(chunk_attention, (q, k, v), do)
    want = grads(sdpa_reference, (q, k, v), do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_reference_path_lse_and_scale():
    q, k, v, do = make_inputs(2, 8, 2, 9, 7, 16, requires_grad=False)
    out, lse = chunk_attention_with_lse(q, k, v, scale=0.3)
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 9)
    kr = k.repeat_interleave(4, dim=1)
    s = (q @ kr.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~torch.ones(9, 16, dtype=torch.bool).tril(7), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, scale=0.3), rtol=1e-5, atol=1e-5)


def test_reference_path_non_causal():
    q, k, v, do = make_inputs(1, 4, 2, 8, 0, 16)
    k2, v2 = (torch.randn(1, 2, 13, 16).requires_grad_() for _ in range(2))  # any key length
    got = grads(lambda q, k, v: chunk_attention(q, k, v, causal=False), (q, k2, v2), do)
    want = grads(lambda q, k, v: sdpa_reference(q, k, v, causal=False), (q, k2, v2), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gradcheck_out_and_lse_float64():
    """Both outputs are differentiable (the lse gradient folds into the kernel's delta)."""
    q, k, v, _ = make_inputs(1, 4, 2, 5, 3, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: chunk_attention_with_lse(q, k, v), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: chunk_attention_with_lse(q, k, v, causal=False), (q, k, v)
    )


def test_opcheck():
    q, k, v, do = make_inputs(1, 4, 2, 6, 5, 16)
    torch.library.opcheck(torch.ops.sppo_fx.chunk_attention_fwd.default, (q, k, v, 0.25, True))
    with torch.no_grad():
        out, lse = torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, 0.25, True)
    args = (do, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), 0.25, True)
    torch.library.opcheck(torch.ops.sppo_fx.chunk_attention_bwd.default, args)


def test_input_validation():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="multiple"):
        chunk_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match=">= chunk length"):
        chunk_attention(q, torch.randn(1, 4, 7, 16), torch.randn(1, 4, 7, 16))
    with pytest.raises(ValueError, match="same shape"):
        chunk_attention(q, torch.randn(1, 4, 8, 16), torch.randn(1, 4, 9, 16))


# ----------------------------------------------------------------------------------------
# Segmented prefix
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "h,h_kv,c,lens",
    [
        (4, 4, 16, [16, 16, 16]),  # equal chunks, current last
        (8, 2, 17, [5, 0, 40, 17]),  # ragged and empty prefix segments
        (4, 2, 9, [9]),  # no prefix
        (4, 1, 3, [1, 7]),  # current segment longer than the chunk
    ],
)
def test_segmented_equals_concatenated(h, h_kv, c, lens):
    b, d = 2, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, c, d, generator=gen, requires_grad=True)
    ks = [torch.randn(b, h_kv, n, d, generator=gen, requires_grad=True) for n in lens]
    vs = [torch.randn(b, h_kv, n, d, generator=gen, requires_grad=True) for n in lens]
    do = torch.randn(b, h, c, d, generator=gen)
    leaves = [q, *ks, *vs]

    seg = segmented_chunk_attention(q, ks, vs)
    g_seg = torch.autograd.grad(seg, leaves, do, allow_unused=True)
    cat = chunk_attention(q, torch.cat(ks, 2), torch.cat(vs, 2))
    g_cat = torch.autograd.grad(cat, leaves, do, allow_unused=True)
    ref = sdpa_reference(q, torch.cat(ks, 2), torch.cat(vs, 2))

    torch.testing.assert_close(seg, cat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seg, ref, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(g_seg, g_cat):
        if b_ is None or b_.numel() == 0:
            continue
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_segmented_rejects_mismatched_lists():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError):
        segmented_chunk_attention(q, [torch.randn(1, 2, 4, 16)], [])


# ----------------------------------------------------------------------------------------
# torch.compile / torch.export on CPU
# ----------------------------------------------------------------------------------------


def test_torch_compile_cpu_matches_eager():
    torch._dynamo.reset()
    q, k, v, do = make_inputs(1, 4, 2, 16, 8, 16)

    def fn(q, k, v):
        return chunk_attention(q, k, v) * 2.0

    compiled = torch.compile(fn, backend="inductor")
    got = grads(compiled, (q, k, v), do)
    want = grads(fn, (q, k, v), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_torch_export_keeps_custom_op():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return chunk_attention(q, k, v)

    q, k, v, _ = make_inputs(1, 4, 2, 8, 4, 16, requires_grad=False)
    ep = torch.export.export(M(), (q, k, v))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.sppo_fx.chunk_attention_fwd.default in targets
    torch.testing.assert_close(ep.module()(q, k, v), sdpa_reference(q, k, v), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess with TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (import triton failed)")

# Forward runs over the full grid c x prefix x (h/h_kv) x d (64 cases, default tile
# sizes).  Backward under the interpreter is ~2x slower, so it runs on a representative
# subset (every c and prefix value, both head layouts and head dims, all edge cases:
# c=1, p=0, ragged tiles, multi-tile queries) plus a few runs with 16x16 tiles that put
# several diagonal/ragged tiles in every row and column.
INTERPRETER_SCRIPT = textwrap.dedent(
    r"""
    import itertools, json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    import importlib
    CA = importlib.import_module("sppo_fx.ops.chunk_attention")

    def reference(q, k, v, do, causal=True, backward=True):
        q, k, v, do = (t.detach().double().requires_grad_() for t in (q, k, v, do))
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        mask = causal_lower_right(q.shape[2], k.shape[2]) if causal else None
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        if not backward:
            return (out.detach(),)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        return out.detach(), dq, dk, dv

    def inputs(h, h_kv, c, p, d, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        mk = lambda *s: torch.randn(*s, generator=gen).to(dtype)
        return mk(1, h, c, d), mk(1, h_kv, p + c, d), mk(1, h_kv, p + c, d), mk(1, h, c, d)

    def err(a, b):
        # [max abs error, max abs reference value]; the test applies atol + rtol * the latter
        a, b = a.detach().double(), b.detach().double()
        return [float((a - b).abs().max()), float(b.abs().max())]

    results = {"fwd": {}, "bwd": {}, "bf16": {}, "small_tiles": {}, "op": {}}
    CS, PS, HS, DS = (1, 17, 64, 128), (0, 1, 63, 300), ((4, 4), (8, 2)), (16, 64)
    BWD_SUBSET = {(1, 0), (1, 300), (17, 63), (17, 1), (64, 0), (64, 63), (128, 1), (128, 300)}
    seed = 0
    for c, p, (h, h_kv), d in itertools.product(CS, PS, HS, DS):
        seed += 1
        name = f"c{c}_p{p}_h{h}_kv{h_kv}_d{d}"
        q, k, v, do = inputs(h, h_kv, c, p, d, torch.float32, seed)
        out, lse = CA.chunk_attention_fwd_triton(q, k, v)
        ref = reference(q, k, v, do)
        results["fwd"][name] = err(out, ref[0])
        if (c, p) in BWD_SUBSET:
            dq, dk, dv = CA.chunk_attention_bwd_triton(do, q, k, v, out, lse)
            results["bwd"][name] = [err(a, b) for a, b in zip((dq, dk, dv), ref[1:])]

    for c, p, (h, h_kv), d, causal in [(64, 1, (4, 4), 16, True), (33, 40, (8, 2), 24, True),
                                       (17, 63, (4, 2), 16, False), (40, 0, (2, 1), 32, True)]:
        seed += 1
        q, k, v, do = inputs(h, h_kv, c, p, d, torch.float32, seed)
        out, lse = CA.chunk_attention_fwd_triton(q, k, v, causal=causal, block_m=16, block_n=16)
        dq, dk, dv = CA.chunk_attention_bwd_triton(do, q, k, v, out, lse, causal=causal,
                                                   block_m=16, block_n=16)
        ref = reference(q, k, v, do, causal)
        name = f"c{c}_p{p}_h{h}_kv{h_kv}_d{d}_causal{int(causal)}"
        results["small_tiles"][name] = [err(a, b) for a, b in zip((out, dq, dk, dv), ref)]

    for c, p, (h, h_kv), d in [(17, 63, (8, 2), 64), (128, 300, (4, 4), 128)]:
        seed += 1
        q, k, v, do = inputs(h, h_kv, c, p, d, torch.bfloat16, seed)
        out, lse = CA.chunk_attention_fwd_triton(q, k, v)
        dq, dk, dv = CA.chunk_attention_bwd_triton(do, q, k, v, out, lse)
        ref = reference(q, k, v, do)
        results["bf16"][f"c{c}_p{p}_h{h}_kv{h_kv}_d{d}"] = [
            err(a, b) for a, b in zip((out, dq, dk, dv), ref)]

    # The custom op's Triton branch (wrap_triton launch code, autograd, lse gradient)
    # forced on for CPU tensors, through segmented_chunk_attention.
    CA._FORCE_TRITON_ON_CPU = True
    gen = torch.Generator().manual_seed(123)
    h, h_kv, c, d, lens = 8, 2, 17, 16, [30, 5, 17]
    q = torch.randn(1, h, c, d, generator=gen).requires_grad_()
    ks = [torch.randn(1, h_kv, n, d, generator=gen).requires_grad_() for n in lens]
    vs = [torch.randn(1, h_kv, n, d, generator=gen).requires_grad_() for n in lens]
    do = torch.randn(1, h, c, d, generator=gen)
    seg = CA.segmented_chunk_attention(q, ks, vs)
    gs = torch.autograd.grad(seg, [q, *ks, *vs], do)
    full = CA.chunk_attention(q, torch.cat(ks, 2), torch.cat(vs, 2))
    gf = torch.autograd.grad(full, [q, *ks, *vs], do)
    CA._FORCE_TRITON_ON_CPU = False
    ref = reference(q, torch.cat(ks, 2), torch.cat(vs, 2), do)
    results["op"]["full_vs_ref"] = [err(full, ref[0]), err(gf[0], ref[1])]
    results["op"]["segmented_vs_full"] = [err(a, b.double()) for a, b in zip((seg, *gs), (full, *gf))]
    print("JSON:" + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    script = tmp_path_factory.mktemp("interp") / "run_kernels.py"
    script.write_text(INTERPRETER_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")][-1]
    return json.loads(line[len("JSON:"):])


def _check(err_and_scale, atol, rtol, what):
    err, scale = err_and_scale
    assert err <= atol + rtol * scale, f"{what}: max abs error {err:.3g} (reference max {scale:.3g})"


FP32_ATOL, FP32_RTOL = 1e-5, 1e-5


@needs_triton
def test_triton_forward_full_grid_fp32(interpreter_results):
    fwd = interpreter_results["fwd"]
    assert len(fwd) == 64
    for name, e in fwd.items():
        _check(e, FP32_ATOL, FP32_RTOL, f"fwd {name}")


@needs_triton
def test_triton_backward_fp32(interpreter_results):
    bwd = interpreter_results["bwd"]
    assert len(bwd) == 8 * 4  # 8 (c, p) pairs x 2 head layouts x 2 head dims
    for name, errs in bwd.items():
        for g, e in zip(("dq", "dk", "dv"), errs):
            _check(e, FP32_ATOL, FP32_RTOL, f"{g} {name}")


@needs_triton
def test_triton_small_tiles_fp32(interpreter_results):
    for name, errs in interpreter_results["small_tiles"].items():
        for g, e in zip(("out", "dq", "dk", "dv"), errs):
            _check(e, FP32_ATOL, FP32_RTOL, f"{g} {name}")


@needs_triton
def test_triton_bf16(interpreter_results):
    # bf16 inputs/outputs, probabilities rounded to bf16 before P@V (as on a GPU);
    # compared against a float64 reference on the same (bf16-rounded) inputs.
    for name, errs in interpreter_results["bf16"].items():
        for g, e in zip(("out", "dq", "dk", "dv"), errs):
            _check(e, 2e-2, 2e-2, f"bf16 {g} {name}")


@needs_triton
def test_triton_op_path_and_segmented(interpreter_results):
    op = interpreter_results["op"]
    for e in op["full_vs_ref"]:
        _check(e, FP32_ATOL, FP32_RTOL, "op (triton branch) vs reference")
    for e in op["segmented_vs_full"]:
        _check(e, FP32_ATOL, FP32_RTOL, "segmented (triton branch) vs concatenated")
