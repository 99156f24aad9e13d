"""What-if planning at paper scale: model specs, the plan command, policies, solver speed."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from sppo_fx.cli import main
from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.solver.profiles import get_profile
from sppo_fx.whatif import (BASELINES, MODELS, Cluster, format_report, get_model, parse_bytes, parse_tokens, plan,
                            plan_config, plan_simulation)

FIGURES = {"stages": int, "chunks": int, "tokens_per_gpu_per_s": float, "peak_bytes_per_gpu": int}


def test_parse_sequence_lengths_and_sizes():
    assert parse_tokens("4M") == 4 * 2**20
    assert parse_tokens("640K") == parse_tokens("640k") == 640 * 1024
    assert parse_tokens("128k") == 131072 and parse_tokens("1000") == 1000 and parse_tokens(77) == 77
    assert parse_tokens("1.5M") == 3 * 2**19
    with pytest.raises(SppoError, match="4M, 640K"):
        parse_tokens("lots")
    assert parse_bytes("256GiB") == 256 << 30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(5) == 5


def test_model_specs_follow_the_papers_table_2():
    shapes = {k: (m.layers, m.hidden, m.heads) for k, m in MODELS.items()}
    assert shapes == {"gpt-7b": (32, 4096, 32), "gpt-13b": (40, 5120, 40), "gpt-65b": (80, 8192, 64)}
    assert [round(MODELS[k].params / 1e9, 1) for k in ("gpt-7b", "gpt-13b", "gpt-65b")] == [6.7, 12.8, 64.8]
    m = MODELS["gpt-7b"]
    cost = m.chunk_cost
    assert cost.per_token == 24 * 4096**2 * 32 + 2 * 4096 * 50257
    assert cost.per_pair == 4 * 4096 * 32
    custom = get_model("custom", layers=4, hidden=256, heads=8)
    assert (custom.layers, custom.hidden, custom.vocab) == (4, 256, 50257)
    with pytest.raises(SppoError, match="--layers"):
        get_model("custom", layers=4)
    with pytest.raises(SppoError, match="gpt-7b"):
        get_model("gpt-3")


def test_plan_json_has_the_documented_keys_and_types(capsys):
    assert main(["plan", "--model", "gpt-7b", "--seq", "4M", "--gpus", "128", "--device", "a100-80gb",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key, typ in FIGURES.items():
        assert isinstance(data[key], typ), (key, data[key])
    assert data["stages"] * data["seq_parallel"] == 128
    assert data["tokens_per_gpu_per_s"] > 0 and 0 < data["peak_bytes_per_gpu"] <= 80 * 2**30
    assert set(data["baselines"]) == {"full_recompute", "naive_full_offload", "uniform_no_adaptive_offload"}
    for name, b in data["baselines"].items():
        for key, typ in FIGURES.items():
            assert isinstance(b[key], typ), (name, key, b[key])
    assert "not a measurement" in data["prediction"]
    assert sum(data["chunk_lengths"]) == 4 * 2**20 and len(data["chunk_lengths"]) == data["chunks"]
    assert data["offload_ratios_stage0"][-1] == 0.0


def test_plan_text_says_these_are_predictions(capsys):
    assert main(["plan", "--model", "gpt-13b", "--seq", "256K", "--gpus", "16", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "MODEL PREDICTIONS" in out and "tokens / GPU / s" in out
    for name in BASELINES:
        assert name in out


def test_custom_model_from_the_command_line(capsys):
    assert main(["plan", "--model", "custom", "--layers", "8", "--hidden", "1024", "--heads", "16",
                 "--seq", "128K", "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 8 and data["hidden"] == 1024 and data["stages"] * data["seq_parallel"] == 8


def test_adaptive_plan_beats_the_baselines_for_gpt65b_at_640k():
    rep = plan("gpt-65b", "640K", 128, "a100-80gb")
    best = rep.best
    lines = [f"\nGPT-65B 640K on 128 x A100-80GB (model prediction): sppo P={best.stages} D={best.seq_parallel} "
             f"N={best.chunks} {best.tokens_per_gpu_per_s:.2f} tokens/GPU/s, peak {best.peak_bytes_per_gpu / 2**30:.1f} GiB"]
    rec = rep.baselines["full_recompute"].tokens_per_gpu_per_s
    for name, b in rep.baselines.items():
        assert b.feasible, name
        assert best.tokens_per_gpu_per_s > b.tokens_per_gpu_per_s, name
        lines.append(f"  {name}: P={b.stages} N={b.chunks} {b.tokens_per_gpu_per_s:.2f} tokens/GPU/s "
                     f"({b.tokens_per_gpu_per_s / rec:.3f}x of full_recompute; SPPO {rep.speedup(name):.4f}x over it)")
    print("\n".join(lines))
    assert best.peak_bytes_per_gpu <= get_profile("a100-80gb").memory_bytes
    assert rep.speedup("full_recompute") > 1.1  # no recompute is the big win in this model
    assert rep.to_dict()["speedup_over"]["full_recompute"] == pytest.approx(rep.speedup("full_recompute"))


def test_planning_gpt65b_with_128_chunks_on_8_stages_is_fast():
    t0 = time.perf_counter()
    res = plan_config("gpt-65b", "640K", 128, "a100-80gb", stages=8, chunks=128)
    dt = time.perf_counter() - t0
    print(f"\nplan_config(gpt-65b, 640K, 128 GPUs, 8 stages x 128 chunks): {dt:.2f} s "
          f"(feasible={res.feasible}, {res.tokens_per_gpu_per_s:.2f} tokens/GPU/s)")
    assert dt < 10.0
    assert res.chunks == 128 and res.stages == 8 and res.step_seconds > 0


def test_sequence_aware_ratios_and_memory_top_up():
    # A short sequence (matmul-dominated) so that not every offload hides behind compute.
    roomy = plan_config("gpt-7b", "32K", 8, "a100-80gb", stages=2, chunks=8)
    r = roomy.offload_ratios
    assert all(row[-1] == 0.0 for row in r)  # the last chunk (first backward) keeps everything
    assert all(0.0 <= a <= 1.0 for row in r for a in row)
    assert any(a < 1.0 for a in r[0][:-1])  # limited by what D2H moves during the next forward
    # FLOPs-balanced chunks are longer early: the hide rule gives them a smaller fraction
    assert r[0][0] <= r[0][-2]
    assert roomy.stall_seconds == pytest.approx(0.0, abs=1e-6)
    # with less device memory, the earliest chunks are raised to 1 first
    floor = plan_config("gpt-7b", "32K", 8, "a100-80gb", stages=2, chunks=8, policy="naive_full_offload")
    assert floor.peak_bytes_per_gpu < roomy.peak_bytes_per_gpu
    usable = (floor.peak_bytes_per_gpu + roomy.peak_bytes_per_gpu) / 2
    small = dataclasses.replace(get_profile("a100-80gb"), memory_bytes=int(usable + Cluster().reserve_bytes))
    tight = plan_config("gpt-7b", "32K", 8, small, stages=2, chunks=8)
    assert tight.feasible and tight.peak_bytes_per_gpu <= usable
    assert tight.offload_ratios[0][0] == 1.0 and tight.offload_ratios[0][-1] == 0.0
    assert sum(tight.offload_ratios[0]) > sum(r[0])


def test_plan_simulation_events_carry_out_the_plan():
    """The recorded events are the plan's: every chunk's forward and backward once per
    rank, in dependency order, one compute at a time; an offload and a read-back of equal
    size exactly for the chunks the plan offloads, each read back before its backward; the
    last event ends at the plan's step time, the busiest rank computes for the events' sum."""
    res = plan_config("gpt-7b", "128K", 16, "h100", stages=4, chunks=8)
    assert res.feasible and res.tier == "host"
    sim = plan_simulation(res)
    P, N = res.stages, res.chunks
    assert max(e.end for e in sim.events) == pytest.approx(res.pipeline_seconds)
    for r in range(P):
        ev = [e for e in sim.events if e.rank == r]
        compute = sorted((e for e in ev if e.resource == "compute"), key=lambda e: e.start)
        for a, b in zip(compute, compute[1:]):
            assert b.start >= a.end - 1e-12, (a, b)  # one compute at a time
        fwd = {e.name: e for e in compute if e.category == "forward"}
        bwd = {e.name: e for e in compute if e.category == "backward"}
        assert sorted(fwd) == sorted(f"{r}F0.{i}" for i in range(N))
        assert sorted(bwd) == sorted(f"{r}B0.{i}" for i in range(N))
        for i in range(N - 1):
            assert fwd[f"{r}F0.{i + 1}"].start >= fwd[f"{r}F0.{i}"].end - 1e-12
            assert bwd[f"{r}B0.{i}"].start >= bwd[f"{r}B0.{i + 1}"].end - 1e-12
        assert bwd[f"{r}B0.{N - 1}"].start >= fwd[f"{r}F0.{N - 1}"].end - 1e-12
        assert sum(e.end - e.start for e in compute) == pytest.approx(sim.busy_seconds[r])
        off = {e.name.replace("OFF", ""): e for e in ev if e.category == "offload"}
        pre = {e.name.replace("PRE", ""): e for e in ev if e.category == "prefetch"}
        planned = {f"{r}0.{i}" for i, a in enumerate(res.offload_ratios[r]) if a > 0}
        assert set(off) == set(pre) == planned, (r, sorted(off), res.offload_ratios[r])
        for key, e in off.items():
            i = int(key.split(".")[1])
            assert e.start >= fwd[f"{r}F0.{i}"].start - 1e-12 and e.nbytes > 0
            assert pre[key].nbytes == pytest.approx(e.nbytes) and pre[key].start >= e.end - 1e-12
            assert bwd[f"{r}B0.{i}"].start >= pre[key].end - 1e-12  # back before its backward
        assert sum(e.nbytes for e in off.values()) == pytest.approx(sim.offloaded_bytes[r])
        assert max(b for _t, b in sim.memory_timeline[r]) == pytest.approx(sim.peak_bytes[r])
    assert max(sim.peak_bytes.values()) == pytest.approx(res.peak_bytes_per_gpu)


def test_nothing_fits_names_the_minimum_memory(capsys):
    with pytest.raises(InfeasibleBudget) as info:
        plan("gpt-65b", "4M", 128, "a100-80gb")
    assert info.value.minimum_bytes > 80 * 2**30
    assert "minimum needed" in str(info.value)
    assert main(["plan", "--model", "gpt-65b", "--seq", "4M", "--gpus", "128", "--device", "a100-80gb"]) != 0
    err = capsys.readouterr().err
    assert "minimum needed" in err and "GiB" in err


def test_bad_layouts_are_refused_with_a_reason():
    with pytest.raises(SppoError, match="stages must divide"):
        plan("gpt-7b", "128K", 8, "h100", stages=3)
    with pytest.raises(SppoError, match="gpus must be a positive"):
        plan("gpt-7b", "128K", 0, "h100")


def test_more_host_memory_or_a_bigger_device_never_hurts():
    base = plan("gpt-13b", "512K", 32, "a100-80gb")
    h200 = plan("gpt-13b", "512K", 32, "h200")
    assert h200.best.tokens_per_gpu_per_s >= base.best.tokens_per_gpu_per_s
    unsharded = plan("gpt-13b", "512K", 32, "h200", shard_optimizer=False, cluster=Cluster())
    assert "not sharded" in format_report(unsharded)
