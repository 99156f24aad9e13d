"""What the memory model's traced forward and backward graphs allocate
(`passes.cost.saved.allocated_tensors`, `solver.memory_model.allocation_lines`): the clock's
allocation term counts these rather than the captured graph's one gradient per input."""
import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import sppo_fx
from conftest import tiny_hf_llama
from sppo_fx.orchestrate.stage import memory_models
from sppo_fx.passes.cost.data import c
from sppo_fx.passes.cost.saved import allocated_tensors
from sppo_fx.solver.memory_model import allocation_lines


def _graph(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def test_fresh_outputs_count_views_and_in_place_writes_do_not():
    c0 = 13  # the example chunk: dims of 13 are the chunk's tokens

    def forward(x, w):      # x [c0, 8], w [8, 8]
        y = torch.mm(x, w)  # fresh, a matmul: 32 bytes a token
        y.view(-1).mul_(2)  # a view, written in place: nothing new
        return torch.relu(y)  # fresh: 32 bytes a token

    def backward(g, x):     # g [c0, 8], x [c0, 8]
        return torch.mm(x.t(), g), g * 2  # a weight's gradient (fixed 256 bytes), 32 bytes a token

    fw, bw = _graph(forward, (c0, 8), (8, 8)), _graph(backward, (c0, 8), (c0, 8))
    found = {(sympy.expand(a.bytes_expr), a.backward, a.matmul): a.count
             for a in allocated_tensors(fw, bw, (c0, 17), batch=1, static={8, 64})}
    assert found == {(32 * c, False, True): 1, (32 * c, False, False): 1,
                     (sympy.Integer(256), True, True): 1, (32 * c, True, False): 1}


def test_a_hugging_face_llama_backward_allocates_more_than_one_gradient_per_input():
    torch.manual_seed(0)
    model = tiny_hf_llama()
    ids = torch.randint(0, 128, (1, 64))
    compiled = sppo_fx.compile(model, chunks=2, compile=False)
    compiled(input_ids=ids, labels=ids).backward()  # the compiled model returns the loss
    entry = compiled._require_entry()
    (mem,) = memory_models(entry, ("none",))

    def per_token(allocs, backward):
        return sum(a.count * a.per_token for a in allocs if a.backward == backward and not a.matmul)
    traced, captured = mem.allocations, entry.cost.allocations
    assert traced and all(isinstance(a.per_token, float) for a in traced)
    # the derivatives' intermediates (RMSNorm, RoPE, SiLU) and the sums of gradients of
    # values used twice: more than the captured graph's list has
    assert per_token(traced, True) > 1.2 * per_token(captured, True)
    # the forward is the same ops: about what the captured graph lists
    assert per_token(traced, False) == pytest.approx(per_token(captured, False), rel=0.5)
    # matmuls: the same tensors, forward and backward
    mm = lambda allocs: sum(a.count * a.nbytes(100) for a in allocs if a.matmul)  # noqa: E731
    assert mm(traced) == pytest.approx(mm(captured), rel=0.1)


def test_a_size_that_grows_with_the_prefix_is_left_to_attention():
    from sppo_fx.passes.cost.data import AllocatedTensor, p
    cost = type("Cost", (), {"batch": 1, "allocated": (AllocatedTensor(4 * c, False, False, 3),
                                                       AllocatedTensor(4 * (c + p), False, False),
                                                       AllocatedTensor(4 * c * c, True, False))})()
    (line,) = allocation_lines(cost)
    assert (line.per_token, line.fixed, line.count, line.backward) == (4.0, 0.0, 3.0, False)
