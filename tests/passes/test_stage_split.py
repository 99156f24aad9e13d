"""Stage split: balanced blocks, user split points, split_point markers; stages compose exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx import SppoError
from sppo_fx.capture import capture
from sppo_fx.models import build
from sppo_fx.passes import transform_stages
from sppo_fx.passes.stage_split import _balanced_cuts
from sppo_fx.plan import Plan
from sppo_fx.runtime.local import StageRunner


def _run_stages(cap, programs, inputs, plan):
    """Drive every stage in one process (forward stage by stage, backward in reverse)."""
    runners = [StageRunner(p, [cap.param_value(n) for n in p.params], plan) for p in programs]
    for r in runners:
        r.start(0, inputs)
    acts = {}
    for s, r in enumerate(runners):
        for i in range(plan.num_chunks):
            acts[s, i] = r.forward(0, i, acts.get((s - 1, i), []))
    loss = runners[-1].finish_forward(0)
    grads = {}
    for s in range(len(runners) - 1, -1, -1):
        for i in range(plan.num_chunks - 1, -1, -1):
            grads[s, i] = runners[s].backward(0, i, grads.get((s + 1, i), []))
    total = {}
    for prog, r in zip(programs, runners):
        for k, idx in enumerate(r.grad_index):
            param = cap.param_value(prog.params[idx])  # tied weights: one tensor, two names
            if r.param_grads[k] is not None:
                total[id(param)] = total.get(id(param), 0) + r.param_grads[k]
    return loss, total


def test_balanced_cuts_minimise_the_largest_group():
    assert _balanced_cuts([1, 1, 1, 1], 2) == [0, 2]
    assert _balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert _balanced_cuts([1, 2, 3], 3) == [0, 1, 2]


@pytest.mark.parametrize("kind,stages", [("llama", 2), ("gpt", 3), ("llama", 4)])
def test_stages_compose_to_the_eager_model(kind, stages):
    key = "n_layer" if kind == "gpt" else "n_layers"
    model = build(kind, **{key: 4})
    x, y = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))
    cap = capture(model, None, None, (x, y), {}, None, 1)
    _, sts, programs = transform_stages(cap, stages)
    assert len(sts) == stages and all(st.blocks for st in sts)
    assert [b for st in sts for b in st.blocks] == sorted({b for st in sts for b in st.blocks},
                                                           key=lambda b: int(b.rsplit(".", 1)[1]))
    assert programs[0].recvs == [] and programs[-1].sends == [] and programs[-1].epilogue is not None
    assert all(p.epilogue is None for p in programs[:-1])
    loss, grads = _run_stages(cap, programs, [x, y], Plan(20, [7, 6, 7]))
    ref = model(x, y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[id(p)], p.grad, rtol=1e-4, atol=1e-5)


def test_user_split_points():
    model = build("llama", n_layers=4)
    x = torch.randint(0, 97, (1, 12))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    _, sts, _ = transform_stages(cap, 2, split_points=["layers.3"])
    assert sts[0].blocks == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert sts[1].blocks == ["model.layers.3"]
    with pytest.raises(SppoError, match="names no module"):
        transform_stages(cap, 2, split_points=["layers.9"])


def test_too_many_stages_is_refused():
    model = build("gpt", n_layer=2)
    x = torch.randint(0, 97, (1, 12))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    with pytest.raises(SppoError, match="use stages <= 4"):
        transform_stages(cap, 5)


class MarkedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 30)

    def forward(self, x, y):
        h = torch.tanh(self.a(self.emb(x)))
        h = sppo_fx.split_point(h)
        h = torch.tanh(self.b(h)) + h
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_split_point_marker_cuts_there_and_is_removed():
    model = MarkedLM()
    x, y = torch.randint(0, 30, (2, 9)), torch.randint(0, 30, (2, 9))
    cap = capture(model, None, None, (x, y), {}, None, 1)
    _, sts, programs = transform_stages(cap, 2)
    names0 = {n.target for n in programs[0].chunk.graph.nodes if n.op == "call_function"}
    assert torch.ops.sppo_fx.split_point.default not in names0
    assert len(programs[0].sends) == 1 and len(programs[1].recvs) == 1
    assert "p_model_head_weight" in programs[1].params and "p_model_head_weight" not in programs[0].params
    loss, grads = _run_stages(cap, programs, [x, y], Plan(9, [4, 5]))
    ref = model(x, y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[id(p)], p.grad, rtol=1e-4, atol=1e-5)
    # in a single-stage compile the marker is a plain identity
    compiled = sppo_fx.compile(model, chunks=3, compile=False)
    torch.testing.assert_close(compiled(x, y), ref.detach(), rtol=1e-4, atol=1e-5)
