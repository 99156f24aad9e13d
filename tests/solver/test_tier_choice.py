"""The offload tier as part of the budget search (`offload="auto"`, solver/rank_budget.py):
each tier that frees device memory is solved on its own bandwidth and clock, the fastest
predicted plan within the budget and the host memory wins, the Plan records it and the
store follows the Plan. Hand-made profiles; one tiny end-to-end run on CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model

import sppo_fx
from sppo_fx import InfeasibleBudget, Plan, SppoError
from sppo_fx.options import compile_options
from sppo_fx.solver.budget import solve
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.profiles import DeviceProfile
from sppo_fx.solver.rank_budget import host_bytes, host_memory_available, solve_budget

MiB, GiB = 2**20, 2**30
COST = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=40)
MEM = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c + 64 * (p + c), fixed_bytes=MiB,
                  tensors=8)
T = 2048
BUDGET = 12 * MiB  # keeping everything needs ~36 MiB: every plan offloads
# a fast host link (NVLink-C2C-like) against a slow disk, and the reverse
FAST_HOST = DeviceProfile("fast-host", flops_per_s=1e12, d2h_bytes_per_s=1e11, h2d_bytes_per_s=1e11,
                          disk_write_bytes_per_s=1e8, disk_read_bytes_per_s=1e8, memory_bytes=80 * GiB,
                          file_seconds=1e-4, op_seconds=1e-6)
SLOW_HOST = dataclasses.replace(FAST_HOST, name="slow-host", d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6,
                                disk_write_bytes_per_s=1e11, disk_read_bytes_per_s=1e11)


def _auto(profile, device="cuda", **kw):
    return solve_budget(COST, [MEM], T, kw.pop("budget", BUDGET), profile=profile, device=device, offload="auto",
                        host_memory=kw.pop("host_memory", 64 * GiB), **kw)[0]


def test_a_fast_host_link_picks_host():
    plan = _auto(FAST_HOST)
    assert plan.tier == "host" and any(plan.offload_ratios) and plan.peak_bytes <= BUDGET
    assert set(plan.tier_steps) == {"host", "disk"}
    assert plan.tier_steps["host"] == plan.step_seconds < plan.tier_steps["disk"]


def test_a_slow_host_link_picks_disk():
    plan = _auto(SLOW_HOST)
    assert plan.tier == "disk" and any(plan.offload_ratios) and plan.peak_bytes <= BUDGET
    assert plan.tier_steps["disk"] == plan.step_seconds < plan.tier_steps["host"]


def test_each_tier_is_solved_on_its_own_bandwidth_and_clock():
    """What auto reports per tier is what that tier given alone plans."""
    plan = _auto(FAST_HOST)
    for tier in ("host", "disk"):
        alone, _ = solve_budget(COST, [MEM], T, BUDGET, profile=FAST_HOST, device="cuda", offload=tier,
                                host_memory=64 * GiB)
        assert alone.tier == tier and alone.tier_steps is None
        assert plan.tier_steps[tier] == pytest.approx(alone.step_seconds)
    disk, _ = solve_budget(COST, [MEM], T, BUDGET, profile=FAST_HOST, device="cuda", offload="disk")
    assert disk.step_terms["overhead"] > plan.step_terms["overhead"]  # the disk's files cost; host has none


def test_a_small_host_memory_picks_disk():
    host, _ = solve_budget(COST, [MEM], T, BUDGET, profile=FAST_HOST, device="cuda", offload="host",
                           host_memory=64 * GiB)
    pinned = host_bytes(host, MEM)
    assert pinned > MiB
    plan = _auto(FAST_HOST, host_memory=pinned - 1)
    assert plan.tier == "disk" and plan.tier_steps == {"host": None, "disk": plan.step_seconds}
    assert "host not within host memory" in str(plan)
    assert _auto(FAST_HOST, host_memory=pinned).tier == "host"  # the same plan, just fitting
    # a given host tier that needs more than it may pin is refused, naming the option
    with pytest.raises(SppoError, match="host_memory="):
        solve_budget(COST, [MEM], T, BUDGET, profile=FAST_HOST, device="cuda", offload="host", host_memory=MiB)


def test_a_pipeline_rank_counts_every_micro_batch_in_flight_against_host_memory():
    """A rank holds `inflight` micro-batches' offloads at once: host memory that fits one
    sequence's but not three sends the rank to disk."""
    lengths, one_budget = [512] * 4, 28 * MiB  # four fixed chunks fit from ~22 MiB
    one, _ = solve_budget(COST, [MEM], T, one_budget, profile=FAST_HOST, device="cuda", offload="host",
                          chunk_lengths=lengths, host_memory=64 * GiB)
    share = host_bytes(one, MEM)
    assert share > 0
    budget = MiB + 3 * (one_budget - MiB)  # the rank's share is one sequence against one_budget
    kw = dict(chunk_lengths=lengths, inflight=3, rank=1, schedule="1f1b", budget=budget)
    assert _auto(FAST_HOST, host_memory=3 * share, **kw).tier == "host"
    assert _auto(FAST_HOST, host_memory=2 * share, **kw).tier == "disk"


