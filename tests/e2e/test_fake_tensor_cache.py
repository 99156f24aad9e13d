"""Torch's fake-tensor dispatch cache is neutral to capture: the suite's rank processes run
with it off (tests/conftest.py `start_rank`; docs/testing.md), while users keep torch's
default, so capture must give the same program either way. The exported graph (each node's
op, target, arguments and symbolic shape; node names differ, since the cache changes FX's name
counters) and the chunked loss and gradients are compared with the cache on and off, on
Hugging Face models whose capture takes different paths (SDPA, written-out attention, an MoE
router)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import sppo_fx
from sppo_fx.capture import capture

from test_hf_families import build as build_family, _ids as family_ids


def _moe():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes"))
    from test_moe import build, _ids
    return build("mixtral"), _ids()


CASES = {
    "llama": lambda: (build_family("llama"), family_ids()),
    "gemma2-eager": lambda: (build_family("gemma2", "eager"), family_ids()),
    "mixtral": _moe,
}


def _structure(gm) -> list:
    """Each node's op, target, arguments (as node positions) and value's shape, dtype and
    strides: the graph without its node names."""
    position = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: ("node", position[a]))
        val = node.meta.get("val")
        meta = (str(val.shape), val.dtype, str(val.stride())) if isinstance(val, torch.Tensor) else str(val)
        out.append((node.op, str(node.target), str(args), meta))
    return out


def _captured_and_trained(make, cache: bool):
    model, ids = make()
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=cache):
        program = capture(model, None, None, (), {"input_ids": ids, "labels": ids}, None, 1).program
        compiled = sppo_fx.compile(model, chunks=4, compile=False)
        loss = compiled(input_ids=ids, labels=ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return _structure(program.graph_module), loss.detach(), grads


@pytest.mark.parametrize("case", list(CASES))
def test_capture_is_the_same_with_the_fake_tensor_cache_on_and_off(case):
    graph_on, loss_on, grads_on = _captured_and_trained(CASES[case], cache=True)
    graph_off, loss_off, grads_off = _captured_and_trained(CASES[case], cache=False)
    assert len(graph_on) > 100 and graph_on == graph_off
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name
