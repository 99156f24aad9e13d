"""Packed documents: several documents in one sequence, attention only inside each.

Conventions: Hugging Face's (`position_ids` restarting at each document, no attention
mask, no cache: masking_utils then masks across documents) and a model's own document-id
tensor (`doc[:, :, None] == doc[:, None, :]` and causal). Each is proven (passes/
passes/masks/document.py) and chunked exactly: loss and every gradient equal eager's, with
documents crossing chunk boundaries, several inside one chunk, and documents of one token.
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers  # a pinned test dependency: a missing install fails, not skips
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx.chunk_attention.functions import document_causal_attention, document_positions, prefix_causal_attention
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager, record_skeleton_traffic


# 48 tokens in chunks of 12: documents cross chunk boundaries (0-9 | 10-23 spans two), several
# lie inside one chunk (24, 25-39 starts there), one-token documents (24, and 47 at the end)
LENGTHS = [[10, 14, 1, 15, 7, 1], [3, 1, 1, 30, 13]]


def _positions(rows) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _doc_ids(rows) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in rows])


def _hf(family: str, impl: str, window=None, layers: int = 2):
    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **common))
    model.config._attn_implementation = impl
    return model


def _per_document_logits(model, ids, rows):
    """The reference the documents must reproduce: each document run on its own."""
    out = []
    for b, row in enumerate(rows):
        starts = [sum(row[:k]) for k in range(len(row))]
        out.append(torch.cat([model(input_ids=ids[b:b + 1, s:s + n], use_cache=False).logits
                              for s, n in zip(starts, row)], 1))
    return torch.cat(out)


# ---------------------------------------------------------------- Hugging Face: position_ids

@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_packed_position_ids_match_eager(impl):
    torch.manual_seed(0)
    model = _hf("llama", impl)
    ids = torch.randint(0, 101, (2, 48))
    pos = _positions(LENGTHS)
    kw = dict(input_ids=ids, labels=ids, position_ids=pos, use_cache=False)
    with torch.no_grad():  # eager HF does mask across documents here: the case is not causal
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(packed, _per_document_logits(model, ids, LENGTHS), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(packed, model(input_ids=ids, use_cache=False).logits, atol=1e-3)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(**kw).loss, lambda: compiled(**kw))
    assert all(site.documents for site in compiled.program.attention)


def test_hf_packed_with_a_sliding_window_matches_eager():
    """Mistral: window 6 inside documents up to 30 tokens, chunks of 7/12/19/10 tokens."""
    torch.manual_seed(1)
    model = _hf("mistral", "sdpa", window=6)
    ids = torch.randint(0, 101, (2, 48))
    kw = dict(input_ids=ids, labels=ids, position_ids=_positions(LENGTHS), use_cache=False)
    compiled = sppo_fx.compile(model, chunk_lengths=[7, 12, 19, 10], compile=False)
    assert_matches_eager(model, lambda m: m(**kw).loss, lambda: compiled(**kw))
    assert [(s.window, bool(s.documents)) for s in compiled.program.attention] == [(6, True)] * 2


def test_hf_without_cache_and_without_position_ids_is_causal():
    """use_cache=False alone (no packing) makes HF build its packed-sequence mask from
    arange positions: proven to be the plain causal mask, not refused."""
    torch.manual_seed(2)
    model = _hf("llama", "sdpa")
    ids = torch.randint(0, 101, (1, 32))
    kw = dict(input_ids=ids, labels=ids, use_cache=False)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(**kw).loss, lambda: compiled(**kw))
    assert [(s.window, s.documents) for s in compiled.program.attention] == [(None, None)] * 2


def test_hf_packed_with_its_default_cache_attends_across_documents_as_eager_does():
    """With use_cache left on, HF skips packed-sequence detection (a cache is present) and
    its eager model attends across documents; sppo_fx matches that eager model."""
    torch.manual_seed(3)
    model = _hf("llama", "sdpa", layers=1)
    ids = torch.randint(0, 101, (1, 48))
    pos = _positions(LENGTHS[:1])
    kw = dict(input_ids=ids, labels=ids, position_ids=pos)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits
        assert not torch.allclose(packed, _per_document_logits(model, ids, LENGTHS[:1]), atol=1e-3)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(**kw).loss, lambda: compiled(**kw))
    assert [s.documents for s in compiled.program.attention] == [None]


def test_hf_padding_attention_mask_is_refused():
    model = _hf("llama", "sdpa", layers=1)
    ids = torch.randint(0, 101, (2, 24))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0  # an all-ones mask is accepted (tests/passes/test_ones_inputs.py); padding is not
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    with pytest.raises(SppoError, match="depends on the input"):
        compiled(input_ids=ids, labels=ids, attention_mask=padded, use_cache=False)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- a model's own document ids

class DocAttention(nn.Module):
    def __init__(self, dim=32, heads=4, explicit=False, window=None):
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.explicit, self.window = heads, explicit, window

    def forward(self, x, doc):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        i = torch.arange(t, device=x.device)
        allowed = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])
        if self.window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < self.window)
        if self.explicit:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(~allowed[:, None], float("-inf"))
            y = att.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class DocModel(nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.emb, self.head = nn.Embedding(101, 32), nn.Linear(32, 101)
        self.blocks = nn.ModuleList(DocAttention(**kw) for _ in range(layers))

    def forward(self, ids, doc, targets):
        x = self.emb(ids)
        for blk in self.blocks:
            x = x + blk(x, doc)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_document_ids_match_eager(explicit, window):
    torch.manual_seed(4)
    model = DocModel(explicit=explicit, window=window)
    ids, doc = torch.randint(0, 101, (2, 48)), _doc_ids(LENGTHS)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
    assert [(s.window, bool(s.documents)) for s in compiled.program.attention] == [(window, True)] * 2


def test_document_ids_reused_after_another_document_are_refused_before_the_step():
    """doc == doc attends between equal ids wherever they are: [0, 0, 1, 1, 0] lets the last
    token see the first two. That is not document attention; refused, nothing trained."""
    model = DocModel(layers=1)
    ids = torch.randint(0, 101, (1, 24))
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    compiled(ids, _doc_ids([[12, 12]]), ids).backward()  # contiguous ids: fine
    model.zero_grad(set_to_none=True)
    reused = torch.tensor([[0] * 8 + [1] * 8 + [0] * 8])
    with pytest.raises(SppoError, match="reuse an id"):
        compiled(ids, reused, ids)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name,build", [
    ("no same-document term", lambda doc, i: i[None, :] <= i[:, None]),  # the plain causal case
    ("documents see each other", lambda doc, i: (doc[:, :, None] >= doc[:, None, :]) & (i[None, :] <= i[:, None])),
    ("other documents visible", lambda doc, i: (doc[:, :, None] == doc[:, None, :]) | (i[None, :] <= i[:, None])),
    ("keys after the query", lambda doc, i: doc[:, :, None] == doc[:, None, :]),
    ("flipped", lambda doc, i: ((doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])).flip(-1)),
])
def test_masks_that_are_not_document_causal_are_refused_or_plain(name, build):
    class M(DocModel):
        def forward(self, ids, doc, targets):
            x = self.emb(ids)
            b, t, c = x.shape
            q = x.view(b, t, 4, 8).transpose(1, 2)
            allowed = build(doc, torch.arange(t))
            allowed = allowed if allowed.dim() == 3 else allowed.expand(b, t, t)
            y = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed.unsqueeze(1))
            return F.cross_entropy(self.head(y.transpose(1, 2).reshape(b, t, c)).flatten(0, 1), targets.flatten())

    model = M(layers=0)
    ids, doc = torch.randint(0, 101, (2, 24)), _doc_ids([[10, 14], [5, 19]])
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    if name == "no same-document term":
        assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
        return
    with pytest.raises(SppoError, match="not provably causal attention inside packed documents"):
        compiled(ids, doc, ids)


def test_position_comparison_under_other_document_ids_is_refused():
    """pos[k] <= pos[q] means "causal" only inside runs where pos steps by 1: combined
    with another tensor's document ids nothing says it is causal."""
    class M(DocModel):
        def forward(self, ids, doc, pos, targets):
            x = self.emb(ids)
            b, t, c = x.shape
            q = x.view(b, t, 4, 8).transpose(1, 2)
            allowed = (doc[:, :, None] == doc[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
            y = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed.unsqueeze(1))
            return F.cross_entropy(self.head(y.transpose(1, 2).reshape(b, t, c)).flatten(0, 1), targets.flatten())

    model = M(layers=0)
    ids = torch.randint(0, 101, (1, 24))
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    with pytest.raises(SppoError, match="different document splits"):
        compiled(ids, _doc_ids([[10, 14]]), _positions([[10, 14]]), ids)


class PositionsModel(DocModel):
    """Hugging Face's packed mask from `pos` in the dtype it is given: same run of +1 steps
    (cumsum of diff != 1) and pos[k] <= pos[q]."""

    def forward(self, ids, pos, targets):
        x = self.emb(ids)
        b, t, c = x.shape
        q = x.view(b, t, 4, 8).transpose(1, 2)
        seg = torch.cumsum(torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1, -1)
        allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
        y = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed.unsqueeze(1))
        return F.cross_entropy(self.head(y.transpose(1, 2).reshape(b, t, c)).flatten(0, 1), targets.flatten())


