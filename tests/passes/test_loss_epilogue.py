"""The loss epilogue: each mean's divisor from the op's own reduction semantics, input
values the loss reads carried to the epilogue, and attention sites whose sequence dim is
not the model's T (passes/loss_epilogue.py, passes/seq_chunk.py, passes/seqdim.py)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx import SppoError
from sppo_fx.capture import capture
from sppo_fx.passes import transform_stages
from sppo_fx.passes.seq_chunk import chunk_program
from sppo_fx.passes.seqdim import analyse

from conftest import assert_matches_eager

aten = torch.ops.aten
V, D, B, T = 11, 8, 2, 13
UNEQUAL = [5, 2, 3, 3]  # chunk lengths; the first 7 tokens are the first two chunks


# ---- hand-built graphs: the chunked program's loss equals the whole graph's ------------

def _chunked(prog, values: dict, inputs: list, seq_len: int, lengths: list[int]):
    """Run prologue, every chunk and the epilogue as the runtime does (partials summed)."""
    boundary = prog.prologue(seq_len, *inputs)
    totals, start = None, 0
    for length in lengths:
        slices = [b if s.seq_dim is None else b.narrow(s.seq_dim, start, length)
                  for s, b in zip(prog.boundaries, boundary)]
        outs = prog.chunk(*[values[n] for n in prog.params], *slices, start, length)[:prog.num_partials]
        totals = list(outs) if totals is None else [a + b for a, b in zip(totals, outs)]
        start += length
    return prog.epilogue(seq_len, *[values[n] for n in prog.epilogue_params], *totals)[0]


def _logits(hand):
    x = hand.input("x", (B, hand.T, D))
    w = hand.param("w", (V, D))
    return hand.call(aten.linear.default, x, w)


def _soft_ce(hand, **kw):
    logits = _logits(hand)
    probs = hand.input("probs", (B, hand.T, V))
    return hand.call(aten.cross_entropy_loss.default, hand.call(aten.transpose.int, logits, 1, 2),
                     hand.call(aten.transpose.int, probs, 1, 2), **kw)


def _class_loss(op, **kw):
    """A class-weighted loss over class-index labels (the first 6 are `ignore_index`)."""
    def build(hand):
        logits = hand.call(aten.transpose.int, _logits(hand), 1, 2)
        if op is aten.nll_loss_nd.default:
            logits = hand.call(aten._log_softmax.default, logits, 1, False)
        labels = hand.input("labels", (B, hand.T), torch.int64)
        return hand.call(op, logits, labels, hand.param("cw", (V,)), **kw)
    return build


def _elementwise(op, with_probs=True, pos_weight=False, **kw):
    def build(hand):
        logits = _logits(hand)
        other = hand.input("probs", (B, hand.T, V) if with_probs else (V,))
        if op is aten.kl_div.default:
            logits = hand.call(aten._log_softmax.default, logits, -1, False)
        if pos_weight:
            kw["pos_weight"] = hand.param("cw", (V,))
        return hand.call(op, logits, other, **kw)
    return build


_CW = torch.linspace(0.5, 2.0, V)
HAND_LOSSES = {
    "soft_ce": _soft_ce,
    "soft_ce_weight_smoothing": lambda h: _soft_ce(h, weight=h.param("cw", (V,)), label_smoothing=0.2),
    "ce_weight_smoothing": _class_loss(aten.cross_entropy_loss.default, label_smoothing=0.1),
    "nll_weight_ignore_3": _class_loss(aten.nll_loss_nd.default, ignore_index=3),
    "kl_div_mean": _elementwise(aten.kl_div.default, reduction=1),
    "kl_div_log_target": _elementwise(aten.kl_div.default, reduction=1, log_target=True),
    "mse_broadcast_target": _elementwise(aten.mse_loss.default, with_probs=False),
    "bce_logits_pos_weight": _elementwise(aten.binary_cross_entropy_with_logits.default, pos_weight=True),
    "huber": _elementwise(aten.huber_loss.default, delta=0.5),
}


def _hand_values(gm, ignore):
    """Random values for the graph's inputs (labels with ignored tokens) and parameters."""
    values = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        shape = [13 if isinstance(s, torch.SymInt) else s for s in node.meta["val"].shape]
        if node.meta["val"].dtype == torch.int64:
            v = torch.randint(0, V, shape)
            v[:, :6] = ignore
        elif node.name == "probs":
            v = torch.softmax(torch.randn(shape), -1) if len(shape) > 1 else torch.rand(shape)
        elif node.name == "cw":
            v = _CW.clone()
        else:
            v = torch.randn(shape)
        values[node.name] = v
    return values


