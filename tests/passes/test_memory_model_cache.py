"""The memory model's saved activations are kept on disk and in the process
(sppo_fx/passes/cost/saved_cache.py): a later lookup of the same chunk program reads them
instead of tracing with AOTAutograd, a different program, policy or example traces, `off`
writes nothing, a corrupt file is traced again, and a new process reads what this one
stored."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch

from sppo_fx.passes.cost import saved as saved_mod
from sppo_fx.passes.cost import saved_cache, symbolic_values, traced_batch

from conftest import needs_fork, tiny_program


@pytest.fixture
def cold(tmp_path, monkeypatch):
    """A cold cache in tmp_path, and a count of AOTAutograd traces (`saved._aot_forwards`)."""
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPPO_FX_MEMORY_MODEL_CACHE", raising=False)
    saved_cache.forget()
    traces = []
    original = saved_mod._aot_forwards
    monkeypatch.setattr(saved_mod, "_aot_forwards", lambda *a, **k: traces.append(a[0]) or original(*a, **k))
    yield traces
    saved_cache.forget()


def _lookup(program, seq, params, **kw):
    values = symbolic_values(program, seq)
    return saved_cache.stored_saved_tensors_by_policy(program, values, traced_batch(program, seq),
                                                      params=params, seq=seq, **kw)


def _llama():
    _, cap, program = tiny_program("llama")
    return program, cap.seq, [cap.param_value(n) for n in program.params]


def _fields(result):
    by_policy, example, allocated = result
    return ({policy: [dataclasses.astuple(s) for s in saved] for policy, saved in by_policy.items()}, example,
            {policy: [dataclasses.astuple(a) for a in allocs] for policy, allocs in allocated.items()})


def _stored(tmp_path):
    return sorted((tmp_path / "memory_model").glob("*.json")) if (tmp_path / "memory_model").exists() else []


@pytest.mark.slow
def test_a_second_lookup_reads_the_file_and_does_not_trace(cold, tmp_path, caplog):
    program, seq, params = _llama()
    caplog.set_level(logging.INFO, logger="sppo_fx")
    first = _lookup(program, seq, params, partition="min_cut", recomputes=("none", "full"))
    assert len(cold) == 1
    files = _stored(tmp_path)
    assert len(files) == 1
    assert "memory model: saved activations under recompute none/full (AOTAutograd partitions)" in caplog.text
    # a new process: nothing in memory, the file is read
    saved_cache.forget()
    caplog.clear()
    again = _lookup(program, seq, params, partition="min_cut", recomputes=("none", "full"))
    assert len(cold) == 1, "traced although the memory model was stored"
    assert f"memory model: read from cache {files[0]}" in caplog.text
    assert _fields(again) == _fields(first)  # every SavedTensor field: names, sympy shapes/bytes, dtype, ...
    assert again[0]["full"] and again[0]["none"] != again[0]["full"]
    assert again[2]["full"] and again[2]["none"] != again[2]["full"]  # a recompute allocates more
    # the same process keeps it in memory: the file is not needed
    files[0].unlink()
    assert _fields(_lookup(program, seq, params, partition="min_cut", recomputes=("none", "full"))) == _fields(first)
    assert len(cold) == 1


@pytest.mark.slow
def test_another_program_policy_or_example_is_traced(cold, tmp_path):
    program, seq, params = _llama()
    base = _lookup(program, seq, params, partition="min_cut", recomputes=("none",))
    assert len(cold) == 1
    # the same placeholders, another graph: SiLU -> ReLU (both save one [b, c, ffn] tensor)
    chunk = copy.deepcopy(program.chunk)
    swapped = 0
    for node in chunk.graph.nodes:
        if node.target == torch.ops.aten.silu.default:
            node.target = torch.ops.aten.relu.default
            swapped += 1
    assert swapped
    chunk.recompile()
    relu = dataclasses.replace(program, chunk=chunk)
    other = _lookup(relu, seq, params, partition="min_cut", recomputes=("none",))
    assert len(cold) == 2, "another graph read the first graph's memory model"
    assert _fields(other) != _fields(base)
    del cold[:]
    # another policy, another example, another partition
    _lookup(program, seq, params, partition="min_cut", recomputes=("full",))
    assert len(cold) == 1
    _lookup(program, seq, params, partition="min_cut", recomputes=("none",), example=(base[1][0], 0))
    assert len(cold) == 2
    _lookup(program, seq, params, partition="default", recomputes=("none",))
    assert len(cold) == 3
    # the parameters' shapes are part of the key (a wider model is another program anyway)
    wider = [torch.zeros(*t.shape[:-1], t.shape[-1] + 1) if t.dim() == 2 else t for t in params]
    assert saved_cache.memory_model_key(program, 2, params=wider, seq=seq) != \
        saved_cache.memory_model_key(program, 2, params=params, seq=seq)
    assert len(_stored(tmp_path)) == 5
    # and each stored one is found again
    saved_cache.forget()
    _lookup(relu, seq, params, partition="min_cut", recomputes=("none",))
    _lookup(program, seq, params, partition="min_cut", recomputes=("full",))
    assert len(cold) == 3


@pytest.mark.slow
def test_off_neither_reads_nor_writes(cold, tmp_path, monkeypatch):
    program, seq, params = _llama()
    monkeypatch.setenv("SPPO_FX_MEMORY_MODEL_CACHE", "off")
    first = _lookup(program, seq, params, recomputes=("none",))
    again = _lookup(program, seq, params, recomputes=("none",))
    assert len(cold) == 2 and _stored(tmp_path) == []
    assert _fields(first) == _fields(again)


@pytest.mark.slow
def test_a_corrupt_file_is_traced_again_and_replaced(cold, tmp_path):
    program, seq, params = _llama()
    first = _lookup(program, seq, params, recomputes=("none",))
    (path,) = _stored(tmp_path)
    good = path.read_bytes()
    for n, damaged in enumerate([b"not JSON", good[: len(good) // 2]], start=2):
        path.write_bytes(damaged)
        saved_cache.forget()
        again = _lookup(program, seq, params, recomputes=("none",))
        assert len(cold) == n and _fields(again) == _fields(first)
        assert path.read_bytes() != damaged
    saved_cache.forget()
    _lookup(program, seq, params, recomputes=("none",))  # the rewritten file is read
    assert len(cold) == 3


def train_tiny_llama_with_a_budget() -> str:
    """Phases of the memory model, plan and loss of a budgeted first step (the tiny Llama)."""
    import sppo_fx
    from sppo_fx.util.log import record_phases
    from sppo_fx.models import build
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)  # one block: the cache's behaviour does not depend on depth
    x = torch.randint(0, 97, (1, 64))
    with record_phases() as phases:
        compiled = sppo_fx.compile(model, budget="64MiB", compile=False)
        loss = compiled(x, x)
    loss.backward()
    names = sorted({name for name, _ in phases if name.startswith("memory model")})
    return f"phases {names}\nplan {compiled.plan.chunk_lengths} {compiled.plan.recompute} loss {loss.item():.6f}"


@pytest.mark.slow
def test_a_new_process_reads_the_memory_model_this_one_stored(tmp_path, monkeypatch):
    """This process stores the memory model; a new one with the same SPPO_FX_CACHE_DIR traces
    nothing for it, and plans and trains the same."""
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPPO_FX_MEMORY_MODEL_CACHE", raising=False)
    first = train_tiny_llama_with_a_budget()
    assert "AOTAutograd partitions" in first and "read from cache" not in first, first
    assert len(_stored(tmp_path)) == 2  # the example chunk and the first chunk
    import conftest  # this file's folder and conftest's: they differ once tests sit in folders
    paths = [os.path.dirname(os.path.abspath(p)) for p in (__file__, conftest.__file__)]
    script = (f"import sys; sys.path[:0] = {paths!r}; "
              "from test_memory_model_cache import train_tiny_llama_with_a_budget as t; print(t())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPPO_FX_LOG")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    second = res.stdout.strip()
    assert second.splitlines()[0] == "phases ['memory model: read from cache']", second
    assert second.splitlines()[-1] == first.splitlines()[-1]  # same plan, same loss


@pytest.mark.slow
@needs_fork
@pytest.mark.parametrize("cache", ["on", "off"])
def test_the_first_chunk_traced_in_a_forked_process_gives_the_same_model(cold, tmp_path, monkeypatch, cache):
    """With a cold cache the first chunk's trace runs in a forked child while this process
    traces the example chunk (saved_cache.stored_saved_tensors_for_examples); the model is
    the one two traces here give. With the cache off the child's result comes back through
    its pipe alone."""
    import shutil
    from sppo_fx.util.log import record_phases
    from sppo_fx.passes.cost import chunk_costs
    monkeypatch.setenv("SPPO_FX_MEMORY_MODEL_CACHE", cache)
    program, seq, params = _llama()
    kw = dict(params=params, partition="min_cut", recomputes=("none", "cheap"))
    with record_phases() as phases:
        forked = chunk_costs(program, seq, **kw)
    assert len(cold) == 1, "this process traced the first chunk too"
    # one progress line for both traces, not a nested one for this process's own
    assert [name for name, _ in phases if name.startswith("memory model")] == [
        "memory model: saved activations under recompute none/cheap (AOTAutograd partitions; "
        "the first chunk's traced in a forked process)"]
    assert len(_stored(tmp_path)) == (2 if cache == "on" else 0)  # the child stored its own
    saved_cache.forget()
    shutil.rmtree(tmp_path / "memory_model", ignore_errors=True)
    monkeypatch.setenv("SPPO_FX_FORK", "off")
    del cold[:]
    here = chunk_costs(program, seq, **kw)
    assert len(cold) == 2
    for policy in kw["recomputes"]:
        a, b = forked[policy], here[policy]
        assert a.saved_first is not None and a.example == b.example
        assert [dataclasses.astuple(s) for s in a.saved_first] == [dataclasses.astuple(s) for s in b.saved_first]
        assert [dataclasses.astuple(s) for s in a.saved] == [dataclasses.astuple(s) for s in b.saved]
        assert a.level2_bytes == b.level2_bytes
