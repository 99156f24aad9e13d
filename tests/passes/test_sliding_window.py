"""Sliding-window attention: masks proven (never taken for causal), windows chunked exactly.

The regression behind this file: a window wider than the old probe lengths (3 and 8)
looked causal, and HF Mistral trained with a silently wrong loss and gradients.
"""
from __future__ import annotations

import pytest
import torch
import transformers  # a pinned test dependency: a missing install fails, not skips

import sppo_fx
from sppo_fx.chunk_attention.functions import prefix_causal_attention, windowed_causal_attention
from sppo_fx.errors import SppoError
from sppo_fx.passes import recognize_causal_masks

from conftest import assert_matches_eager

aten = torch.ops.aten


# ---------------------------------------------------------------- the prover, on hand-built graphs

def _mask_graph(hand, build_mask):
    """SDPA(q, q, q, mask) where mask = build_mask(hand, rows [T, 1], cols [1, T])."""
    ids = hand.input("ids", (1, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (7, 8)), ids)
    t = hand.size(ids, 1)
    q = hand.call(aten.transpose.int, hand.call(aten.view.default, h, [1, t, 2, 4]), 1, 2)
    rows = hand.call(aten.unsqueeze.default, hand.call(aten.arange.default, t), -1)
    cols = hand.call(aten.unsqueeze.default, hand.call(aten.arange.default, t), 0)
    a = hand.call(aten.scaled_dot_product_attention.default, q, q, q, build_mask(hand, rows, cols, t))
    return hand.output(hand.call(aten.sum.default, a))


def _window_mask(width):
    def build(hand, rows, cols, t):  # HF's form: kv_idx > q_idx - W, and kv_idx <= q_idx
        recent = hand.call(aten.gt.Tensor, cols, hand.call(aten.sub.Tensor, rows, width))
        return hand.call(aten.__and__.Tensor, recent, hand.call(aten.le.Tensor, cols, rows))
    return build


def _attention(gm):
    return next(n for n in gm.graph.nodes if n.target in (aten.scaled_dot_product_attention.default,
                                                           windowed_causal_attention))


@pytest.mark.parametrize("width", [1, 2, 16, 4096])
def test_window_wider_than_any_probe_is_a_window_not_causal(hand, width):
    gm = recognize_causal_masks(_mask_graph(hand, _window_mask(width)), hand.seq, set(hand.params),
                                lambda name: None)
    node = _attention(gm)
    assert node.target is windowed_causal_attention and node.kwargs["window"] == width
    assert aten.gt.Tensor not in {n.target for n in gm.graph.nodes}


def test_additive_window_mask_is_a_window(hand):
    def build(hand, rows, cols, t):
        visible = _window_mask(5)(hand, rows, cols, t)
        return hand.call(aten.where.self, visible, hand.call(aten.scalar_tensor.default, 0.0),
                         hand.call(aten.scalar_tensor.default, float("-inf")))
    gm = recognize_causal_masks(_mask_graph(hand, build), hand.seq, set(hand.params), lambda name: None)
    assert _attention(gm).kwargs["window"] == 5


def test_plain_causal_mask_stays_sdpa_is_causal(hand):
    gm = recognize_causal_masks(_mask_graph(hand, lambda h, r, c, t: h.call(aten.le.Tensor, c, r)),
                                hand.seq, set(hand.params), lambda name: None)
    node = _attention(gm)
    assert node.target is aten.scaled_dot_product_attention.default and node.args[5] is True


def _refused(hand, build):
    with pytest.raises(SppoError, match="not the causal mask or a sliding window"):
        recognize_causal_masks(_mask_graph(hand, build), hand.seq, set(hand.params), lambda name: None)