@pytest.mark.parametrize("name", list(HAND_LOSSES))
def test_hand_built_mean_divides_by_its_own_divisor(hand, name):
    """Chunks of 5, 2, 3, 3 tokens (the first 6 labels ignored: a whole chunk of them)
    reproduce the full graph's mean loss."""
    loss = HAND_LOSSES[name](hand)
    gm = hand.output(loss)
    values = _hand_values(gm, 3 if name == "nll_weight_ignore_3" else -100)
    full = gm(*[values[n.name] for n in gm.graph.nodes if n.op == "placeholder"])[0]
    analyse(gm, hand.seq, hand.params)
    prog = chunk_program(gm, hand.seq, hand.params, hand.inputs)
    assert prog.reductions[0].has_count
    got = _chunked(prog, values, [values[n] for n in hand.inputs], 13, UNEQUAL)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)


def test_soft_target_divisor_counts_samples_not_elements(hand):
    """cross_entropy with probabilities divides by numel / classes (issue 26, class 2)."""
    gm = hand.output(_soft_ce(hand))
    analyse(gm, hand.seq, hand.params)
    prog = chunk_program(gm, hand.seq, hand.params, hand.inputs)
    x, w, probs = torch.randn(B, 4, D), torch.randn(V, D), torch.softmax(torch.randn(B, 4, V), -1)
    _total, count = prog.chunk(w, x, probs, 0, 4)[:2]
    assert count.item() == B * 4


def test_input_value_is_carried_by_the_first_chunk_only(hand):
    """loss * scale (a scalar input): the chunk at position 0 outputs scale, the others 0,
    so the runtime's sum over chunks is scale itself, not chunks x scale."""
    logits = hand.call(aten.transpose.int, _logits(hand), 1, 2)
    labels = hand.input("labels", (B, hand.T), torch.int64)
    scale = hand.input("scale", ())
    loss = hand.call(aten.mul.Tensor, hand.call(aten.cross_entropy_loss.default, logits, labels), scale)
    gm = hand.output(loss)
    analyse(gm, hand.seq, hand.params)
    prog = chunk_program(gm, hand.seq, hand.params, hand.inputs)
    assert [r.op for r in prog.reductions] == ["cross_entropy(mean)", "carried"]
    assert prog.reductions[1].inputs == ("scale",)
    x, w, y = torch.randn(B, 4, D), torch.randn(V, D), torch.randint(0, V, (B, 4))
    firsts = [prog.chunk(w, x, y, torch.tensor(2.5), start, 4)[2].item() for start in (0, 4)]
    assert firsts == [2.5, 0.0]


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_classes_along_the_sequence_are_refused(hand, reduction):
    """cross_entropy(logits[B, T, V], probs[B, T, V]): the class dim (1) is T, so eager
    normalises over positions; a chunk would normalise over its own slice only."""
    logits, probs = _logits(hand), hand.input("probs", (B, hand.T, V))
    loss = hand.call(aten.cross_entropy_loss.default, logits, probs, None, reduction)
    if reduction == 0:
        loss = hand.call(aten.mean.default, loss)
    gm = hand.output(loss)
    with pytest.raises(SppoError, match="classes along the sequence dimension"):
        analyse(gm, hand.seq, hand.params)


@pytest.mark.parametrize("fold", ["two_copies", "batch"])
def test_attention_over_a_folded_sequence_is_refused(hand, fold):
    """[B, 2, T, D] -> [B, 2T, D] or [B, T, D] -> [1, B*T, D] into causal attention: the
    rows are not positions 0..T-1 (issue 26, class 5)."""
    x = _logits(hand)
    t = hand.size(x, 1)
    if fold == "two_copies":
        x = hand.call(aten.stack.default, [x, x], 1)
        x = hand.call(aten.reshape.default, x, [B, hand.call(operator.mul, t, 2), V])
    else:
        x = hand.call(aten.reshape.default, x, [1, hand.call(operator.mul, t, B), V])
    q = hand.call(aten.unsqueeze.default, x, 1)
    a = hand.call(aten.scaled_dot_product_attention.default, q, q, q, None, 0.0, True)
    gm = hand.output(hand.call(aten.mean.default, a))
    with pytest.raises(SppoError, match=r"rows along the sequence dim \(-2\), not the model's sequence length"):
        analyse(gm, hand.seq, hand.params)


# ---- end to end: sppo_fx.compile(model, chunks=4, compile=False) against eager -------------

