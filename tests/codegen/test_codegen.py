"""Inductor-compiled chunk programs: exact against eager, with a bounded number of compiles."""
from __future__ import annotations

import os

import pytest
import torch

import sppo_fx
from sppo_fx.models import build

from conftest import assert_matches_eager


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compiled_chunks_match_eager_with_bounded_recompiles(kind):
    # one block: what is checked (recompiles, exactness) does not depend on depth, and each
    # block adds its kernels to Inductor's cold compile
    model = build(kind, **{"n_layer" if kind == "gpt" else "n_layers": 1})
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


@pytest.mark.parametrize("options", [dict(compile=False, recompute="full"), dict(compile=False, offload="host")])
def test_soft_targets_in_class_dim_layout_run_through_aot_graphs(options):
    """AOTAutograd's graphs run op by op take eager kernels' strides, which may differ from
    the meta kernels' they were traced with: a transposed soft target's backward `view`
    raised (fuzzer seed 12); now loss and gradients equal eager's."""
    import torch.nn.functional as F

    import sppo_fx

    class SoftTargets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.head = torch.nn.Embedding(17, 16), torch.nn.Linear(16, 17)

        def forward(self, x, p):
            return F.cross_entropy(self.head(self.tok(x)).transpose(1, 2), p.transpose(1, 2))

    torch.manual_seed(0)
    model = SoftTargets()
    x, p = torch.randint(0, 17, (2, 8)), torch.randn(2, 8, 17).softmax(-1)
    loss = sppo_fx.compile(model, chunk_lengths=[2, 2, 2, 2], **options)(x, p)
    loss.backward()
    got = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(x, p)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for n, q in model.named_parameters():
        torch.testing.assert_close(got[n], q.grad, rtol=1e-4, atol=1e-5, msg=n)
