"""The library's autograd.Functions under Dynamo: compiled gradients equal eager ones.

Torch 2.11's Dynamo (the GPU machine's torch, and in the range pyproject.toml allows) gives
an autograd.Function *zero* gradients, silently, when its forward returns a tensor that
aliases another value of the forward: one written in place (`mul_`, `copy_`) or an identity
`.float()` / `.to(same dtype)` / `.contiguous()`. Views (transpose, slices) are fine, and so
is a backward that returns such aliases. Torch 2.13 handles it. The chunk attention's CPU path and
the flash split both did this for float32 (and the CPU path for bfloat16 too), so every
compiled chunk program's attention had zero gradients under torch 2.11.

Two checks: the structural one (`aliased_forward_outputs`) fails on any torch when the
forward returns such an alias; the gradient one fails on the torches that mishandle it.
"""
import pytest
import torch

from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.chunk_attention.kernels.flash_split import flash_split_attention


def _inputs(c, p, heads, kv_heads, dtype, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    q = rand(2, c, heads, d).transpose(1, 2)
    k, v = (rand(2, c, kv_heads, d).transpose(1, 2) for _ in range(2))
    k_buf, v_buf = rand(2, kv_heads, p + 4, d), rand(2, kv_heads, p + 4, d)
    return [q, k_buf[:, :, :p], k, v_buf[:, :, :p], v]


def aliased_forward_outputs(fn, inputs, **kwargs) -> list[str]:
    """The names of the values in Dynamo's traced autograd.Function forwards that are the
    same tensor as the forward's output, other than the output itself (empty when the
    output is a fresh tensor)."""
    found = []

    def backend(gm, example_inputs):
        bodies = [m for name, m in gm.named_modules() if name.startswith("fwd_body")]
        assert bodies, "no autograd.Function traced: the check has nothing to look at"
        for body in bodies:
            out = body.graph.find_nodes(op="output")[0].args[0][0][0]
            val = out.meta["example_value"]
            found.extend(n.name for n in body.graph.nodes if n is not out and n.meta.get("example_value") is val)
        return gm

    torch._dynamo.reset()
    # with no input needing a gradient Dynamo inlines the forward and traces no Function
    inputs = [t.detach().requires_grad_() for t in inputs]
    torch.compile(lambda *t: fn(*t, **kwargs), backend=backend, fullgraph=True)(*inputs)
    return found


CASES = [
    pytest.param(prefix_causal_attention, torch.float32, 20, id="cpu-path-fp32"),
    pytest.param(prefix_causal_attention, torch.bfloat16, 20, id="cpu-path-bf16"),
    pytest.param(prefix_causal_attention, torch.float32, 0, id="cpu-path-no-prefix"),
    pytest.param(flash_split_attention, torch.float32, 20, id="flash-split-fp32"),
    pytest.param(flash_split_attention, torch.bfloat16, 20, id="flash-split-bf16"),
]


def _kwargs(fn):
    return {"enable_gqa": True} if fn is prefix_causal_attention else {}


@pytest.mark.parametrize("fn, dtype, prefix", CASES)
def test_forward_output_is_not_an_alias(fn, dtype, prefix):
    assert aliased_forward_outputs(fn, _inputs(12, prefix, 4, 2, dtype), **_kwargs(fn)) == []


@pytest.mark.parametrize("fn, dtype, prefix", CASES)
def test_compiled_gradients_equal_eager(fn, dtype, prefix):
    inputs = _inputs(12, prefix, 4, 2, dtype)
    eager_in = [t.detach().requires_grad_() for t in inputs]
    comp_in = [t.detach().requires_grad_() for t in inputs]
    eager = fn(*eager_in, **_kwargs(fn))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: fn(*t, **_kwargs(fn)), backend="eager", fullgraph=True)(*comp_in)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    dout = torch.randn(eager.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    for got, want in zip(torch.autograd.grad(compiled, comp_in, dout), torch.autograd.grad(eager, eager_in, dout)):
        assert want.numel() == 0 or want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=0, rtol=0)
