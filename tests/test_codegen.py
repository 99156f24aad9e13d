"""Inductor-compiled chunk programs: exact against eager, with a bounded number of compiles."""
from __future__ import annotations

import os

import pytest
import torch

import sppo_fx
from sppo_fx.models import build

from conftest import assert_matches_eager


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_chunks_match_eager_with_bounded_recompiles(kind):
    model = build(kind)
    x = torch.randint(0, 97, (2, 35))
    y = torch.randint(0, 97, (2, 35))
    compiled = sppo_fx.compile(model, chunks=7)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))
    stats = compiled.codegen.stats
    # chunk 0 (empty prefix) and one dynamic graph for chunks 1..6
    assert stats.compiles <= 2, stats.graph_inputs
    # another sequence length and partition reuse the dynamic graph
    x2, y2 = torch.randint(0, 97, (2, 50)), torch.randint(0, 97, (2, 50))
    compiled.options.chunk_lengths, compiled.options.chunks = [20, 13, 9, 8], None
    assert_matches_eager(model, lambda m: m(x2, y2), lambda: compiled(x2, y2))
    assert compiled.codegen.stats.compiles <= 2
    files = compiled.codegen.generated_code()
    assert files and all(os.path.exists(f) for f in files)
    text = compiled.explain()
    assert "Codegen: Inductor" in text and files[0] in text
