"""Inductor keeps the buffers handed to `sppo.offload` and `sppo.kv_out` from reuse, and only
those (`sppo_fx/codegen/held_buffers.py`).

The runtime holds such a tensor past the graph's last use of it (a kept slot until the
backward, an offloaded one until its copy is written): if Inductor wrote a later kernel's
output into its memory, the backward would read other data, silently on the host and
device tiers.
"""
import re

import pytest
import torch

import sppo_fx.ops.offload  # noqa: F401 - registers sppo.offload
import sppo_fx.ops.skeleton  # noqa: F401 - registers sppo.kv_out
from sppo_fx.codegen.held_buffers import hold_handed_out_tensors
from sppo_fx.ops.offload import active_memory

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


def _compiled_code(fn, *args):
    from torch._inductor.utils import run_and_get_code
    keeper = Keeper()
    torch._dynamo.reset()
    with active_memory(keeper), torch._inductor.config.patch(fx_graph_cache=False):
        _, (code,) = run_and_get_code(torch.compile(fn, backend="inductor", dynamic=False), *args)
    return keeper, code


def test_handed_out_buffers_are_never_reused_and_the_others_are():
    hold_handed_out_tensors()
    torch.manual_seed(0)
    a, w = torch.randn(64, 64), torch.randn(64, 64)
    keeper, code = _compiled_code(program, a, w)
    for slot in (0, 1):
        assert torch.equal(keeper.kept[slot], keeper.copies[slot]), f"slot {slot} was overwritten"
    held = set(re.findall(r"torch\.ops\.sppo\.(?:offload|kv_out)\.default\((\w+)", code))
    reused = re.findall(r"(\w+) = (\w+); del \w+\s+# reuse", code)
    assert len(held) == 2
    assert not [r for r in reused if r[1] in held], code
    assert reused, "Inductor reused no buffer at all: reuse is off, not targeted"
