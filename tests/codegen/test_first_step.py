"""Time to the first step: chunk 0 (empty K/V prefix) does not cost a second Inductor compile
(codegen/inductor.py `eager_empty_prefix`): its AOTAutograd graphs are traced at its sizes,
without Dynamo, and a one-chunk plan keeps Inductor. Inductor itself is replaced by
AOTAutograd's eager graphs here (the backend each compile asked for is what is checked), so
the tests run in seconds; exactness against eager is checked too."""
from __future__ import annotations

import pytest
import torch

import sppo_fx
from sppo_fx.codegen.inductor import CompiledProgram
from sppo_fx.models import build


@pytest.fixture(autouse=True)
def _no_background_compile_left():
    """A test's background compiles (chunk 0's, codegen/background.py) end within the test."""
    yield
    from sppo_fx.codegen import background
    assert background.wait_all(120)


def _record_backends(monkeypatch) -> list:
    """The backend each Dynamo compile asks for; every one runs AOTAutograd's eager graphs."""
    asked = []
    original = CompiledProgram._compile

    def record(self, graph, example_inputs, backend, **kw):
        # chunk 0's compile on the background thread is told by its given parameter indices
        asked.append(backend + (" (background)" if kw.get("grad_index") is not None else ""))
        return original(self, graph, example_inputs, "eager", **kw)  # no C++ compile in the test

    monkeypatch.setattr(CompiledProgram, "_compile", record)
    return asked


@pytest.mark.slow
@pytest.mark.parametrize("chunks, skeleton, traces", [(3, "keep", 1), (1, "keep", 0), (3, "offload", 1)])
def test_chunk_zero_skips_inductor_only_with_later_chunks(monkeypatch, tmp_path, chunks, skeleton, traces):
    """With the K/V skeleton offloaded every chunk's prefix handle is an empty tensor, so
    chunk 0 is told by its chunk_start (0 specialises: without the routing it compiles a
    second Inductor graph). One Dynamo compile, for Inductor; chunk 0 traced at its sizes."""
    asked = _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 48))
    model(x, x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    extra = dict(offload="disk", skeleton="offload", offload_dir=str(tmp_path)) if skeleton == "offload" else {}
    compiled = sppo_fx.compile(model, chunks=chunks, compile=True, **extra)
    compiled(x, x).backward()
    assert asked == ["inductor"]
    assert compiled.codegen.stats.compiles == 1 and compiled.codegen.stats.exact_traces == traces
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_chunk_zero_traced_at_its_sizes_then_one_dynamic_program(monkeypatch):
    """Chunk 0 of new sizes: traced exactly for the first EXACT_SIZES sizes, then one
    dynamic-shape program (Dynamo, AOTAutograd's graphs) serves every further size; a size
    seen before reuses its trace. Every step exact against eager, in training and no_grad."""
    from sppo_fx.codegen.inductor import EXACT_SIZES
    assert EXACT_SIZES == 2
    asked = _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    compiled = sppo_fx.compile(model, chunk_lengths=[16, 16], compile=True)
    seen = []
    for lengths in ([16, 16], [12, 20], [8, 24], [20, 12], [12, 20]):
        x = torch.randint(0, 97, (1, 32))
        model(x, x).backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        compiled.options.chunk_lengths = lengths
        loss = compiled(x, x)
        loss.backward()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, x), model(x, x), rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
        seen.append((compiled.codegen.stats.exact_traces, asked.count("eager")))
    # chunk 0 of 16, then 12 tokens: traced exactly, in training and in no_grad (4 traces);
    # of 8 tokens, a third size: the dynamic program; of 20 tokens it serves again, and 12
    # reuses its traces
    assert seen[:3] == [(2, 0), (4, 0), (4, seen[2][1])] and seen[2][1] >= 1, seen
    assert seen[4] == seen[3] == seen[2], seen
    assert asked.count("inductor") <= 2  # the later chunks: one dynamic program (training, no_grad)


@pytest.mark.slow
def test_a_compiled_first_call_starts_inductors_cpu_probe_on_another_thread(monkeypatch):
    """Inductor's one-time CPU vector-ISA probe (seconds of subprocesses) runs on a background
    thread from the start of the first call (no budget), overlapping capture."""
    import threading
    from torch._inductor import cpu_vec_isa
    from sppo_fx.codegen import inductor
    called = []
    monkeypatch.setattr(inductor, "_cpu_probe", None)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: called.append(threading.current_thread().name))
    _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 16))
    sppo_fx.compile(model, chunks=2, compile=True)(x, x).backward()
    inductor._cpu_probe.join(30)
    assert called == ["sppo_fx-inductor-cpu-probe"]


