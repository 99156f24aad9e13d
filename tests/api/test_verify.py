"""verify=True: the first call compares the transformed program with the unmodified model
on a prefix of the batch, and raises SppoError naming the first differing parameter; a
deliberately broken pass (a mask recogniser that accepts a mask that is not causal) is
caught, on one process and across pipeline and sequence-parallel ranks."""
from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx.errors import SppoError
from sppo_fx.plan import Plan
from sppo_fx.runtime.launch import run_local_ranks
from sppo_fx.verify import compare, prefix_call, prefix_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "verify_worker.py")


class PeekingLM(nn.Module):
    """A causal LM whose mask also lets each token see the next one: not causal, so
    sppo_fx refuses it; with a recogniser patched to accept it, chunks would train on
    another model's gradients."""

    def __init__(self, vocab=31, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        b, t = ids.shape
        h = self.embed(ids)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def accept_every_mask(monkeypatch):
    """Break the mask recogniser: every SDPA mask is 'proven' causal."""
    import sppo_fx.passes.masks.causal as causal_mask
    proven = types.SimpleNamespace(kind=types.SimpleNamespace(window=None), documents=None, limit=None)
    monkeypatch.setattr(causal_mask, "prove_mask", lambda *a, **k: proven)


def _data(vocab=31, batch=2, seq=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen))


def test_prefix_plan_keeps_the_first_chunks_and_never_the_whole_of_a_longer_plan():
    plan = Plan(20, [8, 5, 4, 3], offload_ratios=[1.0, 0.5, 0.25, 0.0], tier="disk")
    short = prefix_plan(plan)
    assert (short.seq_len, short.chunk_lengths, short.offload_ratios) == (17, [8, 5, 4], [1.0, 0.5, 0.25])
    assert prefix_plan(Plan(9, [4, 3, 2])).chunk_lengths == [4, 3]
    assert prefix_plan(Plan(9, [5, 4])).chunk_lengths == [5, 4]
    split = prefix_plan(Plan(12, [4, 4, 2, 2], sp_splits=[[2, 2], [3, 1], [1, 1], [1, 1]]))
    assert split.sp_splits == [[2, 2], [3, 1], [1, 1]]


def test_prefix_call_cuts_every_input_with_the_sequence_length():
    x, y = torch.zeros(2, 10), torch.zeros(2, 10, 3)
    scale = torch.ones(2)
    args, kwargs, target = prefix_call(((x,), {"labels": y, "scale": scale}, None), 1, 10, 4)
    assert args[0].shape == (2, 4) and kwargs["labels"].shape == (2, 4, 3) and kwargs["scale"].shape == (2,)


def test_compare_names_the_first_parameter_that_differs():
    ps = [("a", nn.Parameter(torch.ones(3))), ("b", nn.Parameter(torch.ones(3)))]
    ref = {"a": torch.ones(3), "b": torch.ones(3)}
    assert compare(ps, {"a": torch.ones(3), "b": torch.ones(3) * (1 + 1e-6)}, ref, 1.0, 1.0).index is None
    verdict = compare(ps, {"a": torch.ones(3), "b": torch.tensor([1.0, 1.5, 1.0])}, ref, 1.0, 1.0)
    assert (verdict.index, verdict.name) == (1, "b") and verdict.relative == pytest.approx(0.5)
    assert compare(ps, {"a": None, "b": ref["b"]}, ref, 1.0, 1.0).name == "a"  # a gradient that never came
    assert compare(ps, dict(ref), ref, 2.0, 1.0).index == -1  # the loss first


def test_verify_passes_an_exact_program_and_keeps_earlier_gradients():
    torch.manual_seed(0)
    from sppo_fx.models import build
    model = build("llama", "tiny")
    x, y = _data(model.config.vocab_size, seq=30)
    compiled = sppo_fx.compile(model, chunks=5, compile=False, verify=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)  # accumulated by the user before this step
    loss = compiled(x, y)
    loss.backward()
    got = {n: p.grad - 0.5 for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(x, y)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_verify_catches_a_recogniser_that_accepts_a_wrong_mask(monkeypatch):
    accept_every_mask(monkeypatch)
    torch.manual_seed(0)
    model = PeekingLM()
    x, y = _data()
    # the broken pass trains silently wrong without the check ...
    loss = sppo_fx.compile(model, chunks=4, compile=False)(x, y)
    loss.backward()
    wrong = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    assert any(not torch.allclose(wrong[n], p.grad, rtol=1e-3, atol=1e-5) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    # ... and verify=True refuses it at the first call, naming what differs, no gradient left
    compiled = sppo_fx.compile(model, chunks=4, compile=False, verify=True)
    with pytest.raises(SppoError, match=r"verify=True: the transformed program's (loss|gradient of '\w+)"):
        compiled(x, y)
    assert all(p.grad is None for p in model.parameters())


def test_verify_must_be_a_bool():
    with pytest.raises(SppoError, match="verify='yes'"):
        sppo_fx.compile(PeekingLM(), verify="yes")


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_across_pipeline_and_sequence_parallel_ranks(tmp_path):
    """Two ranks, three layouts (pp=2; sp=2; sp=2 with the broken recogniser and pp=2 with
    it): exact programs pass and step; the broken pass raises the same SppoError on every
    rank, before any step, with no gradient left."""
    results = run_local_ranks([sys.executable, WORKER], 2, 600.0, cwd=ROOT)
    verdicts = []
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        verdicts.append(json.loads(out.strip().splitlines()[-1]))
    for layout in ("pp2", "sp2"):
        for v in verdicts:
            assert v[layout]["error"] is None and v[layout]["stepped"], (layout, v[layout])
    for layout in ("pp2_broken", "sp2_broken"):
        errors = {v[layout]["error"] for v in verdicts}
        assert len(errors) == 1, errors  # every rank raises the same error
        (error,) = errors
        assert error is not None and "verify=True" in error, error
        assert all(v[layout]["grads_left"] == 0 for v in verdicts)


def test_verify_runs_models_that_view_their_inputs():
    """The prefix of a [B > 1, T] input is a strided slice; a model's `y.view(-1)` (the
    nanoGPT idiom) must still run in the check (it raised a RuntimeError; found by review)."""
    torch.manual_seed(0)
    model = PeekingLM()

    def loss_of(model, ids, targets):
        b, t = ids.shape
        h = model.embed(ids)
        q, k, v = (z.view(b, t, model.heads, -1).transpose(1, 2) for z in model.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = model.head(h + model.proj(a.transpose(1, 2).reshape(b, t, -1)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    x, y = _data()
    step = sppo_fx.compile(loss_of, chunks=4, compile=False, verify=True)
    step(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
