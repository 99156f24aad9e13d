"""The hidden fraction of the activation store's copy time (sppo_fx/benchmark/copy_overlap.py):
interval arithmetic on hand-built Chrome-trace events (CPU and CUDA shapes), and one real
profiled step of a tiny model offloading to disk."""
from __future__ import annotations

import contextlib

import pytest
import torch

from sppo_fx.benchmark.copy_overlap import analyze, intersect, profile_step, subtract, union

MAIN, W1, W2 = 100, 201, 202  # thread ids: the step's thread, two store workers


def op(ts, dur, tid=MAIN, name="aten::mm", cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def write(ts, dur, tid=W1):
    return op(ts, dur, tid, "sppo::offload_write", "user_annotation")


def read(ts, dur, tid=W2):
    return op(ts, dur, tid, "sppo::offload_read", "user_annotation")


def wait(ts, dur, tid=MAIN):
    return op(ts, dur, tid, "sppo::copy_wait", "user_annotation")


def test_union_intersect_subtract():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert intersect([(0, 1)], [(1, 2)]) == []
    assert subtract([(0, 10)], [(2, 3), (9, 12)]) == [(0, 2), (3, 9)]
    assert subtract([(0, 4)], [(0, 4)]) == []


def test_cpu_fully_hidden():
    ov = analyze([op(0, 1000), write(100, 300), read(500, 200)])
    assert ov.copy_s == pytest.approx(500e-6) and ov.hidden_s == pytest.approx(500e-6)
    assert ov.hidden_fraction == pytest.approx(1.0) and ov.copies == 2


def test_cpu_fully_exposed():
    # copies while the step's thread runs nothing (a gap between ops)
    ov = analyze([op(0, 100), write(100, 50), op(150, 100), read(300, 40)])
    assert ov.copy_s == pytest.approx(90e-6) and ov.hidden_s == 0 and ov.hidden_fraction == 0


def test_cpu_partial_and_nested_ops_counted_once():
    # nested ops (mm inside linear) must not double the compute that covers the copy
    events = [op(0, 100, name="aten::linear"), op(10, 80), write(50, 100)]
    ov = analyze(events)
    assert ov.hidden_s == pytest.approx(50e-6) and ov.hidden_fraction == pytest.approx(0.5)


def test_cpu_overlapping_copies_counted_once():
    # two workers copy at once: 150 us of copy time, not 200
    ov = analyze([op(0, 100), write(0, 100, W1), write(50, 100, W2)])
    assert ov.copy_s == pytest.approx(150e-6) and ov.hidden_s == pytest.approx(100e-6)
    assert ov.hidden_fraction == pytest.approx(100 / 150)


def test_cpu_waiting_is_not_compute():
    # the step blocks inside an op (the graph's sppo.wait) on the copy: exposed, not hidden
    events = [op(0, 200, name="sppo::wait"), wait(10, 180), write(0, 200)]
    ov = analyze(events)
    assert ov.copy_s == pytest.approx(200e-6) and ov.hidden_s == pytest.approx(20e-6)


def test_cpu_worker_ops_are_not_compute():
    # the worker's own aten ops (contiguous, copy_) inside its range do not hide it
    ov = analyze([write(0, 100), op(10, 50, tid=W1, name="aten::copy_")])
    assert ov.hidden_s == 0


def test_no_copies():
    ov = analyze({"traceEvents": [op(0, 100)]})
    assert ov.copy_s == 0 and ov.hidden_fraction is None and ov.copies == 0


# -- CUDA-shaped traces: device activities matched to the store's ranges by correlation id
def launch(ts, corr, tid):
    return {**op(ts, 5, tid, "cudaMemcpyAsync", "cuda_runtime"), "args": {"correlation": corr}}


def dev(ts, dur, corr, cat="kernel", name="gemm", stream=7, nbytes=None):
    args = {"correlation": corr}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "pid": 0, "args": args}