@pytest.mark.slow
def test_a_budgeted_first_call_starts_the_probe_after_the_memory_model(monkeypatch):
    """With a budget the probe starts once the memory model is known (its two traces take
    both cores, passes/cost/saved_cache.py) and the device profile too (a calibration's
    matmuls would share the cores with the probe's compiles), still on its own thread and
    before any compile."""
    import threading
    from torch._inductor import cpu_vec_isa
    from sppo_fx.codegen import inductor
    from sppo_fx.passes.cost import saved_cache
    events = []
    monkeypatch.setattr(inductor, "_cpu_probe", None)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: events.append(threading.current_thread().name))
    real = saved_cache.stored_saved_tensors_for_examples
    monkeypatch.setattr(saved_cache, "stored_saved_tensors_for_examples",
                        lambda *a, **k: (real(*a, **k), events.append("memory model"))[0])  # once it is known
    import sppo_fx.passes.cost.model as cost_model
    monkeypatch.setattr(cost_model, "stored_saved_tensors_for_examples", saved_cache.stored_saved_tensors_for_examples)
    from sppo_fx.solver import profile_cache
    real_profile = profile_cache.device_profile
    monkeypatch.setattr(profile_cache, "device_profile",
                        lambda *a, **k: (real_profile(*a, **k), events.append("device profile"))[0])
    _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 64))
    sppo_fx.compile(model, budget="64MiB", compile=True)(x, x).backward()
    inductor._cpu_probe.join(30)
    assert events == ["memory model", "device profile", "sppo_fx-inductor-cpu-probe"]


def _steps_against_eager(model, compiled, x, steps, after=lambda step: None):
    """`steps` training steps of `compiled`, each exact against eager's gradients."""
    model(x, x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for step in range(steps):
        compiled(x, x).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
        after(step)


@pytest.mark.slow
@pytest.mark.parametrize("skeleton, mode", [("keep", "on"), ("offload", "on"), ("keep", "wait"), ("offload", "wait")])
def test_chunk_zero_runs_compiled_code_once_the_background_compile_is_done(monkeypatch, tmp_path, skeleton, mode):
    """The first step runs chunk 0's AOTAutograd graphs op by op; its second call starts the
    Inductor compile of the same exact-size program in a forked child (not a Dynamo compile:
    `compiles` stays 1), and once it is done every call of chunk 0 runs the compiled program;
    under "wait" that second call waits for the compile and already runs it. Exact against
    eager at every step."""
    monkeypatch.setenv("SPPO_FX_BACKGROUND_COMPILE", mode)  # tests/conftest.py turns it off
    asked = _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 48))
    extra = dict(offload="disk", skeleton="offload", offload_dir=str(tmp_path)) if skeleton == "offload" else {}
    compiled = sppo_fx.compile(model, chunks=3, compile=True, **extra)
    stats = []

    def after(step):
        if step == 1 and mode == "on":
            assert compiled.codegen.wait_background(120)
        s = compiled.codegen.stats
        stats.append((s.exact_eager_calls, s.exact_compiled_calls, s.background_compiles))
    _steps_against_eager(model, compiled, x, 4, after)
    if mode == "on":  # the compile started at step 1's call, which ran op by op
        assert stats == [(1, 0, 0), (2, 0, 1), (2, 1, 1), (2, 2, 1)]
    else:  # step 1's call waited for it and ran Inductor's code
        assert stats == [(1, 0, 0), (1, 1, 1), (1, 2, 1), (1, 3, 1)]
    assert asked == ["inductor", "inductor (background)"]
    assert compiled.codegen.stats.compiles == 1 and compiled.codegen.stats.background_failures == 0


@pytest.mark.slow
def test_background_compiles_off_keep_chunk_zero_op_by_op(monkeypatch):
    """SPPO_FX_BACKGROUND_COMPILE=off: no thread, chunk 0 keeps its AOTAutograd graphs."""
    monkeypatch.setenv("SPPO_FX_BACKGROUND_COMPILE", "off")
    asked = _record_backends(monkeypatch)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 32))
    compiled = sppo_fx.compile(model, chunks=2, compile=True)
    _steps_against_eager(model, compiled, x, 3)
    assert compiled.codegen.wait_background(0)
    s = compiled.codegen.stats
    assert (s.exact_eager_calls, s.exact_compiled_calls, s.background_compiles) == (3, 0, 0)
    assert asked == ["inductor"]


@pytest.mark.slow
def test_a_failed_background_compile_leaves_chunk_zero_op_by_op_and_exact(monkeypatch):
    """A background compile that raises is counted and warned about; chunk 0 keeps running
    its AOTAutograd graphs, exactly."""
    monkeypatch.setenv("SPPO_FX_BACKGROUND_COMPILE", "on")
    asked = _record_backends(monkeypatch)
    recorded = CompiledProgram._compile

    def failing(self, graph, example_inputs, backend, **kw):
        if kw.get("grad_index") is not None:
            raise RuntimeError("no compiler here")
        return recorded(self, graph, example_inputs, backend, **kw)

    monkeypatch.setattr(CompiledProgram, "_compile", failing)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x = torch.randint(0, 97, (1, 32))
    compiled = sppo_fx.compile(model, chunks=2, compile=True)
    _steps_against_eager(model, compiled, x, 4, lambda step: compiled.codegen.wait_background(120))
    s = compiled.codegen.stats
    assert (s.background_failures, s.background_compiles, s.exact_eager_calls, s.exact_compiled_calls) == (1, 0, 4, 0)
    assert asked == ["inductor"]
