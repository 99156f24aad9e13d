"""The budget solver and budget-driven offload plans."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SHARES_OFFLOAD_PROGRAMS, StoreTraffic, offload_program, tiny_model, tiny_program

import sppo_fx
from sppo_fx import InfeasibleBudget, Plan, SppoError
from sppo_fx.capture import capture
from sppo_fx.models import build
from sppo_fx.passes import transform
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.runtime.store import ActivationStore
from sppo_fx.solver.budget import parse_budget, solve
from sppo_fx.solver.memory_model import MemoryModel, copy_window, predict_peak
from sppo_fx.solver.partition import ChunkCostModel

COST = ChunkCostModel(per_token=1e7, per_pair=1e3)
# 1 KiB of K/V and 16 KiB of other saved activations per token, plus a prefix-sized term
MEM = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c + 64 * (p + c), fixed_bytes=1 << 20)


@pytest.mark.parametrize("text,expected", [("12GiB", 12 * 2**30), ("500MiB", 500 * 2**20), ("1.5GB", 1_500_000_000),
                                           (4096, 4096), ("7 kib", 7168)])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", 0, "12XB", True])
def test_parse_budget_rejects(bad):
    with pytest.raises(SppoError):
        parse_budget(bad)


def test_offloading_lowers_the_predicted_peak():
    lengths = [256] * 8
    keep = predict_peak(MEM, lengths, [0.0] * 8)
    off = predict_peak(MEM, lengths, [1.0] * 7 + [0.0])
    assert off < keep / 2.5  # two chunks of activations (current + prefetched) instead of eight


def test_solver_fits_the_budget_and_offloads_earliest_chunks_first():
    keep_all = predict_peak(MEM, [2048], [0.0])
    chosen = solve(COST, MEM, 2048, keep_all // 3, rate=1e12, bandwidth=1e7)
    assert chosen.peak_bytes <= keep_all // 3
    assert chosen.ratios[-1] == 0.0
    full = [a == 1.0 for a in chosen.ratios]
    assert any(full) and full == sorted(full, reverse=True)  # the earliest chunks leave the device first
    assert predict_peak(MEM, chosen.lengths, chosen.ratios, window=chosen.copy_window_bytes) == chosen.peak_bytes
    assert chosen.copy_window_bytes is not None
    unbounded = solve(COST, MEM, 2048, keep_all // 3, rate=1e12, bandwidth=1e7, windowed=False)
    assert unbounded.copy_window_bytes is None
    assert predict_peak(MEM, unbounded.lengths, unbounded.ratios) == unbounded.peak_bytes


def test_a_copy_window_keeps_offloaded_chunks_off_the_device():
    # 16 layers: the window is two layers' worth, and a chunk read back is consumed layer by layer
    mem = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c, fixed_bytes=0, sites=16)
    lengths, ratios = [512] * 4, [1.0] * 3 + [0.0]
    window = copy_window(mem, lengths)
    l2, l1_all = 16384 * 512, 1024 * 2048
    assert window == 2 * l2 // 16
    unbounded = predict_peak(mem, lengths, ratios)
    bounded = predict_peak(mem, lengths, ratios, window=window)
    # the peak is the last chunk's backward: skeleton, own K/V copies, dK/dV of the earlier
    # chunks, its whole L2 (kept), the window; without one, the previous chunk's L2 is on
    # its way back too
    dkv = 1024 * 1536
    assert bounded == 2 * l1_all + dkv + l2 + window
    assert unbounded == 2 * l1_all + dkv + 2 * l2
    # where the peak is an offloaded chunk's backward (a short last chunk), that chunk
    # holds one layer's worth read back plus the window, not its whole L2 and its
    # predecessor's on the way
    lengths = [1024, 1024, 1024, 64]
    big = 16384 * 1024
    window = copy_window(mem, lengths)
    bounded = predict_peak(mem, lengths, ratios, window=window)
    unbounded = predict_peak(mem, lengths, ratios)
    assert bounded < unbounded - big  # at least a whole chunk of activations less
    # nothing offloaded: the window changes nothing
    assert predict_peak(mem, lengths, [0.0] * 4, window=window) == predict_peak(mem, lengths, [0.0] * 4)


def test_copies_that_hide_behind_compute_are_offloaded_even_without_memory_pressure():
    chosen = solve(COST, MEM, 2048, 10**12, rate=1e9, bandwidth=1e12)  # fast link, huge budget
    assert all(a == 1.0 for a in chosen.ratios[:-1]) or len(chosen.ratios) == 1


@pytest.mark.parametrize("grads", [1 << 20, 64 << 20])
def test_the_first_backward_trades_activations_for_parameter_gradients(grads):
    # one chunk: its backward frees saved activations layer by layer while the parameter
    # gradients appear, so the larger of the two counts, not their sum
    mem = MemoryModel(level1=lambda c, p: 1024 * c, level2=lambda c, p: 16384 * c, fixed_bytes=grads, sites=4)
    l1, l2 = 1024 * 2048, 16384 * 2048
    assert predict_peak(mem, [2048], [0.0]) == 2 * l1 + max(l2, grads)
    # later chunks run backward with every gradient already there
    two = predict_peak(mem, [1024, 1024], [0.0, 0.0])
    assert two >= 2 * l1 + l2 // 2 + l1 // 2 + grads


def test_where_copies_share_the_compute_cores_only_memory_pressure_offloads():
    roomy = solve(COST, MEM, 2048, 10**12, rate=1e9, bandwidth=1e12, copies_share_compute=True)
    assert not any(roomy.ratios)  # nothing hides on a CPU: no offload without need
    keep_all = predict_peak(MEM, [2048], [0.0])
    hidden = solve(COST, MEM, 2048, keep_all // 3, rate=1e12, bandwidth=1e7)
    charged = solve(COST, MEM, 2048, keep_all // 3, rate=1e12, bandwidth=1e7, copies_share_compute=True)
    assert charged.peak_bytes <= keep_all // 3 and any(charged.ratios)
    assert charged.step_seconds > hidden.step_seconds  # every copied byte is charged


def test_infeasible_budget_names_the_minimum():
    with pytest.raises(InfeasibleBudget) as err:
        solve(COST, MEM, 2048, 1000, rate=1e12, bandwidth=1e9)
    minimum = err.value.minimum_bytes
    needed = float(re.search(r"at least ([0-9.]+) MiB", str(err.value)).group(1))
    assert minimum > 1000 and minimum <= needed * 2**20 < minimum + 0.1 * 2**20  # the minimum, rounded up
    solve(COST, MEM, 2048, minimum, rate=1e12, bandwidth=1e9)  # the minimum itself is feasible


def test_plan_with_offload_round_trips_and_prints():
    plan = Plan(10, [6, 4], offload_ratios=[0.5, 0.0], tier="disk", budget_bytes=2**20, peak_bytes=2**19,
                step_seconds=1.5)
    assert Plan.from_json(plan.to_json()) == plan
    text = plan.table()
    assert "50%" in text and "budget 1.0 MiB" in text and "predicted peak 0.5 MiB" in text
    plan.step_terms = {"compute": 0.75, "elementwise": 0.25, "attention": 0.25, "exposed_copy": 0.125,
                       "overhead": 0.125}
    assert ("predicted step 1.5 s (compute 0.75 s, element-wise 0.25 s, attention 0.25 s, exposed copy 0.125 s, "
            "overheads 0.125 s)") in plan.table()  # every term printed: they add up to the step
    with pytest.raises(SppoError):
        Plan(10, [6, 4], offload_ratios=[1.5, 0.0])


@SHARES_OFFLOAD_PROGRAMS
@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["gpt", "llama"]), cuts=st.sets(st.integers(1, 63), min_size=1, max_size=5),
       quotas=st.lists(st.sampled_from([0, 1, 2**14, 2**18, None]), min_size=6, max_size=6), seed=st.integers(0, 99),
       window=st.sampled_from([None, 0, 2**12, 2**16]), reuse=st.booleans())
def test_random_offload_plans_are_bitwise_neutral(tmp_path_factory, kind, cuts, quotas, seed, window, reuse):
    """Any plan (random chunking, random byte quotas per chunk, None = every saved tensor,
    any copy window, 0 = one copy at a time; new or pooled files) gives bitwise the same
    loss and gradients as the same chunking without offload."""
    model, cap, program = tiny_program(kind)
    torch.manual_seed(seed)
    x, y = torch.randint(0, 97, (2, 64)), torch.randint(0, 97, (2, 64))
    bounds = [0, *sorted(cuts), 64]
    plan = Plan(64, [b - a for a, b in zip(bounds, bounds[1:])])
    params = [cap.param_value(n) for n in program.params]

    def grads_of(loss):
        loss.backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    ref_loss = chunked_loss(program, params, [x, y], plan)
    ref = grads_of(ref_loss)
    offload = {(0, i): (float("inf") if q is None else q) for i, q in enumerate(quotas[:plan.num_chunks])}
    with ActivationStore("disk", dir=str(tmp_path_factory.mktemp("store")), reuse_files=reuse) as store:
        traffic = StoreTraffic(store)
        loss = chunked_loss(program, params, [x, y], plan, offload_program(program), store=store, offload=offload,
                            min_offload_bytes=0, copy_window_bytes=window)
        got = grads_of(loss)
        assert store.bytes_offloaded == 0
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # the plan moved what it says: every chunk saves small tensors (norm statistics), so a
    # quota of 16 KiB or more offloads something; quotas of 0 or 1 byte offload nothing
    chunk_quotas = quotas[:plan.num_chunks]
    if any(q is None or q >= 2**14 for q in chunk_quotas):
        assert traffic.offloaded_bytes > 0 and store.peak_bytes_offloaded > 0, (chunk_quotas, traffic.offloads)
    if all(q is not None and q <= 1 for q in chunk_quotas):
        assert traffic.offloaded_bytes == 0
    assert store.peak_bytes_offloaded <= traffic.offloaded_bytes
    assert traffic.read_bytes == traffic.offloaded_bytes  # all of it came back and was used


@pytest.mark.slow
def test_every_saved_tensor_on_disk_through_the_api(tmp_path):
    model = tiny_model("llama")
    # 128-token chunks: the hidden states (2 x 128 x 128 fp32, 128 KiB) pass the executor's
    # 64 KiB offload threshold (with 16-token chunks nothing would)
    x, y = torch.randint(0, 97, (2, 512)), torch.randint(0, 97, (2, 512))
    plain = sppo_fx.compile(model, chunks=4, compile=False)
    loss = plain(x, y)
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    offloaded = sppo_fx.compile(model, chunks=4, compile=False, offload="disk", offload_dir=str(tmp_path))
    traffic = StoreTraffic(offloaded.store)
    loss2 = offloaded(x, y)
    # between forward and backward, chunks 0-2's saved activations are files in offload_dir
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    held = offloaded.store.bytes_offloaded
    assert held > 0 and on_disk >= held, (held, on_disk)
    assert traffic.offloaded_bytes >= held
    loss2.backward()
    assert torch.equal(loss, loss2) and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref))
    assert offloaded.store.bytes_offloaded == 0 and traffic.read_bytes == traffic.offloaded_bytes


@pytest.mark.slow
def test_budget_api_plans_offload_and_stays_exact(tmp_path):
    # one block: the plan and its exactness do not depend on depth; the chunk program's
    # trace (Dynamo and AOTAutograd, twice) grows with it
    model = tiny_model("llama")
    x, y = torch.randint(0, 97, (1, 512)), torch.randint(0, 97, (1, 512))
    ref = model(x, y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    probe = sppo_fx.compile(model, budget="10GiB", compile=False, offload_dir=str(tmp_path), recompute="none")
    probe(x, y)  # a generous budget: learn the memory model and the minimum
    minimum = min(solve_min(probe, 512), 10 * 2**30)
    budget = int(minimum * 1.2)
    compiled = sppo_fx.compile(model, budget=budget, compile=False, offload_dir=str(tmp_path), recompute="none")
    compiled.profile = probe.profile
    loss = compiled(x, y)
    plan = compiled.plan
    assert plan.peak_bytes <= budget and plan.offload_ratios[-1] == 0 and max(plan.offload_ratios) > 0
    assert plan.recompute == "none"
    assert "offloaded (disk)" in str(plan) and "copy window" in str(plan)
    assert 0 < plan.copy_window_bytes < budget
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def solve_min(compiled, seq_len):
    entry = compiled._last
    try:
        solve(entry.cost, list(entry.memory.values()), seq_len, 1, rate=1e12, bandwidth=1e9)
    except InfeasibleBudget as e:
        return e.minimum_bytes
    raise AssertionError("a 1-byte budget was feasible")


@pytest.mark.slow
def test_memory_models_of_a_model_on_another_device():
    """The cost model's fake inputs go on the model's device: on an H200 a CUDA model failed
    here ("Tensor on device cpu is not on the expected device cuda:0", at RoPE's
    outer(arange, inv_freq)); the meta device has the same device check and no data."""
    from sppo_fx.solver.memory_model import memory_models
    model = build("llama", "tiny").to("meta")
    x = torch.randint(0, 97, (1, 64)).to("meta")
    cap = capture(model, None, None, (x, x), {}, None, 1)
    program = transform(cap)[1]
    params = [cap.param_value(n) for n in program.params]
    (mem,) = memory_models(program, cap.seq, params, ("none",))
    assert mem.level1(16, 32) > 0 and mem.level2(16, 32) > 0


@pytest.mark.slow
def test_plans_the_solver_did_not_choose_are_predicted_by_its_models():
    """`SppoCompiled.predicted` for a fixed chunking: offloading every chunk but the last
    lowers the predicted peak; the prediction is the solver's own for the same ratios."""
    import sppo_fx
    from sppo_fx.models import build
    from sppo_fx.solver.memory_model import predict_peak
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)  # the predictions' relation does not depend on depth
    x = torch.randint(0, 97, (1, 128))
    kept = sppo_fx.compile(model, chunks=4, compile=False)
    kept(x, x).backward()
    off = sppo_fx.compile(model, chunks=4, compile=False, offload="disk")
    off(x, x).backward()
    (peak_kept, s_kept), (peak_off, s_off) = kept.predicted(), off.predicted()
    assert 0 < peak_off < peak_kept and s_kept > 0 and s_off >= s_kept
    memory = kept._last.memory["none"]
    assert peak_kept == predict_peak(memory, kept.plan.chunk_lengths, [0.0] * 4)