def test_narrow_position_ids_that_wrap_inside_a_document_are_refused():
    """int8 positions 100..147 wrap to -128 after 127: the step test (in int8) keeps one
    document, but pos[k] <= pos[q] no longer orders it. Refused before the step."""
    model = PositionsModel(layers=0)
    ids, pos = torch.randint(0, 101, (1, 48)), torch.arange(100, 148).view(1, 48)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(ids, pos, ids), lambda: compiled(ids, pos, ids))  # int64: exact
    narrow = pos.to(torch.int8)
    with pytest.raises(SppoError, match="torch.int8 and wraps"):
        sppo_fx.compile(model, chunks=4, compile=False)(ids, narrow, ids)
    assert all(p.grad is None for p in model.parameters())


def test_narrow_document_ids_are_compared_exactly():
    """Equal ids stay equal in any integer dtype: int16 document ids train exactly."""
    torch.manual_seed(4)
    model = DocModel(layers=1)
    ids, doc = torch.randint(0, 101, (2, 48)), _doc_ids(LENGTHS).to(torch.int16)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
    assert [bool(s.documents) for s in compiled.program.attention] == [True]


# ---------------------------------------------------------------- the chunk attention op and the skip

def test_document_positions_conventions():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6]])
    assert document_positions(pos, "position_ids").tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    doc = torch.tensor([[7, 7, 7, 2, 3, 3, 3, 9]])
    assert document_positions(doc, "document_ids").tolist() == [[0, 1, 2, 0, 0, 1, 2, 0]]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("prefix,cut", [(0, 0), (12, 0), (12, 5), (20, 9)])
