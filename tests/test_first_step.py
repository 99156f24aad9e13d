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


@pytest.mark.parametrize("chunks, skeleton, expected", [(3, "keep", ["eager", "inductor"]), (1, "keep", ["inductor"]),
                                                     (3, "offload", ["eager", "inductor"])])
def test_chunk_zero_skips_inductor_only_with_later_chunks(monkeypatch, tmp_path, chunks, skeleton, expected):
    """With the K/V skeleton offloaded every chunk's prefix handle is an empty tensor, so
    chunk 0 is told by its chunk_start (0 specialises: without the routing it compiles a
    second Inductor graph)."""
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
    extra = dict(offload="disk", skeleton="offload", offload_dir=str(tmp_path)) if skeleton == "offload" else {}
    compiled = sppo_fx.compile(model, chunks=chunks, compile=True, **extra)
    compiled(x, x).backward()
    assert asked == expected
    assert compiled.codegen.stats.compiles == len(expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)


def test_a_later_process_gets_the_chunk_program_from_the_autograd_cache(monkeypatch, tmp_path):
    """The chunk program (on CPU its attention is an autograd.Function, which torch keeps out
    of the AOTAutograd cache unless told it is safe) comes back from Inductor's caches in a
    later process: `torch._dynamo.reset()` forgets every compile in this one, so the second
    compile is what a new process does. One chunk: one Inductor compile."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = build("llama", "tiny")
    x = torch.randint(0, 97, (1, 24))
    model(x, x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    hits = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        model.zero_grad(set_to_none=True)
        compiled = sppo_fx.compile(model, chunks=1)
        compiled(x, x).backward()
        hits.append(counters["aot_autograd"]["autograd_cache_hit"])
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)
    assert hits == [0, 1]
