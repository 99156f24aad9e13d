"""Hugging Face decoder families trained exactly in chunks (loss and every gradient vs eager).

Each family is built from a tiny config (2 layers, hidden 32, vocab 100, T = 64, 4 chunks)
with its default attention implementation (None: SDPA for most families, eager for
Gemma 2, whose HF code has no SDPA path) and with attn_implementation="eager" (written-out
attention, recognised by passes/masks/explicit_attention.py). compile=False throughout: these
tests check the graph passes and the runtime, not Inductor (covered by test_codegen.py),
and Inductor would multiply the file's time. Sliding windows are disabled or set >= T here;
windows shorter than T are the subject of their own tests.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager

T, BATCH, CHUNKS, VOCAB = 64, 2, 4, 100
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FULL = ["full_attention"] * 2

FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, BASE),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(BASE, sliding_window=None)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(BASE, use_sliding_window=False)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(BASE, head_dim=8)),
    # attention soft-capping off here (on: tests/e2e/test_hf_families_attn.py); final-logit soft-capping on
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
               dict(BASE, head_dim=8, sliding_window=128, layer_types=FULL, attn_logit_softcapping=None)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               dict(BASE, head_dim=8, sliding_window=128, layer_types=FULL)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(BASE, pad_token_id=0)),
    # dropout off: attention dropout in training is refused, see test_explicit_attention.py
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, BASE),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, BASE),
    # fused QKV split by indexing the head dim (an index op that picks along hidden dims)
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM,
               dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    attention_dropout=0.0, hidden_dropout=0.0)),
    # rotary sin/cos gathered from a table by position ids
    "gptj": (tf.GPTJConfig, tf.GPTJForCausalLM,
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4,
                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    # rotary frequencies interleaved along the head dim (repeat_interleave)
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, BASE),
}


def build(family, attn_implementation=None, **overrides):
    config_cls, model_cls, kwargs = FAMILIES[family]
    kwargs = dict(kwargs, **overrides)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs))


def _ids():
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(0))


# family -> (attention implementation, what the refusal names): refused with a clear error
REFUSED = {}  # (Falcon's written-out attention is proven since issue 30: tests/e2e/test_falcon.py)


@pytest.mark.parametrize("attn", [None, "eager"], ids=["default", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_exactly_in_chunks(family, attn):
    model = build(family, attn)
    ids = _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    if (family, attn) in REFUSED:
        with pytest.raises(SppoError, match=REFUSED[family, attn]):
            compiled(input_ids=ids, labels=ids)
        assert all(p.grad is None for p in model.parameters())  # refused before any step
        return
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert len(compiled.program.attention) == 2  # both layers' attention chunked, none dropped


@pytest.mark.parametrize("family, window", [("mistral", {"sliding_window": 16}),
                                            ("gemma3", {"sliding_window": 16, "layer_types": None})])
def test_eager_sliding_window_shorter_than_t_matches_eager(family, window):
    # written-out attention with a window mask: proven a window, chunked exactly
    model = build(family, "eager", **window)
    ids = _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    assert_matches_eager(model, lambda m: m(input_ids=ids, labels=ids).loss,
                         lambda: compiled(input_ids=ids, labels=ids))
    assert 16 in [site.window for site in compiled.program.attention]
