"""The benchmark engine (sppo_fx/benchmark/): grid, budgets, ratios, records, picture, end to end."""
from __future__ import annotations

import json
import math

import pytest

from sppo_fx.benchmark import plot, report
from sppo_fx.benchmark.config import BenchConfig, build_grid, min_headroom, resolve_budget
from sppo_fx.benchmark.engine import NOISE_FLOOR_BYTES, add_ratios, with_eager_reference
from sppo_fx.cli import main
from sppo_fx.errors import SppoError

MiB = 2**20


def _labels(rows):
    return [c.label for c in rows]


def test_grid_is_the_product_of_the_axes_with_anchors():
    rows = build_grid(BenchConfig(), ["eager", "compile-amb:0.25", "checkpoint"],
                      {"budget": "none,25%,2GiB", "chunks": "2,4", "offload": "none,disk"})
    labels = _labels(rows)
    assert labels[:3] == ["eager", "compile-amb:0.25", "checkpoint"]
    # no budget: 2 chunks x 2 tiers; each budget: the solver picks the chunks, so 2 tiers
    assert len(rows) == 3 + 4 + 2 + 2 and len(set(labels)) == len(labels)
    assert "sppo budget=25% offload=disk" in labels and "sppo chunks=2" in labels
    assert all(c.chunks is None for c in rows if c.budget)
    every = build_grid(BenchConfig(), [], {"chunks": "2", "partition": "balanced,even", "recompute": "none,cheap",
                                           "skeleton": "keep,offload", "stages": "1,2", "microbatches": "1,2",
                                           "schedule": "1f1b,gpipe", "compile": "on,off", "dtype": "fp32,bf16",
                                           "device": "cpu,cuda"})
    assert len(every) == 2 ** 9
    assert rows[1].kind == "compile-amb" and rows[1].amb == 0.25


def test_only_and_skip_prune_the_grid():
    axes = {"budget": "none,25%", "chunks": "0,2,4", "offload": "none,disk"}
    rows = build_grid(BenchConfig(), ["eager"], axes, only=["offload=disk", "kind=eager"], skip=["chunks=4"])
    assert _labels(rows) == ["eager", "sppo chunks=2 offload=disk", "sppo budget=25% offload=disk"]
    rows = build_grid(BenchConfig(), ["eager", "checkpoint"], axes, only=["budget=25%|none,offload=none"])
    assert _labels(rows) == ["sppo chunks=2", "sppo chunks=4", "sppo budget=25%"]  # anchors have no budget
    with pytest.raises(SppoError, match="empty"):
        build_grid(BenchConfig(), ["eager"], {}, only=["kind=compile"])
    with pytest.raises(SppoError, match="--offload 'tape'"):
        build_grid(BenchConfig(), [], {"offload": "none,tape"})
    with pytest.raises(SppoError, match="compile-amb:F"):
        build_grid(BenchConfig(), ["compile-amb:2"], {})
    with pytest.raises(SppoError, match="filter"):
        build_grid(BenchConfig(), ["eager"], {}, only=["nonsense"])


def test_chunks_zero_is_the_eager_anchor_and_a_reference_is_added():
    rows = build_grid(BenchConfig(), [], {"chunks": "0,2"})
    assert _labels(rows) == ["eager", "sppo chunks=2"]
    rows = with_eager_reference(build_grid(BenchConfig(), ["checkpoint"], {"budget": "50%", "dtype": "fp32,bf16"}))
    assert [c.label for c in rows if c.kind == "eager"] == ["eager bf16", "eager"]


def test_budget_fraction_resolves_against_the_measured_eager_peak():
    assert resolve_budget("25%", 400 * MiB) == 100 * MiB
    assert resolve_budget("2GiB", 400 * MiB) == 2 * 2**30
    assert resolve_budget("2GiB", None) == 2 * 2**30
    assert resolve_budget("min", 400 * MiB) is None and resolve_budget(None, 1) is None
    assert resolve_budget("min+10%", 400 * MiB) is None
    assert (min_headroom("min"), min_headroom("min+10%"), min_headroom("25%")) == (0.0, 0.1, None)
    for bad in ("min+", "min+10", "min+-5%", "min+x%"):
        with pytest.raises(SppoError, match="min\\+10%"):
            build_grid(BenchConfig(), [], {"budget": bad})
    with pytest.raises(SppoError, match="eager's measured peak"):
        resolve_budget("25%", 0)
    with pytest.raises(SppoError):
        build_grid(BenchConfig(), [], {"budget": "lots"})


