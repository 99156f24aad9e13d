"""Tests for sppo_fx.chunk_attention.op.

* The custom op's CPU (reference) path, forward and backward, against
  ``scaled_dot_product_attention`` with ``causal_lower_right``.
* The raw Triton kernels under ``TRITON_INTERPRET=1`` (in a subprocess, because the
  variable must be set before triton is imported), including the op's Triton branch.
* The real kernels compiled ahead of time for an sm_90 target (second subprocess; no GPU
  needed).  Both subprocesses start with this module's first test and run in parallel
  with the in-process tests.
* ``segmented_chunk_attention`` against attention over the concatenated prefix.
* ``torch.compile`` (inductor) and ``torch.export`` on CPU tensors.
"""
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# one xdist worker runs this module (`--dist loadgroup`): the module fixture starts the
# Triton subprocesses in every worker that runs one of its tests, twice the CPU on 2 cores
pytestmark = pytest.mark.xdist_group("chunk_attention")


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
    q, k, v, _ = make_inputs(1, 2, 1, 3, 2, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: chunk_attention_with_lse(q, k, v), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: chunk_attention_with_lse(q, k, v, causal=False), (q, k, v)
    )


def test_opcheck():
    q, k, v, do = make_inputs(1, 4, 2, 6, 5, 16)
    # (test_aot_dispatch_dynamic is left out for time; the torch.compile test covers AOT.)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.sppo_fx.chunk_attention_fwd.default, (q, k, v, 0.25, True),
                          test_utils=utils)
    with torch.no_grad():
        out, lse = torch.ops.sppo_fx.chunk_attention_fwd(q, k, v, 0.25, True)
    args = (do, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), 0.25, True)
    torch.library.opcheck(torch.ops.sppo_fx.chunk_attention_bwd.default, args, test_utils=utils)


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


@pytest.mark.slow
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
# Triton kernels: interpreter (TRITON_INTERPRET=1) and sm_90 compilation, in subprocesses
# ----------------------------------------------------------------------------------------

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (import triton failed)")

