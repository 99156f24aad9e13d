"""The orchestrator (sppo_fx/orchestrate/): one place runs capture -> passes -> cost model
-> solve -> codegen for one stage and for pipeline ranks; the runtime only runs the
product; one budget solve serves both; every option is checked before any work."""
from __future__ import annotations

import ast
import os

import pytest
import torch

import sppo_fx
from sppo_fx import InfeasibleBudget, Plan, SppoError
from sppo_fx.codegen import CompiledProgram
from sppo_fx.models import build
from sppo_fx.options import CompileOptions, compile_options
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.runtime.store import ActivationStore
from sppo_fx.solver.memory_model import MemoryModel
from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.profiles import get_profile
from sppo_fx.solver.rank_budget import offload_quota, solve_budget

PACKAGE = os.path.dirname(os.path.abspath(sppo_fx.__file__))
MiB = 2**20
COST = ChunkCostModel(per_token=1e7, per_pair=1e3)
MEM = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c + 64 * (p + c), fixed_bytes=MiB)
PROFILE = get_profile("a100-80gb")
LENGTHS = [512] * 4


# ---- the runtime only runs ------------------------------------------------------------
RUNTIME = ("runtime/local.py", "runtime/pipeline.py", "runtime/distributed.py", "runtime/product.py")
# what builds a product: capture, the graph passes that transform, the solver, codegen's
# compile, the orchestrator and the API
FORBIDDEN_MODULES = ("sppo_fx.solver", "sppo_fx.orchestrate", "sppo_fx.api", "sppo_fx.passes.skeleton",
                     "sppo_fx.passes.sequence_parallel", "sppo_fx.passes.stage_split")
FORBIDDEN_NAMES = {"capture", "transform", "transform_stages", "batch_epilogue", "compile_chunk_program",
                   "stream_kv_skeleton", "shard_attention_heads"}


def _imports(path: str) -> list[tuple[str, str]]:
    """(module, name) of every import in the file, at module level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
    return out


@pytest.mark.parametrize("room", RUNTIME)
def test_the_runtime_neither_captures_transforms_solves_nor_compiles(room):
    bad = [f"{m}.{n}" for m, n in _imports(os.path.join(PACKAGE, room))
           if m.startswith(FORBIDDEN_MODULES) or n in FORBIDDEN_NAMES]
    assert not bad, f"{room} imports what the orchestrator does: {bad}"


def _tiny():
    torch.manual_seed(0)
    model = build("gpt", "tiny")
    x, y = torch.randint(0, 97, (2, 32)), torch.randint(0, 97, (2, 32))
    return model, x, y


def test_the_runtime_refuses_a_store_without_a_compiled_offload_program(tmp_path):
    """It would have to run the memory passes itself: the orchestrator's compile_chunk does."""
    from sppo_fx.orchestrate import compile_chunk, prepare
    model, x, y = _tiny()
    entry = prepare(model, None, compile_options(compile=False), ((x, y), {}, None), [x, y])
    params, plan = entry.params(), Plan(32, [16, 16])
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        for skeleton in ("keep", "offload"):
            with pytest.raises(SppoError, match="compiled with offload=True"):
                chunked_loss(entry.program, params, [x, y], plan, store=store, skeleton=skeleton)
            assert all(p.grad is None for p in model.parameters())
        loss = chunked_loss(entry.program, params, [x, y], plan, compile_chunk(entry.program), store=store)
        loss.backward()
    ref_model, _, _ = _tiny()
    ref = ref_model(x, y)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_the_product_carries_what_the_plan_needs(tmp_path):
    """stage_product: no codegen for a plain eager plan; with an offload tier, the memory
    passes' program (kept per policy: a second product reuses it)."""
    from sppo_fx.orchestrate import prepare, stage_product
    model, x, y = _tiny()
    plain = compile_options(compile=False, chunks=2)
    entry = prepare(model, None, plain, ((x, y), {}, None), [x, y])
    p = stage_product(entry, plain, Plan(32, [16, 16]))
    assert (p.chunk_fn, p.skeleton, p.offload) == (None, "keep", None)
    assert p.program is entry.program and len(p.params) == len(entry.program.params)
    offload = compile_options(compile=False, chunks=2, offload="disk", offload_dir=str(tmp_path))
    q = stage_product(entry, offload, Plan(32, [16, 16]))
    assert isinstance(q.chunk_fn, CompiledProgram) and q.chunk_fn.offload
    assert stage_product(entry, offload, Plan(32, [8, 24])).chunk_fn is q.chunk_fn


@pytest.mark.slow  # a memory model's AOTAutograd traces
def test_a_saved_plan_with_offload_ratios_runs_exactly(tmp_path):
    """plan= with offload ratios and no budget: the quota comes from the memory model of the
    plan's policy (it used to look up a model only a budget builds: KeyError)."""
    model, x, y = _tiny()
    plan = Plan(32, [16, 16], offload_ratios=[1.0, 0.0], tier="disk")
    compiled = sppo_fx.compile(model, plan=plan, offload="disk", offload_dir=str(tmp_path), compile=False)
    loss = compiled(x, y)
    loss.backward()
    ref_model, _, _ = _tiny()
    ref = ref_model(x, y)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert compiled._last.memory.keys() == {"none"}


