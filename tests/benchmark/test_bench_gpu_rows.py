"""bench/memory.py's torch.compile row and its "vs torch.compile" lines."""
import argparse
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(ROOT, "bench", "memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compile_row_is_in_the_default_grid():
    bench = _bench()
    from sppo_fx.benchmark import BenchConfig
    args = argparse.Namespace(sppo_compile=False, chunks=8, tier=None)
    assert bench.config_for("compile", BenchConfig(), args).kind == "compile"
    assert "compile" in bench.CONFIGS


def test_ratios_against_torch_compile():
    bench = _bench()
    rows = [dict(label="eager", config=dict(kind="eager"), step_by_round=[2.0, 2.2, 2.0], peak_by_round=[100, 100, 90]),
            dict(label="compile", config=dict(kind="compile"), step_by_round=[1.0, 1.0, 1.2], peak_by_round=[50, 50, 50]),
            dict(label="sppo", config=dict(kind="sppo"), error="failed")]
    lines = bench.vs_compile(rows)
    assert "eager" in lines[1] and "time  2.00x" in lines[1] and "memory  2.00x" in lines[1]
    assert "time  1.00x" in lines[2] and len(lines) == 3  # the failed row is left out
    assert bench.vs_compile(rows[:1]) == []