def _row(label, steps, peaks, anchor=False, kind=None, **extra):
    return {"label": label, "config": {"kind": kind or ("eager" if anchor else "sppo")}, "anchor": anchor,
            "step_s": sorted(steps)[len(steps) // 2], "first_s": 1.0, "peak_extra_bytes": max(peaks),
            "step_by_round": list(steps), "peak_by_round": list(peaks), **extra}


def test_ratios_to_a_named_baseline_with_round_spread():
    rows = [_row("eager", [2.0, 4.0, 2.0], [400 * MiB] * 3, anchor=True),
            _row("compile", [1.0, 1.0, 1.0], [200 * MiB] * 3, anchor=True, kind="compile"),
            _row("sppo budget=25%", [2.2, 3.6, 2.0], [100 * MiB] * 3, budget_bytes=100 * MiB,
                 predicted_peak_bytes=80 * MiB, predicted_step_s=1.0)]
    base, notes = add_ratios(rows, "eager")
    assert base["label"] == "eager" and not notes
    lib = rows[2]
    assert lib["time_ratios"] == pytest.approx([1.1, 0.9, 1.0]) and lib["time_ratio"] == pytest.approx(1.0)
    assert lib["memory_ratio"] == pytest.approx(0.25)
    assert lib["peak_vs_predicted"] == pytest.approx(1.25) and lib["time_vs_predicted"] == pytest.approx(2.2)
    assert lib["fits_budget"]
    table = report.format_table(rows, base, notes)
    assert "vs eager" in table and "0.90..1.10" in table and "pred. peak MiB" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("sppo budget=25%"))
    assert " 80 " in line and "1.25" in line and "100 (yes)" in line
    base, _ = add_ratios(rows, "compile")
    assert rows[0]["time_ratio"] == pytest.approx(2.0) and rows[0]["memory_ratio"] == pytest.approx(2.0)
    base, _ = add_ratios(rows, "sppo budget=25%")
    assert rows[1]["memory_ratio"] == pytest.approx(2.0)
    with pytest.raises(SppoError, match="names no row"):
        add_ratios(rows, "checkpoint")