@pytest.mark.parametrize("name,build", [
    ("no diagonal", lambda h, r, c, t: h.call(aten.lt.Tensor, c, r)),
    ("anti-causal", lambda h, r, c, t: h.call(aten.ge.Tensor, c, r)),
    ("holes", lambda h, r, c, t: h.call(aten.ne.Tensor, c, r)),
    ("first keys only", lambda h, r, c, t: h.call(aten.__and__.Tensor, h.call(aten.le.Tensor, c, r),
                                                  h.call(aten.lt.Scalar, c, 5))),
    ("depends on T", lambda h, r, c, t: h.call(aten.__and__.Tensor, h.call(aten.le.Tensor, c, r),
                                               h.call(aten.gt.Tensor, c, h.call(aten.sub.Tensor, r, t)))),
    ("a disjunction", lambda h, r, c, t: h.call(aten.__or__.Tensor, h.call(aten.le.Tensor, c, r),
                                                h.call(aten.eq.Scalar, c, 0))),
    ("offset window", lambda h, r, c, t: h.call(aten.__and__.Tensor, h.call(aten.le.Tensor, c, r),
                                                h.call(aten.lt.Tensor, h.call(aten.add.Tensor, c, 1),
                                                       h.call(aten.sub.Tensor, r, 2)))),
])
def test_almost_causal_masks_are_refused(hand, name, build):
    _refused(hand, build)


def test_additive_mask_with_other_values_is_refused(hand):
    def build(hand, rows, cols, t):
        return hand.call(aten.where.self, hand.call(aten.le.Tensor, cols, rows),
                         hand.call(aten.scalar_tensor.default, 0.0), hand.call(aten.scalar_tensor.default, -1.0))
    _refused(hand, build)


# ---------------------------------------------------------------- the chunk attention op

@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("prefix,chunk", [(0, 6), (5, 6), (20, 6), (20, 11)])
def test_windowed_prefix_attention_equals_the_windowed_rows_of_the_full_attention(window, prefix, chunk):
    b, h, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, h, prefix + chunk, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, prefix + chunk, d, dtype=torch.float64) for _ in range(2))
    full = windowed_causal_attention(q, k, v, window, enable_gqa=True)[..., prefix:, :]
    out = prefix_causal_attention(q[..., prefix:, :], k[..., :prefix, :], k[..., prefix:, :],
                                  v[..., :prefix, :], v[..., prefix:, :], enable_gqa=True, window=window)
    torch.testing.assert_close(out, full)
    # and the window is not a no-op here: plain causal attention differs once keys fall out
    if prefix + chunk > window:
        causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert not torch.allclose(full, causal[..., prefix:, :])


# ---------------------------------------------------------------- Hugging Face families with windows

def _family(name, window, layers=2):
    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    if name == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **common))
    if name == "qwen2":
        cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=0,
                                       layer_types=["sliding_attention"] * layers, **common)
        return transformers.Qwen2ForCausalLM(cfg)
    if name == "gemma2":
        cfg = transformers.Gemma2Config(sliding_window=window, attn_logit_softcapping=None,
                                        final_logit_softcapping=None, **common)
        return transformers.Gemma2ForCausalLM(cfg)
    if name == "gemma3":
        cfg = transformers.Gemma3TextConfig(sliding_window=window, sliding_window_pattern=2,
                                            layer_types=["sliding_attention", "full_attention"][:layers], **common)
        return transformers.Gemma3ForCausalLM(cfg)
    raise ValueError(name)


def _has_window(model) -> bool:
    cfg = model.config
    return any(t == "sliding_attention" for t in (getattr(cfg, "layer_types", None) or [])) or \
        (cfg.model_type == "mistral" and cfg.sliding_window is not None)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_every_windowed_family_matches_eager(family, impl):
    """T = 48 > window = 12: a window taken for causal would differ from eager."""
    model = _family(family, window=12)
    model.config._attn_implementation = impl
    assert _has_window(model), f"{family}: the config has no sliding window; the test would prove nothing"
    ids = torch.randint(0, 101, (1, 48))
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert 12 in [site.window for site in compiled.program.attention]


