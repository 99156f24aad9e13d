"""An all-ones `attention_mask` (unpadded batches, what HF Trainer passes): treated as constant
ones (passes/ones_inputs.py) and guarded at every call (mask_values.check_ones_inputs).

Each family trains exactly with attention_mask=ones; a later call with padding is refused
before any step, leaving the earlier results and no gradient; a mask that is not all ones
at capture, or `ones_inputs=()`, keeps the refusal of a mask as data.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError

from conftest import assert_matches_eager, eager_loss_and_grads

T, BATCH, CHUNKS, VOCAB = 32, 2, 4, 100

FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0, hidden_dropout=0.0)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0,
        hidden_dropout=0.0)),
}


def _model(family):
    torch.manual_seed(0)
    return FAMILIES[family]()


def _ids():
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(0))


def _padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    return mask


def _largest_relative_grad_diff(model, ref):
    """Over parameters whose eager gradient is not zero up to rounding (OPT's key biases:
    softmax ignores them, their gradients are ~1e-11 noise in both)."""
    top = max(float(g.abs().max()) for g in ref.values())
    return max(float((p.grad - ref[n]).abs().max() / ref[n].abs().max())
               for n, p in model.named_parameters() if n in ref and float(ref[n].abs().max()) > 1e-7 * top)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_ones_mask_trains_exactly_and_a_padded_call_is_refused_before_any_step(family):
    model, ids = _model(family), _ids()
    call = dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    _, ref = eager_loss_and_grads(model, lambda m: m(**call).loss)
    loss = assert_matches_eager(model, lambda m: m(**call).loss, lambda: compiled(**call)).detach()
    assert compiled.graphs["captured"].meta["sppo_ones_inputs"]  # specialised: the guard is armed
    compiled(**call).backward()  # the largest relative gradient difference, for the docs (-s shows it)
    print(f"\n{family} attention_mask=ones: largest relative grad diff {_largest_relative_grad_diff(model, ref):.2e}")
    model.zero_grad(set_to_none=True)
    plan = compiled.plan
    with pytest.raises(SppoError, match="attention_mask was all ones.*5 of its 64 values are not 1"):
        compiled(input_ids=ids, labels=ids, attention_mask=_padded(ids))
    assert all(p.grad is None for p in model.parameters())
    assert compiled.plan is plan
    torch.testing.assert_close(compiled(**call).detach(), loss, rtol=0, atol=0)  # the program is intact


def test_a_mask_not_all_ones_at_capture_keeps_the_refusal():
    model, ids = _model("llama"), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    with pytest.raises(SppoError, match="attention mask depends on the input"):
        compiled(input_ids=ids, labels=ids, attention_mask=_padded(ids))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_ones_inputs_off_keeps_the_refusal_of_an_all_ones_mask(family):
    model, ids = _model(family), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False, ones_inputs=())
    with pytest.raises(SppoError, match="attention mask"):
        compiled(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    assert all(p.grad is None for p in model.parameters())


def test_a_padded_micro_batch_is_refused_before_the_first_backward():
    model, ids = _model("llama"), torch.cat([_ids(), _ids()])
    mask = torch.ones_like(ids)
    mask[3, :4] = 0  # only the second micro-batch is padded
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False, microbatches=2)
    with pytest.raises(SppoError, match="attention_mask was all ones"):
        compiled.step(input_ids=ids, labels=ids, attention_mask=mask)
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_takes_its_mask_as_data_is_not_specialised():
    class Weighted(torch.nn.Module):  # the mask weights the tokens: accepted as data, any values
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

        def forward(self, input_ids, attention_mask):
            logits = self.head(self.emb(input_ids) * attention_mask[..., None])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten(), reduction="sum")

    torch.manual_seed(0)
    model, ids = Weighted(), _ids()
    compiled = sppo_fx.compile(model, chunks=CHUNKS, compile=False)
    compiled(input_ids=ids, attention_mask=torch.ones_like(ids)).backward()
    assert not compiled.graphs["captured"].meta.get("sppo_ones_inputs")
    model.zero_grad(set_to_none=True)
    padded = _padded(ids)
    assert_matches_eager(model, lambda m: m(input_ids=ids, attention_mask=padded),
                         lambda: compiled(input_ids=ids, attention_mask=padded))


@pytest.mark.parametrize("bad", [5, [1], None])
def test_ones_inputs_option_is_checked(bad):
    with pytest.raises(SppoError, match="ones_inputs="):
        sppo_fx.compile(torch.nn.Linear(2, 2), ones_inputs=bad)


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_all_ones_mask_is_exact_and_padding_refused_on_every_rank():
    import json
    import os
    import sys

    from sppo_fx.runtime.launch import run_local_ranks
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = os.path.join(root, "tests", "helpers", "ones_mask_parallel_worker.py")
    results = run_local_ranks([sys.executable, worker], 2, 300.0, cwd=root)
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        cell = json.loads(out.strip().splitlines()[-1])
        assert cell["loss_ok"] and not cell["bad"] and cell["guarded"], (rank, cell)
        assert "attention_mask was all ones" in cell["refused"] and cell["grads_none"], (rank, cell)