def test_prefix_attention_inside_documents_equals_the_full_rows(window, prefix, cut):
    """A chunk at `prefix` with its prefix cut at `cut` (the runtime's skip) equals those rows
    of the full document attention, as long as no document of the chunk starts before `cut`."""
    torch.manual_seed(5)
    pos = _positions([[5, 4, 1, 14, 8]])  # documents start at 0, 5, 9, 10, 24
    doc_pos = document_positions(pos, "position_ids")
    q = torch.randn(1, 4, 32, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 32, 8, dtype=torch.float64) for _ in range(2))
    full = document_causal_attention(q, k, v, doc_pos, window=window, enable_gqa=True)
    c = 8
    sl = slice(prefix, prefix + c)
    assert int((torch.arange(32) - doc_pos[0])[prefix]) >= cut or prefix == 0
    out = prefix_causal_attention(q[..., sl, :], k[..., cut:prefix, :], k[..., sl, :], v[..., cut:prefix, :],
                                  v[..., sl, :], enable_gqa=True, window=window, doc_pos=doc_pos[:, sl])
    torch.testing.assert_close(out, full[..., sl, :])
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(full, causal)


def test_chunks_skip_the_documents_that_ended_before_them(monkeypatch):
    """Each chunk's prefix (and its gradient) starts at the document of its first token,
    the earliest over the batch rows."""
    from sppo_fx.runtime.local import StageRunner
    prefixes, grads = [], []
    prefix_of = StageRunner._prefix

    def recording_prefix(self, mb, i):
        out = prefix_of(self, mb, i)
        prefixes.append(out[0].shape[-2])
        for t in out:
            t.register_hook(lambda g: grads.append(g.shape[-2]) or g)
        return out

    monkeypatch.setattr(StageRunner, "_prefix", recording_prefix)
    model = DocModel(layers=1)
    ids = torch.randint(0, 101, (2, 48))
    rows = [[10, 14, 1, 15, 7, 1], [3, 1, 1, 30, 13]]  # row 1: a document 5..34
    doc = _doc_ids(rows)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)  # chunks at 0, 12, 24, 36
    assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
    # chunk 1 (12): row 0's document starts at 10, row 1's at 5 -> 7 tokens; chunk 2 (24):
    # row 0 at 24, row 1 at 5 -> 19; chunk 3 (36): row 0 at 25, row 1 at 35 -> 11
    assert prefixes == [0, 7, 19, 11]
    assert grads and max(grads) <= 19


