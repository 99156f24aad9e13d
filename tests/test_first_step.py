"""Time to the first step: chunk 0 (empty K/V prefix) does not cost a second Inductor compile
(codegen/inductor.py `eager_empty_prefix`), and a one-chunk plan keeps Inductor. Inductor
itself is replaced by AOTAutograd's eager graphs here (the backend each compile asked for is
what is checked), so the test runs in seconds; exactness against eager is checked too."""
from __future__ import annotations

import pytest
import torch

import sppo_fx
from sppo_fx.codegen.inductor import CompiledProgram
from sppo_fx.models import build


@pytest.mark.parametrize("chunks, expected", [(3, ["eager", "inductor"]), (1, ["inductor"])])
def test_chunk_zero_skips_inductor_only_with_later_chunks(monkeypatch, chunks, expected):
    asked = []
    original = CompiledProgram._compile

    def record(self, graph, example_inputs, backend):
        asked.append(backend)
        return original(self, graph, example_inputs, "eager")  # no C++ compile in the test

    monkeypatch.setattr(CompiledProgram, "_compile", record)
    torch.manual_seed(0)
    model = build("llama", "tiny")
    x = torch.randint(0, 97, (1, 48))
    model(x, x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = sppo_fx.compile(model, chunks=chunks, compile=True)
    compiled(x, x).backward()
    assert asked == expected
    assert compiled.codegen.stats.compiles == len(expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)
