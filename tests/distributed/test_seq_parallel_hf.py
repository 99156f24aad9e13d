"""Sequence parallelism against eager on Hugging Face models and the library's own (issue 26).

The matrix: Llama, Qwen2 (1 K/V head), Mistral with a window of 8 < T, GPT-2, Gemma 3 (a
sliding and a full layer) and the own GPT and Llama; S = 2 and 4 (S above the K/V heads:
Qwen2 at 2, the GQA models at 4); batch 1 and 2; 1 and 4 chunks; pure sequence-parallel,
pipeline x sequence and data x sequence on 4 ranks. Each rank runs its chunk program in its
own random node order (tests/helpers/seq_parallel_hf_worker.py says why): before the collectives
were chained, that swapped the q/k/v gradients' all-to-alls between ranks.

All cells of a world size run in one launch of ranks (each launch costs start-up and
imports). A second test checks, on one process, that the chain orders every all-to-all of
the forward and backward graphs.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sppo_fx.ops.seq_parallel import heads_to_seq, seq_to_heads
from sppo_fx.runtime.launch import run_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "seq_parallel_hf_worker.py")
HF_MODELS = ["llama", "qwen2", "mistral_window", "gpt2", "gemma3"]


def _cell(model, S, layout="sp", batch=1, chunks=1, layers=1):
    return dict(model=model, layers=layers, S=S, layout=layout, batch=batch, chunks=chunks)


# every model at S = 2 and at S = 4; batch x chunks cycle through (1, 1), (2, 4), (1, 4), (2, 1)
_COMBOS = [(1, 1), (2, 4), (1, 4), (2, 1)]
TWO = [_cell(m, 2, batch=b, chunks=c, layers=2 if m == "llama" else 1)
       for m, (b, c) in zip(HF_MODELS + ["own_gpt", "own_llama"], _COMBOS * 2)]
TWO.append(_cell("llama", 2, batch=2, chunks=4, layers=2))  # the model, 4 chunks
FOUR = [_cell(m, 4, batch=b, chunks=c) for m, (b, c) in zip(HF_MODELS, _COMBOS[1:] + _COMBOS)]
# 2 x 2 layouts (data-parallel shares need an even batch)
FOUR += [_cell("llama", 2, "pp", batch=2, chunks=4, layers=2), _cell("own_llama", 2, "pp", batch=1, chunks=1, layers=2),
         _cell("qwen2", 2, "dp", batch=2, chunks=4), _cell("own_gpt", 2, "dp", batch=2, chunks=1)]


def _matrix(world, cells):
    results = run_local_ranks([sys.executable, WORKER, json.dumps(cells)], world, 300.0, cwd=ROOT)
    per_rank = []
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    table = {}
    for key in per_rank[0]:
        cells = [r[key] for r in per_rank]
        bad = {rank: c["bad"] for rank, c in enumerate(cells) if c["bad"]}
        assert all(c["loss_ok"] for c in cells), (key, "loss differs from eager")
        assert not bad, (key, "gradients differ from eager", bad)
        held = set().union(*(c["held"] for c in cells))
        assert held == set(cells[0]["params"]), (key, "parameters no rank holds", set(cells[0]["params"]) - held)
        table[key] = max(c["rel"] for c in cells)
    print(f"\nlargest relative gradient difference per cell ({world} ranks):")
    for key, rel in table.items():
        print(f"  {key:40s} {rel:.2e}")
    return table


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_matches_eager_on_two_ranks():
    assert len(_matrix(2, TWO)) == len(TWO)


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_matches_eager_on_four_ranks():
    assert len(_matrix(4, FOUR)) == len(FOUR)


def _ordered(graph) -> list:
    """The graph's all-to-alls, after checking that each one depends on the one before it."""
    ops = (torch.ops.sppo.seq_to_heads.default, torch.ops.sppo.heads_to_seq.default)
    nodes = [n for n in graph.nodes if n.target in ops]
    seen: dict = {}

    def ancestors(n):
        if n not in seen:
            seen[n] = set(n.all_input_nodes).union(*(ancestors(a) for a in n.all_input_nodes))
        return seen[n]
    for before, after in zip(nodes, nodes[1:]):
        assert before in ancestors(after), f"{after.name} may run before {before.name}"
    return nodes


@pytest.mark.parametrize("S", [2, 4])
def test_every_all_to_all_waits_for_the_one_before_it_forward_and_backward(S):
    from sppo_fx.chunk_attention.functions import prefix_causal_attention
    from sppo_fx.passes.sequence_parallel import shard_attention_heads
    from test_seq_parallel import _program
    # the pass chains the program's collectives: q, k and v's of each site, its output's
    sharded = shard_attention_heads(_program("llama", n_layers=2), S, "g")
    assert len(_ordered(sharded.chunk.graph)) == 4 * 2

    # and the ops' gradients chain in reverse (traced on fake tensors: no collective runs)
    def step(q, k, v, prefix):
        q2, t = seq_to_heads(q, None, 8, S, "g")
        k2, t = seq_to_heads(k, t, 8, S, "g")
        v2, t = seq_to_heads(v, t, 8, S, "g")
        out, _t = heads_to_seq(prefix_causal_attention(q2, prefix, k2, prefix, v2), t, 8 // S, S, "g")
        return torch.autograd.grad(out.sum(), (q, k, v))
    q, k, v = (torch.randn(1, 4, 8 // S, 2, requires_grad=True) for _ in range(3))
    joint = make_fx(step, tracing_mode="fake")(q, k, v, torch.zeros(1, 4 // S, 0, 2))
    assert len(_ordered(joint.graph)) == 8
