"""Every supported Hugging Face family under sequence parallelism and a pipeline (issue 30 item 5).

Two ranks (gloo), one launch for all cells: each family (default attention, and the
written-out "eager" attention where it takes another path through sppo_fx) runs one step
with seq_parallel=2 and one with stages=2, and its loss and every gradient are compared
with eager (tests/helpers/families_scale_out_worker.py). A cell in REFUSED must instead raise an
SppoError naming the reason, on every rank, before leaving any gradient.

Adding a family: one line in the worker's FAMILIES (and its name in CELLS below, with the
attention implementations to run).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from sppo_fx.runtime.launch import run_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "families_scale_out_worker.py")

# family -> attention implementations to run (None: the model's default)
CELLS = {
    "llama": [None], "mistral": [None], "qwen2": [None], "qwen3": [None], "gemma2": ["eager"],
    "gemma3": [None], "phi3": [None], "phi": [None], "stablelm": [None], "gpt2": [None, "eager"],
    "gpt_neox": [None], "olmo2": [None], "gptj": [None], "cohere": [None],
    "falcon": [None, "eager"], "opt": [None, "eager"], "gpt_oss": [None],  # GPT-OSS: eager is its default
    "gemma2_softcap": ["eager"], "bloom": [None],
}
LAYOUTS = ["sp", "pp"]
# (family, attention, layout) -> regex the refusal must match
REFUSED: dict = {("gpt_oss", None, "sp"): r"per-head attention sinks.*seq_parallel=2",
                 ("bloom", None, "sp"): r"per-head attention sinks or ALiBi slopes"}


def _cells():
    return [dict(family=f, attn=a, layout=lay) for f, attns in CELLS.items() for a in attns for lay in LAYOUTS]


def _key(cell):
    return f"{cell['family']}/{cell['attn'] or 'default'}/{cell['layout']}"


NEW = ("opt", "falcon", "gpt_oss", "gemma2_softcap", "bloom")  # what issue 30 added; the others: second test


def _matrix(cells, monkeypatch):
    # HF Gemma 3 builds its rotary tables by iterating a set of layer-type strings, whose order
    # follows the process's string hash seed: two ranks export graphs that differ in node
    # order only, and the ranks' agreement check refuses them (by name, before any step)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    results = run_local_ranks([sys.executable, WORKER, json.dumps(cells)], 2, 900.0, cwd=ROOT)
    per_rank = []
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    print("\nlargest relative gradient difference per cell (2 ranks):")
    for cell in cells:
        key = _key(cell)
        got = [r[key] for r in per_rank]
        want = REFUSED.get((cell["family"], cell["attn"], cell["layout"]))
        if want is not None:
            assert all(g["refused"] and re.search(want, g["refused"]) for g in got), (key, [g["refused"] for g in got])
            assert not any(g["left_grads"] for g in got), (key, "a refusal left gradients behind")
            print(f"  {key:28s} refused: {got[0]['refused'][:100]}")
            continue
        assert all(g["refused"] is None for g in got), (key, got[0]["refused"])
        assert all(g["loss_ok"] for g in got), (key, "loss differs from eager")
        bad = {rank: g["bad"] for rank, g in enumerate(got) if g["bad"]}
        assert not bad, (key, "gradients differ from eager", bad)
        held = set().union(*(g["held"] for g in got))
        assert held == set(got[0]["params"]), (key, "parameters no rank holds", set(got[0]["params"]) - held)
        print(f"  {key:28s} {max(g['rel'] for g in got):.2e}  ({max(g['seconds'] for g in got):.1f} s)")


@pytest.mark.slow
@pytest.mark.distributed
def test_new_families_under_sequence_parallelism_and_pipelines(monkeypatch):
    _matrix([c for c in _cells() if c["family"] in NEW], monkeypatch)


@pytest.mark.slow
@pytest.mark.distributed
def test_other_families_under_sequence_parallelism_and_pipelines(monkeypatch):
    _matrix([c for c in _cells() if c["family"] not in NEW], monkeypatch)