def test_skeleton_keeps_no_finished_documents(monkeypatch):
    """The K/V skeleton held at the end of the forward (`StageRunner.skeleton_bytes`) keeps
    no rows of documents that ended before a chunk: with documents that each fit a chunk it
    holds nothing, at T = 48 and 192 alike, where one long document keeps the whole
    sequence; with LENGTHS' documents (chunk 2 reads row 1's document from position 5)
    only that chunk's 19 rows are copied, not 48. Losses and gradients equal eager's."""
    from sppo_fx.runtime.local import StageRunner
    held = []
    finish = StageRunner.finish_forward

    def recording_finish(self, mb):
        held.append(self.skeleton_bytes(mb))
        return finish(self, mb)

    monkeypatch.setattr(StageRunner, "finish_forward", recording_finish)
    model = DocModel(layers=1)
    compiled = sppo_fx.compile(model, chunk_lengths=[12] * 4, compile=False)
    measured = {}
    for name, t, rows in [("short", 48, [[6] * 8] * 2), ("short", 192, [[6] * 32] * 2),
                          ("one", 48, [[48]] * 2), ("one", 192, [[192]] * 2), ("mixed", 48, LENGTHS)]:
        compiled.options.chunk_lengths = [12] * (t // 12)
        ids, doc = torch.randint(0, 101, (2, t)), _doc_ids(rows)
        assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
        measured[(name, t)] = held[-1]
    assert measured[("short", 48)] == measured[("short", 192)] == 0
    assert measured[("one", 192)] == 4 * measured[("one", 48)] > 0
    assert measured[("mixed", 48)] * 48 == measured[("one", 48)] * 19


# ---------------------------------------------------------------- the streamed skeleton

@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 5])
def test_streamed_skeleton_reads_only_the_documents_a_chunk_sees(window, tmp_path, monkeypatch):
    """skeleton="offload": exact, and each chunk streams back only the rows from its first
    token's document on (as `test_chunks_skip_the_documents_that_ended_before_them` reads
    them from the kept skeleton: 0, 7, 19, 11 rows; fewer with a window of 5), a block
    stores only the rows a later chunk reads, and documents that each fit a chunk are
    neither stored nor read."""
    reads, peaks = record_skeleton_traffic(monkeypatch)
    torch.manual_seed(5)
    model = DocModel(layers=1, window=window)
    compiled = sppo_fx.compile(model, chunk_lengths=[12] * 4, compile=False, offload="disk", skeleton="offload",
                               offload_dir=str(tmp_path))
    row = 2 * 2 * 4 * 8 * 4  # K and V of one position: batch 2, 4 heads, head dim 8, float32
    for rows, expected_reads, expected_stored in [
            (LENGTHS, [0, 7, 19, 11] if window is None else [0, 4, 4, 4], [7, 12, 11] if window is None else [4] * 3),
            ([[6] * 8] * 2, [0] * 4, [0] * 3)]:
        reads.clear()
        ids, doc = torch.randint(0, 101, (2, 48)), _doc_ids(rows)
        assert_matches_eager(model, lambda m: m(ids, doc, ids), lambda: compiled(ids, doc, ids))
        assert reads == [r * row for r in expected_reads]
        assert peaks[-1] == sum(expected_stored) * row
    assert [(s.window, bool(s.documents)) for s in compiled.program.attention] == [(window, True)]
    assert compiled.store.bytes_offloaded == 0


# ---------------------------------------------------------------- pipeline stages

def test_documents_in_pipeline_stages_compose_to_the_eager_model():
    """Each stage's prologue computes the document positions its attention reads."""
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform_stages
    from sppo_fx.plan import Plan
    from test_stage_split import _run_stages
    torch.manual_seed(7)
    model = DocModel(layers=2)
    ids, doc = torch.randint(0, 101, (2, 48)), _doc_ids(LENGTHS)
    cap = capture(model, None, None, (ids, doc, ids), {}, None, 1)
    _, _, programs = transform_stages(cap, 2)
    assert [[bool(s.documents) for s in p.attention] for p in programs] == [[True], [True]]
    loss, grads = _run_stages(cap, programs, [ids, doc, ids], Plan(48, [7, 12, 19, 10]))
    ref = model(ids, doc, ids)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[id(p)], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_documents_refuse_sequence_parallelism_at_the_pass():
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform
    from sppo_fx.passes.sequence_parallel import shard_attention_heads
    model = DocModel(layers=1)
    ids = torch.randint(0, 101, (1, 24))
    cap = capture(model, None, None, (ids, _doc_ids([[10, 14]]), ids), {}, None, 1)
    with pytest.raises(SppoError, match="packed documents, which seq_parallel=2 does not support"):
        shard_attention_heads(transform(cap)[1], 2, "g")