@pytest.mark.slow
def test_one_trace_partitioned_per_policy_equals_a_trace_per_policy(monkeypatch, tmp_path):
    """The memory model traces the chunk program once (plus the first chunk) and partitions
    that joint graph once per recompute policy (`chunk_costs`); each policy's saved set
    must be what its own trace gives, so no partition may see another's recompute tags."""
    from torch._functorch import aot_autograd
    from sppo_fx.passes.cost import chunk_cost, chunk_costs
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))  # a cold memory model cache: every call traces
    monkeypatch.setenv("SPPO_FX_FORK", "off")  # both traces in this process, where they are counted
    torch.manual_seed(0)
    model = build("gpt", "tiny", n_layer=1)  # a policy's saved set is per block: one shows it
    x = torch.randint(0, model.config.vocab_size, (1, 64))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    program = transform(cap)[1]
    params = [cap.param_value(n) for n in program.params]
    traces = []
    original = aot_autograd.aot_function
    monkeypatch.setattr(aot_autograd, "aot_function", lambda *a, **k: traces.append(1) or original(*a, **k))
    # "none" last: it tags nothing, so it would inherit the others' tags from a shared graph
    shared = chunk_costs(program, cap.seq, params=params, partition="min_cut", recomputes=("full", "cheap", "none"))
    assert len(traces) == 2  # the example chunk and the first chunk, not one per policy
    for policy, cost in shared.items():
        alone = chunk_cost(program, cap.seq, params=params, partition="min_cut", recompute=policy)
        assert [(s.name, s.bytes_expr, s.kind) for s in cost.saved] == \
               [(s.name, s.bytes_expr, s.kind) for s in alone.saved], policy
        assert cost.level2_bytes == alone.level2_bytes and cost.level1_bytes == alone.level1_bytes
    assert shared["full"].level2_bytes != shared["none"].level2_bytes
