"""Unit tests of the chunk pass and causal-mask recognition on hand-built FX graphs."""
from __future__ import annotations

import pytest
import torch

from sppo_fx import SppoError
from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.passes.masks.causal import recognize_causal_masks
from sppo_fx.passes.seq_chunk import chunk_program
from sppo_fx.passes.seqdim import analyse

aten = torch.ops.aten


def _attention_lm(hand, rope_positions=True):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    labels = hand.input("labels", (1, hand.T), torch.int64)
    w = hand.param("w", (7, 8))
    h = hand.call(aten.embedding.default, w, ids)
    t = hand.size(ids, 1)
    if rope_positions:
        pos = hand.call(aten.arange.default, t, dtype=torch.float32)
        h = hand.call(aten.add.Tensor, h, hand.call(aten.unsqueeze.default, pos, -1))
    q = hand.call(aten.transpose.int, hand.call(aten.view.default, h, [1, t, 2, 4]), 1, 2)
    a = hand.call(aten.scaled_dot_product_attention.default, q, q, q, None, 0.0, True)
    h = hand.call(aten.reshape.default, hand.call(aten.transpose.int, a, 1, 2), [1, t, 8])
    logits = hand.call(aten.linear.default, h, w)
    loss = hand.call(aten.cross_entropy_loss.default, hand.call(aten.view.default, logits, [-1, 7]),
                     hand.call(aten.view.default, labels, [-1]))
    return hand.output(loss)


def _program(hand, gm):
    analyse(gm, hand.seq, hand.params)
    return chunk_program(gm, hand.seq, hand.params, hand.inputs)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_chunk_program_signature(hand):
    prog = _program(hand, _attention_lm(hand))
    names = [n.name for n in prog.chunk.graph.nodes if n.op == "placeholder"]
    assert names == ["w", "chunk_ids", "chunk_labels", "scaled_dot_product_attention_default_k_prefix",
                     "scaled_dot_product_attention_default_v_prefix", "chunk_start", "chunk_len"]
    assert [b.seq_dim for b in prog.boundaries] == [1, 1]
    assert len(prog.attention) == 1 and prog.attention[0].k_shape == (1, 2, 0, 4)
    assert [r.op for r in prog.reductions] == ["cross_entropy(mean)"]
    out = next(n for n in prog.chunk.graph.nodes if n.op == "output").args[0]
    assert len(out) == 4  # loss sum, valid count, K, V


def test_chunk_program_rewrites(hand):
    prog = _program(hand, _attention_lm(hand))
    targets = _targets(prog.chunk)
    assert aten.scaled_dot_product_attention.default not in targets
    attn = next(n for n in prog.chunk.graph.nodes if n.target is prefix_causal_attention)
    assert [a.name for a in attn.args[1::2]] == ["scaled_dot_product_attention_default_k_prefix",
                                                 "scaled_dot_product_attention_default_v_prefix"]
    assert aten.cat.default not in targets  # the prefix is never concatenated in the graph
    arange = next(n for n in prog.chunk.graph.nodes if n.target is aten.arange.start)
    assert arange.args[0].name == "chunk_start"
    ce = next(n for n in prog.chunk.graph.nodes if n.target is aten.cross_entropy_loss.default)
    assert ce.args[3] == 2  # reduction=sum; the epilogue divides by the global count
    assert aten.div.Tensor in _targets(prog.epilogue)


def test_chunk_program_computes_chunk_values(hand):
    """Running the chunk program on two halves reproduces the full-sequence graph's loss."""
    gm = _attention_lm(hand)
    prog = _program(hand, gm)
    torch.manual_seed(0)
    w = torch.randn(7, 8)
    ids = torch.randint(0, 7, (1, 10))
    labels = torch.randint(0, 7, (1, 10))
    full = gm(ids, labels, w)[0]
    kp = vp = torch.empty(1, 2, 0, 4)
    s0, c0, k0, v0 = prog.chunk(w, ids[:, :6], labels[:, :6], kp, vp, 0, 6)
    s1, c1, k1, v1 = prog.chunk(w, ids[:, 6:], labels[:, 6:], k0, v0, 6, 4)
    (loss,) = prog.epilogue(10, s0 + s1, c0 + c1)
    assert prog.epilogue_params == []
    torch.testing.assert_close(loss, full)


def test_size_of_prologue_value_is_rebuilt_from_chunk_len(hand):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    shifted = hand.call(aten.roll.default, ids, [-1], [1])
    n = hand.size(shifted, 1)  # a size read off a prologue-only tensor
    w = hand.param("w", (5, 3))
    h = hand.call(aten.view.default, hand.call(aten.embedding.default, w, shifted), [n, 3])
    prog = _program(hand, hand.output(hand.call(aten.sum.default, h)))
    assert "sym_size" not in prog.chunk.code and "chunk_len" in prog.chunk.code
    ids_v = torch.tensor([[1, 2, 3, 4]])
    (shift_v,) = prog.prologue(4, ids_v)
    assert shift_v.tolist() == [[2, 3, 4, 1]]
    (part,) = prog.chunk(torch.ones(5, 3), shift_v[:, 1:3], 1, 2)
    assert part.item() == 6.0


def test_shifted_position_range_is_refused(hand):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    w = hand.param("w", (5, 3))
    h = hand.call(aten.embedding.default, w, ids)
    t = hand.size(ids, 1)
    pos = hand.call(aten.arange.start, 1, hand.call(__import__("operator").add, t, 1))
    h = hand.call(aten.add.Tensor, h, hand.call(aten.unsqueeze.default, pos, -1))
    with pytest.raises(SppoError, match="positions other than 0..T-1"):
        _program(hand, hand.output(hand.call(aten.sum.default, h)))


def _masked_attention(hand, causal):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (7, 8)), ids)
    t = hand.size(ids, 1)
    q = hand.call(aten.transpose.int, hand.call(aten.view.default, h, [1, t, 2, 4]), 1, 2)
    rows = hand.call(aten.unsqueeze.default, hand.call(aten.arange.default, t), -1)
    cols = hand.call(aten.unsqueeze.default, hand.call(aten.arange.default, t), 0)
    mask = hand.call(aten.le.Tensor if causal else aten.ne.Tensor, cols, rows)
    a = hand.call(aten.scaled_dot_product_attention.default, q, q, q, mask)
    return hand.output(hand.call(aten.sum.default, a))


def test_position_built_causal_mask_is_recognised(hand):
    gm = _masked_attention(hand, causal=True)
    recognize_causal_masks(gm, hand.seq, set(hand.params), lambda name: None)
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert sdpa.args[3] is None and sdpa.args[5] is True
    assert aten.le.Tensor not in _targets(gm)  # the T x T mask subgraph is gone


def test_non_causal_position_mask_is_refused(hand):
    gm = _masked_attention(hand, causal=False)
    with pytest.raises(SppoError, match="not the causal mask"):
        recognize_causal_masks(gm, hand.seq, set(hand.params), lambda name: None)
