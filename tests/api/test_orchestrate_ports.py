"""main's features as the orchestrator carries them: the solver clock reaches the one budget
solve from one stage and from a pipeline rank; the all-ones input guard runs in the stage's
plan of every call (sppo_fx/orchestrate/, solver/rank_budget.py)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.fx as fx

import sppo_fx.solver.memory_model as memory_model_module
import sppo_fx.solver.profile_cache as profile_cache
from sppo_fx import Plan, SppoError
from sppo_fx.options import compile_options
from sppo_fx.orchestrate import Entry, plan_call
from sppo_fx.orchestrate.ranks import _solve_rank
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.profiles import get_profile
from sppo_fx.solver.rank_budget import solve_budget

MiB = 2**20
COST = ChunkCostModel(per_token=1e7, per_pair=1e3, ops=40)
MEM = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c + 64 * (p + c), fixed_bytes=MiB)
# a clock with figures: compiled programs twice as fast, a fixed cost per op
PROFILE = dataclasses.replace(get_profile("a100-80gb"), compiled_speedup=2.0, op_seconds=1e-4)
LENGTHS = [512] * 4


def _entry(graph: fx.GraphModule | None = None) -> Entry:
    """An Entry whose memory model is given (no AOTAutograd trace) on the meta device (no
    CPU compile probe)."""
    captured = types.SimpleNamespace(param_value=lambda name: torch.empty(0, device="meta"), seq=None)
    program = types.SimpleNamespace(params=["w"])
    return Entry(captured, graph or fx.GraphModule(torch.nn.Module(), fx.Graph()), program, COST, memory={"none": MEM})


def test_the_one_solve_runs_on_the_profiles_clock():
    """Compiled chunk programs run at the profile's compiled_speedup and every op costs
    op_seconds: the plan's step terms say so, for a stage and for a rank alike."""
    for extra in ({}, dict(inflight=3, rank=1, schedule="1f1b")):
        fast, _ = solve_budget(COST, [MEM], 2048, 512 * MiB, profile=PROFILE, device="cuda", offload="host",
                               chunk_lengths=LENGTHS, compiled=True, **extra)
        slow, _ = solve_budget(COST, [MEM], 2048, 512 * MiB, profile=PROFILE, device="cuda", offload="host",
                               chunk_lengths=LENGTHS, compiled=False, **extra)
        assert slow.step_terms["compute"] == pytest.approx(2 * fast.step_terms["compute"])
        assert fast.step_terms["overhead"] > 0
        assert slow.step_terms["overhead"] == pytest.approx(2 * fast.step_terms["overhead"])
        assert fast.step_seconds == pytest.approx(sum(fast.step_terms.values()))


def test_a_stage_plan_is_solved_on_the_clock_of_its_compile_option():
    plans = {}
    for compiled in (True, False):
        options = compile_options(budget="512MiB", recompute="none", skeleton="keep", offload="host",
                                  compile=compiled)
        plans[compiled], profile = plan_call(_entry(), options, 2048, [], PROFILE)
        assert profile is PROFILE
    assert plans[False].step_terms["compute"] == pytest.approx(2 * plans[True].step_terms["compute"])


def test_a_pipeline_rank_is_solved_on_the_clock_of_its_compile_option(monkeypatch):
    monkeypatch.setattr(memory_model_module, "memory_models", lambda *a, **k: [MEM])
    monkeypatch.setattr(profile_cache, "device_profile", lambda *a, **k: PROFILE)
    mesh = types.SimpleNamespace(layout=types.SimpleNamespace(pp=2), pp_rank=1)
    params = [torch.empty(0, device="meta")]
    plans = {}
    for compiled in (True, False):
        options = compile_options(budget="512MiB", recompute="none", stages=2, offload="host", compile=compiled)
        plans[compiled], _quota = _solve_rank(options, None, types.SimpleNamespace(seq=None), params,
                                              Plan(2048, LENGTHS), mesh, 2, COST)
    assert plans[False].step_terms["compute"] == pytest.approx(2 * plans[True].step_terms["compute"])
    assert plans[True].step_terms["overhead"] > 0


def test_a_stage_plan_refuses_a_padded_input_the_program_assumes_all_ones():
    """plan_call checks the call's inputs against the ones guards before it solves."""
    graph = fx.GraphModule(torch.nn.Module(), fx.Graph())
    graph.meta["sppo_ones_inputs"] = [types.SimpleNamespace(index=0, label="attention_mask")]
    options = compile_options(chunks=2, compile=False)
    plan, _ = plan_call(_entry(graph), options, 8, [torch.ones(1, 8)])
    assert plan.num_chunks == 2
    padded = torch.ones(1, 8)
    padded[0, :3] = 0
    with pytest.raises(SppoError, match="attention_mask was all ones"):
        plan_call(_entry(graph), options, 8, [padded])