class LM(nn.Module):
    """Embedding, causal attention, linear head; `loss(logits, *rest)` makes the loss."""

    def __init__(self, loss):
        super().__init__()
        self.emb, self.head, self.loss = nn.Embedding(V, D), nn.Linear(D, V), loss

    def forward(self, ids, *rest):
        h = self.emb(ids)
        a = F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None], is_causal=True)[:, 0]
        return self.loss(self.head(h + a), *rest)


def _t(x):
    return x.transpose(1, 2)


def _data():
    ids, labels = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    labels[:, :7] = -100  # the first two chunks of UNEQUAL hold ignored labels only
    probs = torch.softmax(torch.randn(B, T, V), -1)
    return ids, labels, probs


E2E = {  # name: (loss, which data: "labels" | "probs")
    "soft_ce": (lambda l, p: F.cross_entropy(_t(l), _t(p)), "probs"),
    "soft_ce_flat": (lambda l, p: F.cross_entropy(l.flatten(0, 1), p.flatten(0, 1)), "probs"),
    "soft_ce_smoothing": (lambda l, p: F.cross_entropy(_t(l), _t(p), label_smoothing=0.1), "probs"),
    "soft_ce_weight": (lambda l, p: F.cross_entropy(_t(l), _t(p), weight=_CW), "probs"),
    "ce_weight": (lambda l, y: F.cross_entropy(_t(l), y, weight=_CW), "labels"),
    "ce_weight_smoothing": (lambda l, y: F.cross_entropy(_t(l), y, weight=_CW, label_smoothing=0.2), "labels"),
    "ce_ignore_index_5": (lambda l, y: F.cross_entropy(_t(l), y.clamp(min=0), ignore_index=5), "labels"),
    "nll_weight": (lambda l, y: F.nll_loss(F.log_softmax(_t(l), 1), y, weight=_CW), "labels"),
    "kl_div_mean": (lambda l, p: F.kl_div(F.log_softmax(l, -1), p, reduction="mean"), "probs"),
    "kl_div_batchmean": (lambda l, p: F.kl_div(F.log_softmax(l, -1), p, reduction="batchmean"), "probs"),
    "kl_div_batchmean_flat": (lambda l, p: F.kl_div(F.log_softmax(l, -1).flatten(0, 1), p.flatten(0, 1),
                                                    reduction="batchmean"), "probs"),
    "kl_div_log_target": (lambda l, p: F.kl_div(F.log_softmax(l, -1), p.log(), reduction="batchmean",
                                                log_target=True), "probs"),
    "kl_div_sum": (lambda l, p: F.kl_div(F.log_softmax(l, -1), p, reduction="sum"), "probs"),
    "mse": (lambda l, p: F.mse_loss(l, p), "probs"),
    "l1": (lambda l, p: F.l1_loss(l, p), "probs"),
    "smooth_l1": (lambda l, p: F.smooth_l1_loss(l, p, beta=0.5), "probs"),
    "huber": (lambda l, p: F.huber_loss(l, p, delta=0.5), "probs"),
    "bce": (lambda l, p: F.binary_cross_entropy(torch.sigmoid(l), p, weight=_CW), "probs"),
    "bce_logits": (lambda l, p: F.binary_cross_entropy_with_logits(l, p, pos_weight=_CW), "probs"),
    "z_loss": (lambda l, y: F.cross_entropy(_t(l), y) + 1e-2 * (torch.logsumexp(l, -1) ** 2).mean(), "labels"),
    "two_ignore_indices": (lambda l, y: F.cross_entropy(_t(l), y) + F.cross_entropy(_t(l), y.clamp(min=0),
                                                                                   ignore_index=3), "labels"),
    "sum_over_label_count": (lambda l, y: F.cross_entropy(_t(l), y, reduction="sum") / (y != -100).sum(), "labels"),
    "sum_over_clamped_count": (lambda l, y: F.cross_entropy(_t(l), y, reduction="sum")
                               / (y != -100).sum().clamp(min=1), "labels"),
    "masked_mean": (lambda l, y: (F.cross_entropy(_t(l), y.clamp(min=0), reduction="none") * (y >= 0)).sum()
                    / (y >= 0).sum(), "labels"),
}


@pytest.mark.parametrize("lengths", [UNEQUAL] * len(E2E) + [None] * 4,
                         ids=[f"{n}-unequal" for n in E2E] + [f"{n}-chunks4" for n in list(E2E)[:4]])
