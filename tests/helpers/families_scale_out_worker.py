"""One rank of the families x scale-out matrix (tests/distributed/test_families_scale_out.py, issue 30 item 5).

argv[1] is a JSON list of cells {"family", "attn" (null: the default attention), "layout"
("sp": sequence parallelism over all ranks, "pp": one pipeline stage per rank)}. For each,
every rank builds the same tiny model (2 layers, T = 32, batch 1, 2 chunks), computes the
eager loss and gradients, runs one `compiled.step` in the layout (compile=False) and
compares the loss and the gradients it holds (the relative difference it reports skips
gradients below 1e-6, such as a key bias's, 0 up to rounding; allclose checks them all); a refusal (SppoError) is reported with its
message and whether any gradient was left behind. It prints one JSON line per rank.

Adding a family is one line in FAMILIES: (config class, model class, config kwargs).
"""
import json
import sys
import time

import torch
import torch.distributed as dist
import transformers as tf

import sppo_fx
from sppo_fx.errors import SppoError
from sppo_fx.runtime.distributed import init_from_env

T, VOCAB, RTOL, ATOL = 32, 64, 1e-4, 1e-5
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64)
NO_DROP = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, HF),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(HF, sliding_window=None)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(HF, use_sliding_window=False)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(HF, head_dim=8)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(HF, head_dim=8, sliding_window=64,
                                                            layer_types=["full_attention"] * 2,
                                                            attn_logit_softcapping=None)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(HF, head_dim=8, sliding_window=8,
                                                                layer_types=["sliding_attention", "full_attention"])),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(HF, pad_token_id=0)),
    "phi": (tf.PhiConfig, tf.PhiForCausalLM, dict(HF, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM, HF),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                     n_positions=64, **NO_DROP)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, HF),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, HF),
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM, dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, attention_dropout=0.0,
                                                           hidden_dropout=0.0)),
    "gptj": (tf.GPTJConfig, tf.GPTJForCausalLM, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                     n_positions=64, rotary_dim=4, **NO_DROP)),
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, HF),
    "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=64,
                                                  word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    "gemma2_softcap": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(HF, head_dim=8, sliding_window=64,
                                                                    layer_types=["full_attention"] * 2,
                                                                    attn_logit_softcapping=5.0)),
    "bloom": (tf.BloomConfig, tf.BloomForCausalLM, dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                        attention_dropout=0.0, hidden_dropout=0.0)),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(HF, intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"], output_router_logits=True, router_aux_loss_coef=1.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),  # noqa: E501
}


def run(cell: dict, world: int) -> dict:
    config_cls, model_cls, kwargs = FAMILIES[cell["family"]]
    if cell.get("attn"):
        kwargs = dict(kwargs, attn_implementation=cell["attn"])
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs))
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    layout = {"sp": {"seq_parallel": world}, "pp": {"stages": world}}[cell["layout"]]
    compiled = sppo_fx.compile(model, chunks=2, compile=False, **layout)
    try:
        loss = compiled.step(input_ids=ids, labels=ids)
    except SppoError as e:
        return {"refused": str(e), "left_grads": any(p.grad is not None for p in model.parameters())}
    worst, bad = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue  # another stage's parameter (the test checks every one is held somewhere)
        r = ref[name]
        if r.abs().max() > 1e-6:  # a gradient that is 0 in exact arithmetic (a key bias's) is all noise
            worst = max(worst, ((p.grad - r).abs().max() / r.abs().max()).item())
        if not torch.allclose(p.grad, r, rtol=RTOL, atol=ATOL):
            bad.append(name)
    loss_ok = bool(torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL))  # every rank gets the loss
    return {"refused": None, "rel": worst, "loss_ok": loss_ok, "bad": bad,
            "held": sorted(n for n, p in model.named_parameters() if p.grad is not None), "params": sorted(ref)}


def main() -> int:
    rank, world = init_from_env(300.0)
    results = {}
    for cell in json.loads(sys.argv[1]):
        key = f"{cell['family']}/{cell.get('attn') or 'default'}/{cell['layout']}"
        start = time.perf_counter()
        results[key] = run(cell, world)
        results[key]["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