# Forward runs over the full grid c x prefix x (h/h_kv) x d (64 cases, the op's default
# fp32 tiles).  Backward under the interpreter is ~3x slower than forward, so it runs on a
# representative subset: 8 (c, p) pairs covering every c and prefix value and the edge
# cases (c=1, p=0, ragged tiles, several query tiles) x both head layouts x both head
# dims, with 64x64 tiles.  Extra runs use 16x16 tiles (several diagonal/ragged tiles in
# every row and column, non-causal, non-power-of-two head dim) and the default fp32
# backward tiles; the bf16 runs use the default 16-bit tiles (the GPU configuration).
INTERPRETER_SCRIPT = textwrap.dedent(
    r"""
    import itertools, json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    torch.set_num_threads(1)
    import numpy as np
    import triton.runtime.interpreter as triton_interpreter
    try:
        int(np.ones(1))
    except TypeError:
        # NumPy >= 2.4 refuses int() of a 1-element array, which older Triton interpreters
        # (3.6) use for a scalar tensor's __index__ (a loop bound): index via squeeze, as
        # newer Triton does.
        _patch_tensor = getattr(triton_interpreter, "_patch_lang_tensor", None)
        if _patch_tensor is not None:
            def _patch_lang_tensor(tensor, scope):
                _patch_tensor(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
            triton_interpreter._patch_lang_tensor = _patch_lang_tensor
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    import importlib
    CA = importlib.import_module("sppo_fx.chunk_attention.op")

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
    # every (c, p) pair with both head layouts; head dims alternate between pairs (the
    # interpreter is slow, and tiles depend on c, p and d, not on the heads)
    HD = list(itertools.product(HS, DS))
    cases = [(c, p, *HD[(j + k) % len(HD)]) for j, (c, p) in enumerate(itertools.product(CS, PS)) for k in (0, 2)]
    for c, p, (h, h_kv), d in cases:
        seed += 1
        name = f"c{c}_p{p}_h{h}_kv{h_kv}_d{d}"
        q, k, v, do = inputs(h, h_kv, c, p, d, torch.float32, seed)
        out, lse = CA.chunk_attention_fwd_triton(q, k, v)
        ref = reference(q, k, v, do)
        results["fwd"][name] = err(out, ref[0])
        if (c, p) in BWD_SUBSET:
            dq, dk, dv = CA.chunk_attention_bwd_triton(do, q, k, v, out, lse, block_m=64, block_n=64)
            results["bwd"][name] = [err(a, b) for a, b in zip((dq, dk, dv), ref[1:])]

    for c, p, (h, h_kv), d, causal, tile in [
            (64, 1, (4, 4), 16, True, 16), (33, 40, (8, 2), 24, True, 16),
            (17, 63, (4, 2), 16, False, 16), (40, 0, (2, 1), 32, True, 16),
            (128, 63, (4, 2), 64, True, None), (64, 40, (2, 1), 128, True, None)]:  # None: default tiles
        seed += 1
        q, k, v, do = inputs(h, h_kv, c, p, d, torch.float32, seed)
        out, lse = CA.chunk_attention_fwd_triton(q, k, v, causal=causal, block_m=tile, block_n=tile)
        dq, dk, dv = CA.chunk_attention_bwd_triton(do, q, k, v, out, lse, causal=causal,
                                                   block_m=tile, block_n=tile)
        ref = reference(q, k, v, do, causal)
        name = f"c{c}_p{p}_h{h}_kv{h_kv}_d{d}_causal{int(causal)}_tile{tile or 'default'}"
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


# Ahead-of-time compilation of the real (non-interpreted) kernels for an sm_90 target
# (H100/H200), with the tile configurations the op uses.  Needs no GPU: Triton lowers to
# PTX and runs its bundled ptxas.  Catches compile errors and shared-memory overflow.
AOT_SCRIPT = textwrap.dedent(
    r"""
    import importlib, json, os, traceback
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    import torch
    torch.set_num_threads(1)
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    CA = importlib.import_module("sppo_fx.chunk_attention.op")

    PTR = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}
    F32PTR = {"LSE", "DELTA", "DLSE", "SINKS", "SLOPES"}
    FLOAT = {"qk_scale", "scale", "cap_in", "cap_out"}
    TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def compile_one(jit, dtype, constexprs, num_warps, num_stages):
        sig, attrs = {}, {}
        for i, name in enumerate(jit.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in PTR:
                sig[name] = "*" + TY[dtype]
            elif name in F32PTR:
                sig[name] = "*fp32"
            elif name in FLOAT:
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
            if sig[name].startswith("*") or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # as for 16-aligned contiguous tensors
        src = ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        assert len(k.asm["cubin"]) > 0
        return int(k.metadata.shared)

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as exc:
        print("JSON:" + json.dumps({"_unavailable": f"Triton's NVIDIA backend is unavailable: {exc}"}))
        raise SystemExit(0)
    results = {}
    kernels = {"fwd": CA._chunk_attn_fwd_kernel, "dkdv": CA._chunk_attn_bwd_dkdv_kernel,
               "dq": CA._chunk_attn_bwd_dq_kernel}
    # The benchmark configuration, plus a masked head dim (80 -> BLOCK_D 128) without mask.
    for dtype, d, causal in [(torch.bfloat16, 128, True), (torch.float16, 80, False)]:
        bd = CA._block_d(d)
        for kind, jit in kernels.items():
            cfg = CA._kernel_config(kind, dtype, bd)
            ce = dict(HEAD_DIM=d, BLOCK_D=bd, CHECK_D=bd != d, CAUSAL=causal,
                      DOT_PRECISION=CA._dot_precision(dtype), UPCAST=False,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
            # the variants' switches (soft-capping, sinks, ALiBi): off as in the default op, and
            # on in a "variants" entry for the kernels that have them
            switches = [k for k in ("SOFTCAP", "HAS_SINK", "HAS_ALIBI") if k in jit.arg_names]
            for on in (False, True) if switches else (False,):
                ce.update({k: on for k in switches})
                name = f"{kind}{'_variants' if on else ''}_{TY[dtype]}_d{d}_causal{int(causal)}"
                try:
                    results[name] = {"shared": compile_one(jit, dtype, ce, cfg["num_warps"], cfg["num_stages"])}
                except Exception:
                    results[name] = {"error": traceback.format_exc()[-3000:]}
    try:
        results["preprocess_bf16_d128"] = {"shared": compile_one(
            CA._chunk_attn_bwd_preprocess_kernel, torch.bfloat16,
            dict(HEAD_DIM=128, BLOCK_D=128, CHECK_D=False, BLOCK_M=64, HAS_DLSE=True), 4, 1)}
    except Exception:
        results["preprocess_bf16_d128"] = {"error": traceback.format_exc()[-3000:]}
    print("JSON:" + json.dumps(results))
    """
)


def _start(script_text, path, interpret):
    path.write_text(script_text)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    # Tiny matrices: extra BLAS/OpenMP threads only contend with the other processes.
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(path)], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


class _TritonJobs:
    """The two Triton check subprocesses, started early and collected on first use."""

    SCRIPTS = {"interp": (lambda: INTERPRETER_SCRIPT, True), "aot": (lambda: AOT_SCRIPT, False)}

    def __init__(self):
        self.procs, self.results = {}, {}

    def start(self, key, tmp):
        text, interpret = self.SCRIPTS[key]
        self.procs[key] = _start(text(), tmp / f"{key}.py", interpret)

    def result(self, key, tmp):
        if key not in self.results:
            if key not in self.procs:
                self.start(key, tmp)
            proc = self.procs[key]
            try:
                stdout, stderr = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                self.results[key] = RuntimeError(f"{key} subprocess failed (rc={proc.returncode}):\n"
                                                 f"{stdout[-4000:]}\n{stderr[-8000:]}")
            else:
                line = [ln for ln in stdout.splitlines() if ln.startswith("JSON:")][-1]
                self.results[key] = json.loads(line[len("JSON:"):])
        res = self.results[key]
        if isinstance(res, Exception):
            pytest.fail(str(res))
        return res

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


FIXTURE_FOR = {"interpreter_results": "interp", "aot_results": "aot"}


@pytest.fixture(scope="module", autouse=True)
def _triton_jobs(request, tmp_path_factory):
    """Start the Triton subprocesses when this module's first test starts (only those that
    some selected test needs), so they run while the in-process tests run."""
    jobs = _TritonJobs()
    tmp = tmp_path_factory.mktemp("triton")
    jobs.tmp = tmp
    if HAS_TRITON:
        needed = {
            FIXTURE_FOR[name]
            for item in request.session.items
            if getattr(item, "module", None) is request.module
            for name in getattr(item, "fixturenames", ())
            if name in FIXTURE_FOR
        }
        for key in sorted(needed):
            jobs.start(key, tmp)
    yield jobs
    jobs.kill()


@pytest.fixture(scope="module")
def interpreter_results(_triton_jobs):
    return _triton_jobs.result("interp", _triton_jobs.tmp)


@pytest.fixture(scope="module")
def aot_results(_triton_jobs):
    return _triton_jobs.result("aot", _triton_jobs.tmp)


def _check(err_and_scale, atol, rtol, what):
    err, scale = err_and_scale
    assert err <= atol + rtol * scale, f"{what}: max abs error {err:.3g} (reference max {scale:.3g})"


FP32_ATOL, FP32_RTOL = 1e-5, 1e-5


@pytest.mark.slow
@needs_triton
def test_triton_forward_full_grid_fp32(interpreter_results):
    fwd = interpreter_results["fwd"]
    assert len(fwd) == 32  # 16 (c, p) pairs x 2 head layouts; both head dims over the pairs
    for name, e in fwd.items():
        _check(e, FP32_ATOL, FP32_RTOL, f"fwd {name}")


@pytest.mark.slow
@needs_triton
def test_triton_backward_fp32(interpreter_results):
    bwd = interpreter_results["bwd"]
    assert len(bwd) == 8 * 2  # 8 (c, p) pairs x 2 head layouts
    assert {name.rsplit("_d", 1)[1] for name in bwd} == {"16", "64"}
    for name, errs in bwd.items():
        for g, e in zip(("dq", "dk", "dv"), errs):
            _check(e, FP32_ATOL, FP32_RTOL, f"{g} {name}")


@pytest.mark.slow
@needs_triton
def test_triton_other_tiles_fp32(interpreter_results):
    for name, errs in interpreter_results["small_tiles"].items():
        for g, e in zip(("out", "dq", "dk", "dv"), errs):
            _check(e, FP32_ATOL, FP32_RTOL, f"{g} {name}")


@pytest.mark.slow
@needs_triton
def test_triton_bf16(interpreter_results):
    # bf16 inputs/outputs, probabilities rounded to bf16 before P@V (as on a GPU);
    # compared against a float64 reference on the same (bf16-rounded) inputs.
    for name, errs in interpreter_results["bf16"].items():
        for g, e in zip(("out", "dq", "dk", "dv"), errs):
            _check(e, 2e-2, 2e-2, f"bf16 {g} {name}")


@pytest.mark.slow
@needs_triton
def test_triton_op_path_and_segmented(interpreter_results):
    op = interpreter_results["op"]
    for e in op["full_vs_ref"]:
        _check(e, FP32_ATOL, FP32_RTOL, "op (triton branch) vs reference")
    for e in op["segmented_vs_full"]:
        _check(e, FP32_ATOL, FP32_RTOL, "segmented (triton branch) vs concatenated")


@pytest.mark.slow
@needs_triton
def test_triton_kernels_compile_for_sm90(aot_results):
    aot = aot_results
    if "_unavailable" in aot:
        pytest.skip(aot["_unavailable"])
    errors = {k: v["error"] for k, v in aot.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{e}" for k, e in errors.items())
    assert len(aot) == 13  # 6 kernels x (default, variants) + preprocess
    for name, info in aot.items():
        assert info["shared"] <= 227 * 1024, f"{name} needs {info['shared']} bytes of shared memory"


def test_opaque_op_matches_the_op_with_sdpa_output_layout():
    """The opaque variant (what compiled chunk programs call on a GPU) computes the same
    attention and returns SDPA's [b, c, h, d] memory layout; through torch.compile too."""
    from sppo_fx.chunk_attention.op import chunk_attention_opaque
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 13, 16, requires_grad=True) for _ in range(2))
    ref = chunk_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref.sum(), [q, k, v])
    for fn in (chunk_attention_opaque, torch.compile(chunk_attention_opaque, backend="aot_eager", fullgraph=True)):
        out = fn(q, k, v)
        assert out.stride() == out.transpose(1, 2).contiguous().transpose(1, 2).stride()
        torch.testing.assert_close(out, ref)
        for g, r in zip(torch.autograd.grad(out.sum(), [q, k, v]), ref_grads):
            torch.testing.assert_close(g, r)