# ---- one budget solve ------------------------------------------------------------------
@pytest.mark.slow  # a memory model's AOTAutograd traces
def test_the_api_solves_the_budget_through_the_one_solve(monkeypatch):
    import sppo_fx.orchestrate.stage as stage
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return solve_budget(*args, **kwargs)
    monkeypatch.setattr(stage, "solve_budget", recording)
    model, x, y = _tiny()
    compiled = sppo_fx.compile(model, budget="1GiB", compile=False, recompute="none", skeleton="keep")
    compiled.profile = PROFILE  # no calibration
    compiled(x, y).backward()
    compiled(x, y)  # the plan of a length is kept
    assert len(calls) == 1
    assert calls[0].get("rank") is None and calls[0]["profile"] is PROFILE
    assert compiled.plan.budget_bytes == 2**30 and compiled.plan.recompute == "none"


def test_a_rank_solves_one_micro_batch_against_its_share():
    """A pipeline rank with 3 micro-batches in flight is the single-stage solve of one
    micro-batch against fixed + (budget - fixed) / 3, its peak scaled back up."""
    share = 28 * MiB
    budget = MiB + 3 * (share - MiB)
    one, _ = solve_budget(COST, [MEM], 2048, share, profile=PROFILE, device="cuda", offload="host",
                          chunk_lengths=LENGTHS)
    rank, memory = solve_budget(COST, [MEM], 2048, budget, profile=PROFILE, device="cuda", offload="host",
                                chunk_lengths=LENGTHS, inflight=3, rank=1, schedule="1f1b")
    assert memory is MEM and rank.chunk_lengths == LENGTHS == one.chunk_lengths
    assert rank.offload_ratios == one.offload_ratios and any(one.offload_ratios)
    assert rank.peak_bytes == MiB + 3 * (one.peak_bytes - MiB) and rank.peak_bytes <= budget
    assert rank.budget_bytes == budget and one.budget_bytes == share


def test_an_infeasible_rank_names_its_minimum():
    with pytest.raises(InfeasibleBudget) as single:
        solve_budget(COST, [MEM], 2048, MiB, profile=PROFILE, device="cuda", offload="host", chunk_lengths=LENGTHS)
    with pytest.raises(InfeasibleBudget, match="pipeline rank 1 needs") as ranked:
        solve_budget(COST, [MEM], 2048, MiB, profile=PROFILE, device="cuda", offload="host", chunk_lengths=LENGTHS,
                     inflight=3, rank=1, schedule="1f1b")
    assert ranked.value.minimum_bytes == MiB + 3 * (single.value.minimum_bytes - MiB)
    assert "pipeline rank" not in str(single.value)


def test_the_quota_covers_every_micro_batch_and_the_streamed_skeleton():
    plan = Plan(2048, LENGTHS, offload_ratios=[0.5, 0.25, 1.0, 0.0])
    quota = offload_quota(plan, MEM, "keep", microbatches=2)
    assert set(quota) == {(m, i) for m in range(2) for i in range(4)}
    assert quota[(1, 0)] == quota[(0, 0)] == 0.5 * MEM.level2(512, 0) and quota[(0, 3)] == 0
    streamed = offload_quota(plan, MEM, "offload")
    assert streamed[(0, 2)] == MEM.streamed_level2(512, 1024) > quota[(0, 2)] == MEM.level2(512, 1024)


# ---- one place for the options -----------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(chunks=3, chunk_lengths=[4, 4]), "chunks=3 disagrees with 2 chunk_lengths"),
    (dict(recompute="some"), "recompute='some'"),
    (dict(skeleton="offload"), "skeleton='offload' moves the K/V skeleton"),
    (dict(budget="1GiB", chunks=2), "give either budget="),
    (dict(plan=Plan(8, [4, 4]), chunks=2), "give either plan="),
    (dict(seq_parallel=0), "seq_parallel=0"),
])
def test_every_option_is_refused_at_compile_before_any_call(kwargs, message):
    with pytest.raises(SppoError, match=message):
        compile_options(**kwargs)
    with pytest.raises(SppoError, match=message):
        sppo_fx.compile(build("gpt", "tiny"), **kwargs)  # no call, no capture


def test_the_plan_or_the_option_decides_recompute_and_skeleton():
    chosen = Plan(8, [4, 4], recompute="cheap", skeleton="offload")
    assert CompileOptions().recompute_for(Plan(8, [4, 4])) == "none"
    assert CompileOptions().skeleton_for(Plan(8, [4, 4])) == "keep"
    assert CompileOptions(recompute="full", skeleton="offload").recompute_for(Plan(8, [8])) == "full"
    assert CompileOptions(recompute="full", skeleton="offload").skeleton_for(Plan(8, [8])) == "offload"
    assert (CompileOptions().recompute_for(chosen), CompileOptions().skeleton_for(chosen)) == ("cheap", "offload")