def test_cuda_copies_by_correlation():
    events = [
        write(0, 500, W1), launch(10, 1, W1),  # the store's D2H, launched in its range
        read(600, 500, W2), launch(610, 2, W2),  # the store's H2D
        launch(20, 3, MAIN),  # an unrelated H2D (input upload): neither copy nor compute
        dev(100, 200, 1, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", stream=20, nbytes=4096),
        dev(700, 100, 2, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", stream=24, nbytes=4096),
        dev(0, 250, 3, "gpu_memcpy", "Memcpy HtoD (Pageable -> Device)"),
        dev(150, 300, 4), dev(700, 40, 5),  # compute kernels
    ]
    ov = analyze(events)
    assert ov.copies == 2 and ov.bytes == 8192
    assert ov.copy_s == pytest.approx(300e-6)
    assert ov.hidden_s == pytest.approx(150e-6 + 40e-6)
    assert "store" in ov.source


def test_cuda_without_store_ranges_falls_back_to_host_device_memcpys():
    events = [dev(0, 100, 1, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", nbytes=10),
              dev(50, 100, 2), dev(0, 30, 3, "gpu_memcpy", "Memcpy DtoD (Device -> Device)")]
    ov = analyze(events)
    assert ov.copies == 1 and ov.copy_s == pytest.approx(100e-6)
    assert ov.hidden_s == pytest.approx(80e-6)  # the kernel and the device-to-device copy
    assert "no store ranges" in ov.source


def test_store_ranges_only_while_profiling():
    from sppo_fx.runtime.store.core import profiled
    assert isinstance(profiled("sppo::offload_write"), contextlib.nullcontext)  # free without a profiler
    seen = []
    _, ov = profile_step(lambda: seen.append(type(profiled("sppo::offload_write")).__name__))
    assert seen == ["record_function"]


def test_profiled_store_step(tmp_path):
    """Saved activations of a small MLP go to disk and back through the store's worker
    threads: the trace holds their copies, counted against the step's compute."""
    from sppo_fx.runtime.store import ActivationStore
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(4)]
    x = torch.randn(512, 256)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        def step():
            with store.saved_tensor_hooks(min_bytes=1 << 16):
                h = x
                for layer in layers:
                    h = torch.tanh(layer(h))
                loss = h.square().mean()
            loss.backward()
            return loss
        _, ov = profile_step(step)
        assert store.peak_bytes_offloaded > 0
    assert ov.copies >= 2 * len(layers)  # every saved input and tanh output, written and read
    assert ov.copy_s > 0 and 0.0 <= ov.hidden_fraction <= 1.0


@pytest.mark.slow  # capturing the chunk program (Dynamo) takes ~10-70 s on a loaded 2-core machine
def test_profiled_step_with_disk_offload(tmp_path):
    """A real sppo_fx step offloading to disk: the trace holds the store's copies (and bytes moved)."""
    import sppo_fx
    from sppo_fx.models import build
    torch.manual_seed(0)
    model = build("llama", "tiny")
    x, y = (torch.randint(0, 97, (1, 512)) for _ in range(2))
    compiled = sppo_fx.compile(model, chunks=4, offload="disk", offload_dir=str(tmp_path), compile=False)
    compiled.step(x, y)  # the first call captures and plans; not profiled
    model.zero_grad(set_to_none=True)
    loss, ov = profile_step(lambda: compiled.step(x, y))
    assert compiled.store.peak_bytes_offloaded > 0  # bytes actually moved
    assert torch.isfinite(loss)
    assert ov.copies > 0 and ov.copy_s > 0
    assert 0.0 <= ov.hidden_fraction <= 1.0
    assert ov.hidden_s <= ov.copy_s


def _bench_memory():
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(root, "bench", "memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_memory_hidden_copy_lines():
    bench = _bench_memory()
    ov = lambda copy_s, hidden_s, n=3, nbytes=None: {  # noqa: E731
        "copy_s": copy_s, "hidden_s": hidden_s, "copies": n, "bytes": nbytes,
        "hidden_fraction": hidden_s / copy_s if copy_s else None}
    runs = [{"label": "eager", "round": 0},
            {"label": "sppo budget 25%", "round": 0, "copy_overlap": ov(0.010, 0.008, nbytes=3 << 20)},
            {"label": "sppo budget 25%", "round": 1, "copy_overlap": ov(0.020, 0.018, nbytes=3 << 20)},
            {"label": "sppo budget 90%", "round": 0, "copy_overlap": ov(0.0, 0.0, n=0)}]
    lines = bench.hidden_copy(runs)
    assert lines[0].startswith("hidden copy")
    assert len(lines) == 3  # one per offloading row; eager has none
    assert "85.0%" in lines[1] and "15.0 ms" in lines[1] and "3 MiB moved" in lines[1]  # medians over rounds
    assert "no copies" in lines[2]
    assert bench.hidden_copy(runs[:1]) == []
