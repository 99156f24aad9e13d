"""The chunk-attention Triton kernels compile when their float arguments come typed fp64.

Inside an Inductor graph, a user-defined Triton kernel's Python-float arguments are typed
"fp64" on CUDA (`torch/_inductor/codegen/triton_utils.py`, `signature_of`:
`config._use_fp64_for_unbacked_floats`), where a direct launch types them fp32. With an fp64
`qk_scale` the scores, the online-softmax state and tl.dot's accumulator turned fp64 and the
kernels failed to compile (Triton: "Loop-carried variable l_i has initial type fp32 but is
re-assigned to fp64", or tl.dot's accumulator assertion). The kernels cast their scales to
fp32 on entry; these tests build them for an sm_90 target with both signatures (Triton's
front end, where those errors are raised, needs no GPU)."""
import functools

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed: these tests build the kernels with it for an sm_90 target")

from sppo_fx.chunk_attention.kernels import triton_kernels as tk  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.backends import backends as _BACKENDS
    _NVIDIA = "nvidia" in _BACKENDS
except ImportError:  # pragma: no cover - older triton layouts
    _NVIDIA = False

_TILES = dict(HEAD_DIM=64, BLOCK_D=64, CHECK_D=False, BLOCK_M=64, BLOCK_N=64, CAUSAL=True,
              DOT_PRECISION="ieee", UPCAST=False, SOFTCAP=False, HAS_SINK=False, HAS_ALIBI=False)
_FLOATS = ("scale", "qk_scale", "cap_in", "cap_out")
_FP32_POINTERS = ("LSE", "DELTA", "SINKS", "SLOPES")
_POINTERS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV") + _FP32_POINTERS


def _compile(kernel, float_type):
    names = kernel.arg_names
    signature, constexprs = {}, {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(names.index(name),)] = _TILES[name]
        elif name in _FLOATS:
            signature[name] = float_type
        elif name in _POINTERS:
            signature[name] = "*fp32" if name in _FP32_POINTERS else "*bf16"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    try:  # the front end only (Triton IR), where the type errors are: seconds, not minutes
        from triton._C.libtriton import ir
        from triton.compiler.compiler import make_backend
        backend = make_backend(target)
        options = backend.parse_options({})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        get_ir = functools.partial(source.make_ir, target, options, backend.get_codegen_implementation(options),
                                   backend.get_module_map(), context)
    except (ImportError, AttributeError, TypeError):  # another Triton's internals: compile it all
        return "ptx" in triton.compile(source, target=target).asm
    return "tt.func" in str(get_ir())


@pytest.mark.skipif(not _NVIDIA, reason="needs triton's nvidia backend (compiles without a GPU)")
@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
@pytest.mark.parametrize("name", ["_chunk_attn_fwd_kernel", "_chunk_attn_bwd_dkdv_kernel",
                                  "_chunk_attn_bwd_dq_kernel"])
def test_kernel_compiles_for_sm90(name, float_type, monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    assert _compile(getattr(tk, name), float_type)