def test_loss_matches_eager(lengths, request):
    name = request.node.callspec.id.rsplit("-", 1)[0]
    loss, which = E2E[name]
    ids, labels, probs = _data()
    other = labels if which == "labels" else probs
    model = LM(loss)
    kw = {"chunk_lengths": lengths} if lengths else {"chunks": 4}
    compiled = sppo_fx.compile(model, compile=False, **kw)
    assert_matches_eager(model, lambda m: m(ids, other), lambda: compiled(ids, other))


class Weighted(nn.Module):
    """A loss that reads another input: a per-sample weight's mean or a scalar scale, and
    optionally a parameter with it (issue 26, class 6)."""

    def __init__(self, mode):
        super().__init__()
        self.lm, self.mode = LM(lambda l, y: F.cross_entropy(_t(l), y)), mode
        self.temp = nn.Parameter(torch.tensor(0.7))

    def forward(self, ids, labels, extra):
        loss = self.lm(ids, labels)
        if self.mode == "sample_weights":
            return loss * extra.mean()
        if self.mode == "scale":
            return loss * extra
        if self.mode == "item_count":  # Hugging Face's num_items_in_batch: a sum over a count input
            logits = self.lm.head(self.lm.emb(ids))
            return F.cross_entropy(_t(logits), labels, reduction="sum") / extra
        return loss * (extra * self.temp).exp().sum()  # input and parameter together


@pytest.mark.parametrize("mode", ["sample_weights", "scale", "with_parameter", "item_count"])
@pytest.mark.parametrize("lengths", [None, UNEQUAL], ids=["chunks4", "unequal"])
def test_loss_reading_another_input_matches_eager(mode, lengths):
    ids, labels, _ = _data()
    extra = {"scale": torch.tensor(1.7), "item_count": (labels != -100).sum()}.get(mode, torch.rand(B) + 0.5)
    model = Weighted(mode)
    kw = {"chunk_lengths": lengths} if lengths else {"chunks": 4}
    compiled = sppo_fx.compile(model, compile=False, **kw)
    assert_matches_eager(model, lambda m: m(ids, labels, extra), lambda: compiled(ids, labels, extra))


def test_loss_reading_another_input_is_refused_across_processes():
    """With stages / data or sequence parallelism the runtime sums partials over ranks: a
    carried value would be counted once per rank, so the transform refuses, naming it."""
    ids, labels, _ = _data()
    model = Weighted("sample_weights")
    cap = capture(model, None, None, (ids, labels, torch.rand(B)), {}, None, 1)
    with pytest.raises(SppoError, match="reads the input arg2 outside its reductions"):
        transform_stages(cap, 1)
    assert all(p.grad is None for p in model.parameters())


class Folded(nn.Module):
    """A reshape folds a dim into the sequence before causal attention (issue 26, class 5)."""

    def __init__(self, fold):
        super().__init__()
        self.emb, self.q, self.head, self.fold = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V), fold

    def forward(self, ids, labels):
        h = self.emb(ids)
        b, t, _ = h.shape
        if self.fold == "two_copies":
            x = torch.stack([h, self.q(h)], 1).reshape(b, 2 * t, D)
            a = F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0]
            h = h + a.reshape(b, 2, t, D).sum(1)
        else:
            x = h.reshape(1, b * t, D)
            a = F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0]
            h = h + a.reshape(b, t, D)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("skeleton", ["keep", "offload"])
@pytest.mark.parametrize("fold", ["two_copies", "batch"])
def test_attention_over_folded_sequence_is_refused_before_a_step(fold, skeleton):
    ids, labels, _ = _data()
    model = Folded(fold)
    kw = {"skeleton": "offload", "offload": "host"} if skeleton == "offload" else {}
    with pytest.raises(SppoError, match="not the model's sequence length T"):
        sppo_fx.compile(model, chunks=4, compile=False, **kw)(ids, labels.clamp(min=0))
    assert all(p.grad is None for p in model.parameters())


def test_fold_kept_token_local_still_matches_eager():
    """Folding a dim into the sequence is fine while only token-local ops see it."""
    class Merged(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.q = LM(lambda l, y: F.cross_entropy(_t(l), y)), nn.Linear(D, D)

        def forward(self, ids, labels):
            h = self.lm.emb(ids)
            b, t, _ = h.shape
            x = torch.stack([h, h * 2], 1).reshape(b, 2 * t, D)
            h = h + torch.tanh(self.q(x)).reshape(b, 2, t, D).sum(1)
            return self.lm.loss(self.lm.head(h), labels)

    ids, labels, _ = _data()
    model = Merged()
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(ids, labels), lambda: compiled(ids, labels))