def test_host_is_never_chosen_on_a_cpu_device():
    """On a CPU the host tier keeps the tensor where it is: it frees nothing, so it is no
    candidate, however fast its link, and a given one cannot serve a budget."""
    plan = _auto(FAST_HOST, device="cpu")
    assert plan.tier == "disk" and list(plan.tier_steps) == ["disk"]
    assert "the only tier that frees device memory" in str(plan)
    for tier, device in (("host", "cpu"), ("device", "cpu"), ("device", "cuda")):
        with pytest.raises(SppoError, match=f"offload='{tier}' frees no memory of a {device} device"):
            solve_budget(COST, [MEM], T, BUDGET, profile=FAST_HOST, device=device, offload=tier)


def test_an_infeasible_budget_names_the_minimum_under_auto():
    with pytest.raises(InfeasibleBudget) as auto:
        _auto(FAST_HOST, budget=MiB)
    with pytest.raises(InfeasibleBudget) as disk:
        solve(COST, [MEM], T, MiB, rate=1e12, bandwidth=1e8)
    assert auto.value.minimum_bytes == disk.value.minimum_bytes > MiB


def test_the_plan_records_and_prints_the_tier_choice():
    plan = _auto(FAST_HOST)
    text = str(plan)
    assert "offloaded (host)" in text and "tier host chosen by offload='auto' (over disk " in text
    back = Plan.from_json(plan.to_json())
    assert back.tier == "host" and back.tier_steps == plan.tier_steps


def test_auto_is_the_default_under_a_budget_and_needs_one():
    assert compile_options(budget="1GiB").offload == "auto"
    assert compile_options(budget="1GiB", offload="disk").offload == "disk"
    assert compile_options(chunks=2).offload is None
    with pytest.raises(SppoError, match="offload='auto' lets the budget solver choose"):
        compile_options(chunks=2, offload="auto")
    assert compile_options(budget="1GiB", host_memory="2GiB").host_memory == 2 * GiB
    for bad in (dict(chunks=2, host_memory="2GiB"), dict(budget="1GiB", offload="disk", host_memory="2GiB")):
        with pytest.raises(SppoError, match="host_memory="):
            compile_options(**bad)
    with pytest.raises(SppoError, match="host_memory"):
        compile_options(budget="1GiB", host_memory="lots")


def test_the_store_tier_follows_the_plan_under_auto():
    auto, given = compile_options(budget="1GiB"), compile_options(budget="1GiB", offload="disk")
    plan = Plan(8, [4, 4], offload_ratios=[1.0, 0.0], tier="device")
    assert auto.tier_for(plan) == "device" and given.tier_for(plan) == "disk"


def test_host_memory_is_shared_by_the_processes_on_the_host(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = host_memory_available()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = host_memory_available()
    assert 0 < alone and 0 < shared <= alone / 2  # 1/4, give or take what MemAvailable moved


@pytest.mark.slow
def test_auto_on_cpu_offloads_to_disk_and_stays_exact(tmp_path):
    """End to end under a budget with the default offload="auto" on CPU: the plan picks
    disk, the store is the disk tier, bytes reach the disk, and loss and gradients match
    the eager model."""
    model = tiny_model("llama")
    x, y = torch.randint(0, 97, (2, 512)), torch.randint(0, 97, (2, 512))
    ref = model(x, y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    profile = dataclasses.replace(FAST_HOST, flops_per_s=1e10, disk_write_bytes_per_s=1e9,
                                  disk_read_bytes_per_s=1e9)
    # the smallest budget any plan meets, from the memory model (no chunk program compiles)
    from sppo_fx.orchestrate.stage import memory_models, prepare
    entry = prepare(model, None, compile_options(budget="1GiB", compile=False), ((x, y), {}, None), [x, y])
    try:
        solve(entry.cost, memory_models(entry, ("none",)), 512, 1, rate=1e10, bandwidth=1e9)
        raise AssertionError("a 1-byte budget was feasible")
    except InfeasibleBudget as e:
        budget = int(e.minimum_bytes * 1.2)
    model.zero_grad(set_to_none=True)
    compiled = sppo_fx.compile(model, budget=budget, compile=False, recompute="none", skeleton="keep",
                               offload_dir=str(tmp_path))
    assert compiled.options.offload == "auto" and compiled.store is None  # no plan, no tier yet
    compiled.profile = profile
    loss = compiled(x, y)
    plan, store = compiled.plan, compiled.store
    assert plan.tier == "disk" and list(plan.tier_steps) == ["disk"] and max(plan.offload_ratios) > 0
    assert store.tier == "disk" and store is compiled._stores["disk"] and len(compiled._stores) == 1
    # between forward and backward the offloaded activations are files in offload_dir
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert store.bytes_offloaded > 0 and on_disk >= store.bytes_offloaded
    loss.backward()
    assert store.bytes_offloaded == 0
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)