def test_ratio_to_a_denominator_within_noise_of_zero_is_a_dash_with_a_footnote():
    rows = [_row("eager", [1.0], [NOISE_FLOOR_BYTES // 2], anchor=True),
            _row("sppo chunks=2", [1.5], [3 * MiB], predicted_peak_bytes=None)]
    base, notes = add_ratios(rows, None)
    assert rows[1]["memory_ratio"] is None and rows[1]["time_ratio"] == pytest.approx(1.5)
    assert len(notes) == 1 and "within noise of zero" in notes[0]
    table = report.format_table(rows, base, notes)
    line = next(ln for ln in table.splitlines() if ln.startswith("sppo chunks=2"))
    assert "–" in line and "within noise of zero" in table
    assert "pipeline plans predict their step time only" in table  # a row without a prediction says why
    # a baseline whose own peak varies over rounds by as much as it is large is noise too
    rows = [_row("eager", [1.0, 1.0], [0, 60 * MiB], anchor=True), _row("sppo", [1.0, 1.0], [9 * MiB] * 2)]
    add_ratios(rows, "eager")
    assert rows[1]["memory_ratio"] is None
    rows = [_row("eager", [1.0], [500 * MiB], anchor=True), _row("sppo", [1.0], [9 * MiB])]
    assert add_ratios(rows, "eager")[1] == [] and rows[1]["memory_ratio"] == pytest.approx(9 / 500)


HAND_POINTS = [plot.Point("eager", 10.0, 4000 * MiB, True), plot.Point("compile", 8.0, 3000 * MiB, True),
               plot.Point("checkpoint", 12.0, 700 * MiB, True), plot.Point("sppo 50%", 9.0, 1600 * MiB),
               plot.Point("sppo 25%", 11.0, 1000 * MiB), plot.Point("sppo slow", 13.0, 1200 * MiB),
               plot.Point("sppo same", 9.0, 1700 * MiB)]


def test_pareto_front_on_hand_made_points():
    front = plot.pareto_front(HAND_POINTS)
    assert [HAND_POINTS[i].label for i in front] == ["checkpoint", "sppo 25%", "sppo 50%", "compile"]
    assert plot.pareto_front([plot.Point("a", 1.0, 1.0), plot.Point("b", 1.0, 1.0)]) == [0]
    text = plot.text_plot(HAND_POINTS)
    assert text.count("[Pareto front]") == 4 and "sppo slow" in text


def test_records_round_trip_and_compare(tmp_path):
    rows = [_row("eager", [2.0], [400 * MiB], anchor=True), _row("sppo", [3.0], [100 * MiB])]
    add_ratios(rows, "eager")
    for r in rows:
        r["config"] = BenchConfig(kind=r["config"]["kind"]).to_dict()
    before = {"grid": [r["config"] for r in rows], "rounds": 1, "runs": [], "rows": rows, "commit": "abc",
              "machine": report.machine()}
    json_path, csv_path = report.write_records(before, str(tmp_path / "a"))
    assert report.load_record(str(tmp_path / "a")) == json.loads(json.dumps(before))
    assert open(csv_path).read().count("\n") == 3 and "config.budget" in open(csv_path).readline()
    after = json.loads(json.dumps(before))
    after["rows"][1].update(step_s=1.5, peak_extra_bytes=50 * MiB)
    report.write_records(after, str(tmp_path / "b"))
    assert main(["bench", "--compare", json_path, str(tmp_path / "b" / "bench.json")]) == 0
    text = report.compare(before, after)
    line = next(ln for ln in text.splitlines() if ln.startswith("sppo"))
    assert line.split()[-1] == "0.50" and line.split()[3] == "0.50"
    m = report.machine()
    assert {"cpu", "cores", "gpu", "torch", "triton"} <= set(m)
    with pytest.raises(SppoError, match="not a record"):
        (tmp_path / "bad.json").write_text("[]")
        report.load_record(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_bench_runs_anchors_and_library_rows_end_to_end(tmp_path, capsys):
    """A tiny grid in worker processes: eager and checkpointing beside library rows without
    a budget, with one (recompute fixed to keep the solver quick), and the former grid's
    disk tier on two pipeline stages (local ranks), pruned with --skip. The budget row
    (50% above the solver's minimum)
    carries the plan's predictions beside its measurements; every row's loss and
    gradients (pipeline ranks' merged) equal eager's."""
    out = tmp_path / "run"
    code = main(["bench", "--size", "tiny", "--seq-len", "64", "--steps", "1", "--anchors", "eager,checkpoint",
                 "--chunks", "2", "--budget", "none,min+50%", "--recompute", "none", "--offload", "none,disk",
                 "--stages", "1,2", "--skip", "offload=disk,stages=1", "--skip", "budget=min+50%,stages=2",
                 "--skip", "offload=none,stages=2", "--baseline", "checkpoint",
                 "--out", str(out), "--plot", str(tmp_path / "p.png")])
    stdout, err = capsys.readouterr()
    assert code == 0, stdout + err
    record = report.load_record(str(out))
    rows = {r["label"]: r for r in record["rows"]}
    assert list(rows) == ["eager", "checkpoint", "sppo chunks=2 recompute=none",
                          "sppo chunks=2 recompute=none offload=disk stages=2", "sppo budget=min+50% recompute=none"]
    assert record["baseline"] == "checkpoint" and rows["checkpoint"]["time_ratio"] == 1.0
    assert record["machine"]["cores"] and len(record["runs"]) == 5 and "commit" in record
    assert "load_average_1min_end" in record["machine"]  # the start's load, and the end's
    for r in rows.values():
        assert r["step_s"] > 0 and r["first_s"] > 0 and r["max_grad_diff"] < 1e-5, r
        assert abs(r["loss"] - rows["eager"]["loss"]) < 1e-4
    budgeted = rows["sppo budget=min+50% recompute=none"]
    minimum = budgeted["minimum_budget_bytes"]  # the solver's, from the worker's 1-byte probe
    assert minimum > 0 and budgeted["budget_bytes"] == math.ceil(1.5 * minimum)
    assert 0 < budgeted["predicted_peak_bytes"] <= budgeted["budget_bytes"]
    assert budgeted["predicted_step_s"] > 0 and "time_vs_predicted" in budgeted
    # the first call by phase (the worker's `first_phases`), summing to it with "other"
    phases = dict(budgeted["first_phases"])
    assert any(name.startswith("solving the budget") for name in phases) and any(
        name.startswith("other") for name in phases), phases
    assert sum(phases.values()) == pytest.approx(budgeted["first_s"], abs=0.1)
    run = next(r for r in record["runs"] if r["label"] == "sppo budget=min+50% recompute=none")
    assert any("solving the budget" in line for line in run["first_log"])
    # a plan the solver did not choose is predicted by the same models
    fixed = rows["sppo chunks=2 recompute=none"]
    assert fixed["predicted_peak_bytes"] > 0 and fixed["predicted_step_s"] > 0 and "peak_vs_predicted" in fixed
    for r in (fixed, budgeted):  # the predicted step's terms, for the clock grid's breakdown
        assert sum(r["predicted_terms"].values()) == pytest.approx(r["predicted_step_s"])
    assert "pred. peak MiB" in stdout and "vs checkpoint" in stdout and "peak extra MiB" in stdout
    assert "[round 1/1, 5/5]" in err and "step " in err  # progress while it runs
    assert (out / "bench.csv").read_text().count("\n") == 6  # header + 5 rows
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p.svg").exists()


def _bench_script(name: str):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", name)
    spec = importlib.util.spec_from_file_location(f"bench_{name[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_memory_script_names_map_to_engine_rows():
    """bench/memory.py is a front end: its configuration names become the engine's rows."""
    import argparse
    mod = _bench_script("memory.py")
    args = argparse.Namespace(chunks=8, sppo_compile=True, tier=None)
    base = BenchConfig(size="bench", seq_len=4096)
    rows = [mod.config_for(n, base, args) for n in mod.CONFIGS + ["sppo-skel-25%"]]
    assert [r.label for r in rows] == ["eager", "compile", "checkpoint", "compile-amb:0.5", "sppo chunks=8 compile=on",
                                       "sppo budget=50% compile=on", "sppo budget=25% compile=on",
                                       "sppo budget=25% skeleton=offload compile=on"]
    assert all(r.seq_len == 4096 for r in rows)
    with pytest.raises(SppoError, match="sppo-N%"):
        mod.config_for("sppo-lots", base, args)


def test_a_timed_out_row_says_which_plan_it_was_running():
    """The worker logs its phases; a row that runs out of time reports its plan (with the
    predicted step) and its last progress line instead of a bare timeout."""
    from sppo_fx.benchmark.engine import _timed_out
    stderr = ("[sppo_fx] capturing the model (torch.export): 3.8 s\nsome warning\n"
              "[sppo_fx] plan: 256 chunks, recompute cheap, K/V skeleton offload, predicted peak 515.2 MiB of "
              "515.2 MiB, predicted step 4.53e+03 s\n[sppo_fx] compiling chunk program #2 (Inductor)… 40 s\n")
    err = _timed_out(1800, stderr.encode())["error"]
    assert err == ("timed out after 1800 s (plan: 256 chunks, recompute cheap, K/V skeleton offload, predicted "
                   "peak 515.2 MiB of 515.2 MiB, predicted step 4.53e+03 s; compiling chunk program #2 "
                   "(Inductor)… 40 s)")
    assert _timed_out(5, None)["error"] == "timed out after 5 s"
    last = "[sppo_fx] plan: 2 chunks, predicted step 1 s\n"
    assert _timed_out(5, last)["error"] == "timed out after 5 s (plan: 2 chunks, predicted step 1 s)"


@pytest.mark.slow
def test_first_step_script_records_its_commit_and_load(tmp_path):
    """bench/first_step.py runs each configuration in its own process and writes a record
    that says which code it measured and how loaded the machine was (eager only: seconds)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "first.json"
    res = subprocess.run([sys.executable, os.path.join(root, "bench", "first_step.py"), "--size", "tiny",
                          "--seq-len", "32", "--configs", "eager", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["commit"] and len(record["commit"].split("+")[0]) == 40
    assert record["load_average_1min"] >= 0 and record["load_average_1min_end"] >= 0
    assert record["results"]["eager"]["first_s"] > 0 and record["budget"] > 0


def test_fresh_pages_prices_a_gib_of_pages_from_the_two_settings():
    """bench/fresh_pages.py: the in-step price is the step's difference between the two
    kinds of process over the difference of their faulted bytes (medians of each kind); a
    row that faults no more under the benchmark's settings has no price."""
    mod = _bench_script("fresh_pages.py")
    GiB = 2 ** 30

    def proc(eager, sppo, probe):
        return {"rows": {"eager": dict(zip(("step_s", "fault_bytes", "sys_s"), eager)),
                         "sppo": dict(zip(("step_s", "fault_bytes", "sys_s"), sppo), predicted_s=5.0,
                                      predicted_terms={"compute": 5.0}, plan="2 chunks")},
                "probe_s_per_gib": [[262144, probe], [1048576, probe / 2]]}
    runs = {"fresh": [proc((6.0, 4 * GiB, 3.0), (7.0, 5 * GiB, 4.0), 0.3),
                      proc((7.0, 4 * GiB, 3.0), (7.0, 5 * GiB, 4.0), 0.5),
                      proc((8.0, 4 * GiB, 3.0), (7.0, 5 * GiB, 4.0), 0.4)],
            "default": [proc((4.5, 0, 0.1), (7.0, 5 * GiB, 0.2), 0.0)]}
    out = mod.summarize(runs)
    assert out["rows"]["eager"]["in_step_s_per_gib"] == pytest.approx((7.0 - 4.5) / 4)
    assert out["rows"]["sppo"]["in_step_s_per_gib"] is None  # as many pages under both
    assert out["rows"]["sppo"]["benchmark_settings"]["predicted_s"] == 5.0
    assert out["rows"]["sppo"]["glibc_defaults"]["plan"] == "2 chunks"
    assert out["probe_s_per_gib"] == [[262144, pytest.approx(0.4)], [1048576, pytest.approx(0.2)]]
    assert "warnings" not in out["rows"]["eager"]
    runs["fresh"][0]["rows"]["eager"]["fault_bytes"] = runs["fresh"][1]["rows"]["eager"]["fault_bytes"] = 32 << 20
    assert mod.summarize(runs)["rows"]["eager"]["in_step_s_per_gib"] is None  # 32 MiB more: noise, no price
    runs["fresh"][0]["rows"]["eager"]["fault_bytes"] = runs["fresh"][1]["rows"]["eager"]["fault_bytes"] = 4 * GiB
    runs["default"][0]["rows"]["eager"]["chunk_lengths"] = [512, 512]  # another plan: no price
    runs["fresh"][0]["rows"]["eager"]["step_s"] = 12.0  # and a process far slower than the others
    row = mod.summarize(runs)["rows"]["eager"]
    assert row["in_step_s_per_gib"] is None and "spread 7.00-12.00 s" in row["warnings"][0]


def test_fresh_pages_workers_run_under_the_benchmarks_settings_or_none():
    from sppo_fx.benchmark.engine import BENCH_MALLOC_ENV
    mod = _bench_script("fresh_pages.py")
    base = {"PATH": "/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1", "GLIBC_TUNABLES": "x"}
    assert mod.worker_env(True, base) == {**base, **BENCH_MALLOC_ENV}  # as the engine's workers
    assert mod.worker_env(False, base) == {"PATH": "/bin"}  # glibc's defaults
