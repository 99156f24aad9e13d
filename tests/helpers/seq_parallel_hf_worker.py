"""One rank of the sequence-parallel matrix (tests/distributed/test_seq_parallel_hf.py).

argv[1] is a JSON list of cells: {"model", "layers", "S", "layout" ("sp", "pp" or "dp"),
"batch", "chunks"}. For each, every rank builds the same model, computes the eager loss and
gradients of the full batch, then runs one `compiled.step` of the same batch (compile=False)
in that layout and compares the loss and the gradients it holds. It prints one JSON line:
per cell the largest relative gradient difference (max |g - eager| / max |eager| over its
parameters), whether the loss matched, and the parameters outside tolerance.

Collectives pair up across ranks by their order alone, and a compiler may run a graph's
independent nodes in any order, differently on each rank (Inductor did, issue 26). So each
rank runs its sequence-parallel chunk program in its own random topological order (seeded by
its rank): the answer must not depend on it. Eager autograd then also runs the gradients'
collectives in a rank-dependent order (it prefers the nodes created last).
"""
import json
import random
import sys
import time

import torch
import torch.distributed as dist
import transformers as tf

import sppo_fx
from sppo_fx.models import build
from sppo_fx.orchestrate import ranks as pipeline  # the orchestrator shards the heads (build_rank)
from sppo_fx.runtime.distributed import init_from_env

T, VOCAB, RTOL, ATOL = 32, 64, 1e-4, 1e-5
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=64)
# name -> (config class, model class, config): GQA with 2 K/V heads (S=4 repeats them),
# Qwen2 with 1 (S=2 already exceeds it), GPT-2 with none, windows of 8 < T in Mistral and
# in Gemma 3's sliding layer
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, HF),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(HF, num_key_value_heads=1, use_sliding_window=False)),
    "mistral_window": (tf.MistralConfig, tf.MistralForCausalLM, dict(HF, sliding_window=8)),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
             dict(vocab_size=VOCAB, n_embd=32, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                  embd_pdrop=0.0)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(HF, head_dim=8, sliding_window=8)),
}


def make(cell):
    """(model, call(model) -> loss, args, kwargs) of a cell, the same on every rank."""
    torch.manual_seed(0)
    layers = cell["layers"]
    gen = torch.Generator().manual_seed(1)
    if cell["model"] in ("own_gpt", "own_llama"):
        kind = cell["model"][4:]
        model = build(kind, "tiny", **({"n_layer": layers} if kind == "gpt" else {"n_layers": layers}))
        x = torch.randint(0, model.config.vocab_size, (cell["batch"], T), generator=gen)
        y = torch.randint(0, model.config.vocab_size, (cell["batch"], T), generator=gen)
        return model, lambda m: m(x, y), (x, y), {}
    config_cls, model_cls, kwargs = FAMILIES[cell["model"]]
    kwargs = dict(kwargs, **({"n_layer": layers} if cell["model"] == "gpt2" else {"num_hidden_layers": layers}))
    if cell["model"] == "gemma3":
        kwargs["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    model = model_cls(config_cls(**kwargs))
    ids = torch.randint(0, VOCAB, (cell["batch"], T), generator=gen)
    return model, lambda m: m(input_ids=ids, labels=ids).loss, (), {"input_ids": ids, "labels": ids}


def run(cell, world: int) -> dict:
    model, call, args, kwargs = make(cell)
    ref_loss = call(model)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    S = cell["S"]
    other = world // S
    layout = {"sp": {}, "pp": {"stages": other}, "dp": {"data_parallel": other}}[cell["layout"]]
    compiled = sppo_fx.compile(model, chunks=cell["chunks"], seq_parallel=S, compile=False, **layout)
    loss = compiled.step(*args, **kwargs)
    worst, bad = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue  # another stage's parameter (the test checks every one is held somewhere)
        r = ref[name]
        worst = max(worst, ((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
        if not torch.allclose(p.grad, r, rtol=RTOL, atol=ATOL):
            bad.append(name)
    return {"rel": worst, "loss_ok": bool(torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)),
            "bad": bad, "held": sorted(n for n, p in model.named_parameters() if p.grad is not None),
            "params": sorted(ref)}


def shuffled(gm, seed: int):
    """`gm` with its nodes in a random topological order (placeholders and output stay put)."""
    rng = random.Random(seed)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    waits = {n: {a for a in n.all_input_nodes if a.op != "placeholder"} for n in body}
    ready, order = [n for n in body if not waits[n]], []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        for user in node.users:
            if user in waits:
                waits[user].discard(node)
                if not waits[user]:
                    ready.append(user)
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for node in order:
        anchor.append(node)
        anchor = node
    gm.graph.lint()
    gm.recompile()
    return gm


def main() -> int:
    rank, world = init_from_env(300.0)
    shard = pipeline.shard_attention_heads

    def shard_in_own_order(program, parts, group):
        out = shard(program, parts, group)
        shuffled(out.chunk, 1000 + rank)
        return out

    pipeline.shard_attention_heads = shard_in_own_order
    results = {}
    for cell in json.loads(sys.argv[1]):
        key = "{model} L{layers} S{S} {layout} b{batch} c{chunks}".format(**cell)
        start = time.perf_counter()
        results[key] = run(cell, world)
        results[key]["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