@pytest.mark.parametrize("lengths", [[8, 8, 8, 8, 8, 8], [16, 16, 16], [30, 18], [5, 20, 3, 20]])
def test_mistral_window_exact_for_chunks_shorter_equal_and_longer_than_the_window(lengths):
    model = _family("mistral", window=16)
    ids = torch.randint(0, 101, (2, sum(lengths)))
    compiled = sppo_fx.compile(model, chunk_lengths=lengths, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert [s.window for s in compiled.program.attention] == [16, 16]


@pytest.mark.slow
def test_mistral_window_compiled_by_inductor():
    model = _family("mistral", window=10, layers=1)
    ids = torch.randint(0, 101, (1, 40))
    compiled = sppo_fx.compile(model, chunks=4)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert "window" in compiled.graphs["chunk"].code


def test_window_prefix_and_its_gradients_stay_within_the_window(monkeypatch):
    """Each chunk reads (and sends gradients to) only the last W-1 earlier positions."""
    from sppo_fx.runtime.local import StageRunner
    prefixes, grads = [], []
    prefix_of = StageRunner._prefix

    def recording_prefix(self, mb, i):
        out = prefix_of(self, mb, i)
        prefixes.append([t.shape[-2] for t in out])
        for t in out:
            t.register_hook(lambda g: grads.append(g.shape[-2]) or g)
        return out

    monkeypatch.setattr(StageRunner, "_prefix", recording_prefix)
    model = _family("mistral", window=8, layers=1)
    ids = torch.randint(0, 101, (1, 48))
    compiled = sppo_fx.compile(model, chunks=8, compile=False)  # chunks of 6 tokens
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert prefixes == [[0, 0]] + [[min(6 * i, 7)] * 2 for i in range(1, 8)]
    assert grads and max(grads) <= 7


@pytest.mark.slow
def test_window_skeleton_bytes_do_not_grow_with_the_sequence(monkeypatch):
    """T = 4W and 16W, same chunks: the K/V skeleton held at the end of the forward (its
    peak: the backward only frees it) is the same for a windowed model, while a causal one's
    grows with T (the measurement sees a skeleton when there is one); losses and gradients
    still equal eager's."""
    from sppo_fx.runtime.local import StageRunner
    held = {}
    finish = StageRunner.finish_forward

    def recording_finish(self, mb):
        held[(self.program.attention[0].window, self.plan.seq_len)] = self.skeleton_bytes(mb)
        return finish(self, mb)

    monkeypatch.setattr(StageRunner, "finish_forward", recording_finish)
    window, chunk = 8, 8
    for w in (window, None):
        model = _family("mistral", window=w, layers=1)
        for t in (4 * window, 16 * window):
            ids = torch.randint(0, 101, (2, t))
            compiled = sppo_fx.compile(model, chunk_lengths=[chunk] * (t // chunk), compile=False)
            assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                                 lambda: compiled(input_ids=ids, labels=ids))
            assert [s.window for s in compiled.program.attention] == [w]
    causal_short, causal_long = held[(None, 4 * window)], held[(None, 16 * window)]
    assert causal_short > 0 and causal_long == 4 * causal_short
    assert held[(window, 16 * window)] == held[(window, 4 * window)] < causal_short


def test_window_copies_counted_where_the_window_reaches_past_the_previous_chunk():
    """`copy_rows` decides between per-chunk window copies and one full buffer."""
    from sppo_fx.util.skeleton_rows import copy_rows, window_firsts

    def rows(lengths, window):
        bounds = [(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(len(lengths))]
        return copy_rows(bounds, window_firsts(bounds, window))
    assert rows([8] * 4, 8) == 0  # every window lies inside the previous chunk: views
    assert rows([4] * 4, 8) == 7 + 7  # chunks 2 and 3 read 7 rows over two chunks
    assert rows([5, 20, 3, 20], 16) == 15  # only the chunk after the 3-token one


# ---------------------------------------------------------------- the memory model knows the bounded skeleton

def _skeleton_measured_and_predicted(window, plans):
    """Per chunk lengths: (the K/V skeleton `StageRunner.skeleton_bytes` measures at the end
    of a training step's forward, the memory model's `kept_skeleton_bytes`), and the model."""
    from sppo_fx.runtime.local import StageRunner
    from sppo_fx.solver.memory_model import kept_skeleton_bytes, memory_models
    measured = {}
    finish = StageRunner.finish_forward

    def recording_finish(self, mb):
        measured[tuple(self.plan.chunk_lengths)] = self.skeleton_bytes(mb)
        return finish(self, mb)

    model = _family("mistral", window=window, layers=1)
    compiled = sppo_fx.compile(model, chunk_lengths=plans[0], compile=False)
    StageRunner.finish_forward = recording_finish
    try:
        for lengths in plans:  # one capture: the entry serves every sequence length
            compiled.options.chunk_lengths = lengths
            ids = torch.randint(0, 101, (2, sum(lengths)))
            compiled(input_ids=ids, labels=ids).backward()
    finally:
        StageRunner.finish_forward = finish
    entry = compiled._require_entry()
    assert [s.window for s in entry.program.attention] == [window]
    params = [entry.captured.param_value(n) for n in entry.program.params]
    (memory,) = memory_models(entry.program, entry.captured.seq, params, ("none",))
    return {tuple(ls): (measured[tuple(ls)], kept_skeleton_bytes(memory, ls)) for ls in plans}, memory, entry


W_MODEL, VIEWS, LONG_VIEWS, COPIES, SHORT = 8, [8] * 4, [8] * 16, [5, 20, 3, 4], [4] * 8


# the tests that use `windowed_skeleton` run on one xdist worker (--dist loadgroup): it is built once
ON_ONE_WORKER = pytest.mark.xdist_group("windowed_skeleton")


@pytest.fixture(scope="module")
def windowed_skeleton():
    """The windowed model (W = 8) run and modelled once for the tests below."""
    return _skeleton_measured_and_predicted(W_MODEL, [VIEWS, LONG_VIEWS, COPIES, SHORT])


@ON_ONE_WORKER
@pytest.mark.slow
def test_predicted_skeleton_bytes_equal_the_runtime_and_stay_bounded_by_the_window(windowed_skeleton):
    """The memory model's kept skeleton equals what the runtime holds, byte for byte, in
    each case of `skeleton_rows.keeps_no_buffer`: chunks of W (views: nothing kept, at T = 4W
    and 16W alike), chunks whose windows reach two chunks back but copy fewer rows than T
    (the copies), and chunks so short that the copies would pass T (the full buffer). The
    causal control's prediction grows with T, as its measurement does."""
    views, long_views, copies, short = VIEWS, LONG_VIEWS, COPIES, SHORT
    windowed, _, _ = windowed_skeleton
    causal, _, _ = _skeleton_measured_and_predicted(None, [views, long_views])
    for case in (windowed, causal):
        for lengths, (measured, predicted) in case.items():
            assert predicted == measured, (lengths, predicted, measured)
    assert windowed[tuple(views)][1] == windowed[tuple(long_views)][1] == 0
    assert 0 < windowed[tuple(copies)][1] < causal[tuple(views)][1]  # 7 rows copied, not 32
    assert windowed[tuple(short)][1] == causal[tuple(views)][1]  # 42 rows of copies >= 32: the buffer
    assert causal[tuple(long_views)][1] == 4 * causal[tuple(views)][1] > 0


@ON_ONE_WORKER
def test_budget_solver_plans_a_windowed_model_below_the_full_skeleton_minimum(windowed_skeleton):
    """At T = 16W the solver fits a windowed model into a budget a whole K/V buffer below the
    least any plan needs when its skeleton is counted as a full-sequence buffer (the old
    accounting: the same model without its windowed sites). The smaller dK/dV of a window
    alone would not get there."""
    import dataclasses
    from sppo_fx.errors import InfeasibleBudget
    from sppo_fx.solver.budget import solve
    from sppo_fx.solver.memory_model import kept_skeleton_bytes, predict_peak
    _, memory, entry = windowed_skeleton
    full_accounting = dataclasses.replace(memory, windowed=())
    t, counts = 16 * W_MODEL, [4, 8, 16]  # chunks of W or more: no buffer, no copies
    kw = dict(rate=1e9, bandwidth=1e9, chunk_counts=counts)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(entry.cost, full_accounting, t, 1, **kw)
    buffer = kept_skeleton_bytes(full_accounting, [t // 4] * 4)
    assert buffer > 0 and all(kept_skeleton_bytes(memory, [t // n] * n) == 0 for n in counts)
    budget = refused.value.minimum_bytes - buffer
    chosen = solve(entry.cost, memory, t, budget, **kw)
    assert chosen.peak_bytes <= budget
    assert predict_peak(memory, chosen.lengths, chosen.ratios, "keep", chosen.copy_window_bytes) <= budget
