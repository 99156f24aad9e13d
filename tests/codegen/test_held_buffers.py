"""Inductor keeps the buffers handed to `sppo.offload` and `sppo.kv_out` from reuse, and only
those (`sppo_fx/codegen/held_buffers.py`).

The runtime holds such a tensor past the graph's last use of it (a kept slot until the
backward, an offloaded one until its copy is written): if Inductor wrote a later kernel's
output into its memory, the backward would read other data, silently on the host and
device tiers.
"""

import pytest
import torch
import torch.fx as fx

import sppo_fx.ops.offload  # noqa: F401 - registers sppo.offload
import sppo_fx.ops.skeleton  # noqa: F401 - registers sppo.kv_out
from sppo_fx.codegen.held_buffers import defer_past_inplace_users
from sppo_fx.ops.offload import active_memory

from conftest import held_and_reused

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Keeper:
    """A chunk memory that keeps what it is handed (as a kept slot does), and a copy of it
    as it was then."""

    def __init__(self):
        self.kept, self.copies = {}, {}

    def offload(self, x, slot):
        self.kept[slot], self.copies[slot] = x, x.clone()

    def kv_out(self, x, slot):
        self.offload(x, slot)


def program(a, w):
    # matmul outputs are buffers of their own (extern kernels): b's is free for reuse after
    # its last use in c, and c, d and e have its size
    b = a @ w
    h = torch.ops.sppo.offload(b, 0)
    k = torch.ops.sppo.kv_out(a @ w.t(), 1)
    c = b @ w
    d = c @ w
    e = d @ w
    return h, k, e


def _library_backend(gm, example_inputs):
    """Inductor through the library's inner compile of a forward graph with offload nodes."""
    from torch._inductor.compile_fx import compile_fx
    from sppo_fx.codegen.inductor import _forward_holding_handed_out
    return compile_fx(gm, example_inputs, inner_compile=_forward_holding_handed_out)


def _compiled_code(fn, *args, backend=_library_backend):
    from torch._inductor.utils import run_and_get_code
    keeper = Keeper()
    torch._dynamo.reset()
    with active_memory(keeper), torch._inductor.config.patch(fx_graph_cache=False):
        _, (code,) = run_and_get_code(torch.compile(fn, backend=backend, dynamic=False), *args)
    return keeper, code


def test_handed_out_buffers_are_never_reused_and_the_others_are():
    torch.manual_seed(0)
    a, w = torch.randn(64, 64), torch.randn(64, 64)
    keeper, code = _compiled_code(program, a, w)
    for slot in (0, 1):
        assert torch.equal(keeper.kept[slot], keeper.copies[slot]), f"slot {slot} was overwritten"
    held, reused = held_and_reused(code)
    assert len(held) == 2
    assert not [r for r in reused if r in held], code
    assert reused, "Inductor reused no buffer at all: reuse is off, not targeted"


def program_scatter(a, w, idx, vals):
    # Inductor's FX reinplacing writes index_put into b's memory where nothing uses b after
    # it: the offload call must come after, not right after b
    b = a @ w
    h = torch.ops.sppo.offload(b, 0)
    c = torch.index_put(b, (idx,), vals)
    return h, c @ w


def test_a_scatter_into_a_handed_out_tensor_does_not_overwrite_it():
    torch.manual_seed(0)
    a, w = torch.randn(64, 64), torch.randn(64, 64)
    idx, vals = torch.tensor([1, 5, 9]), torch.randn(3, 64)
    keeper, _ = _compiled_code(program_scatter, a, w, idx, vals)
    assert torch.equal(keeper.kept[0], keeper.copies[0])
    assert torch.equal(keeper.kept[0], a @ w)


def test_the_offload_call_moves_past_a_later_scatter_into_its_storage_through_a_view():
    g = fx.Graph()
    x, i, v = g.placeholder("x"), g.placeholder("i"), g.placeholder("v")
    for node, val in ((x, torch.empty(8, 4)), (i, torch.zeros(2, dtype=torch.long)), (v, torch.empty(2))):
        node.meta["val"] = val
    b = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    b.meta["val"] = torch.empty(8, 4)
    view = g.call_function(torch.ops.aten.view.default, (b, [32]))
    view.meta["val"] = b.meta["val"].view(32)  # b's storage
    h = g.call_function(torch.ops.sppo.offload.default, (b, 0))
    other = g.call_function(torch.ops.aten.index_put.default, (x, [i], v))  # another storage: stays
    put = g.call_function(torch.ops.aten.index_put.default, (view, [i], v))  # into b's memory
    g.output((h, put, other))
    assert defer_past_inplace_users(g) == 1
    order = list(g.nodes)
    assert order.index(h) == order.index(put) + 1 and order.index(h) > order.index(other)
    assert defer_past_inplace_users(g) == 0  # nothing after it now


@pytest.mark.slow
@pytest.mark.parametrize("offload,skeleton", [("device", "keep"), ("disk", "offload")])
def test_hugging_face_llama_compiled_with_a_tier_is_exact(offload, skeleton):
    """Kept slots (the "device" tier hands the tensor itself back to the backward) and the
    disk tier with the K/V skeleton streamed, compiled by Inductor: without the holds, the
    gradients differ (the embedding's first)."""
    import transformers  # a test dependency (pyproject.toml): missing, the test fails, not skips
    from conftest import assert_matches_eager
    import sppo_fx
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    compiled = sppo_fx.compile(model, chunks=4, compile=True, offload=offload, skeleton=skeleton)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
