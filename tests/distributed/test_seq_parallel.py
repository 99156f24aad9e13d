"""Sequence parallelism (Ulysses) pieces: the pass on a chunk program, head arithmetic,
plans with per-chunk splits, the shared plan format, and the all-to-all attention on two
processes against full attention (forward and backward)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from sppo_fx.capture import capture
from sppo_fx.errors import SppoError
from sppo_fx.models import build
from sppo_fx.passes import transform
from sppo_fx.passes.sequence_parallel import kv_repeats, shard_attention_heads
from sppo_fx.plan import Plan, load_layout_plan
from sppo_fx.runtime.launch import start_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _program(kind="llama", **overrides):
    torch.manual_seed(0)
    model = build(kind, "tiny", **overrides)
    x = torch.zeros(2, 32, dtype=torch.long)
    cap = capture(model, None, None, (x, x), {}, None, 1)
    return transform(cap)[1]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_puts_all_to_alls_around_every_attention_and_keeps_this_ranks_heads():
    program = _program("llama", n_layers=2)  # 4 query heads, 2 K/V heads
    sharded = shard_attention_heads(program, 2, "g")
    targets = _targets(sharded.chunk)
    assert targets.count(torch.ops.sppo.seq_to_heads.default) == 3 * 2  # q, k, v per layer
    assert targets.count(torch.ops.sppo.heads_to_seq.default) == 2
    assert torch.ops.sppo.seq_to_heads.default not in _targets(program.chunk)  # the input is untouched
    names = [n.name for n in sharded.chunk.graph.nodes if n.op == "placeholder"]
    assert names[-3:] == ["chunk_start", "chunk_len", "sp_chunk_len"]
    assert sharded.seq_parallel == 2 and program.seq_parallel == 1
    for before, after in zip(program.attention, sharded.attention):
        assert after.k_shape[1] == before.k_shape[1] // 2  # the kept K/V: 1/S of the heads
    # the program's K/V outputs are the all-to-all's (this rank's heads, the whole chunk)
    out = next(n for n in sharded.chunk.graph.nodes if n.op == "output").args[0]
    assert all(o.args[0].target is torch.ops.sppo.seq_to_heads.default and o.args[1] == 0 for o in out[-4:])


def test_kv_heads_are_repeated_only_when_seq_parallel_exceeds_them():
    program = _program("llama", n_layers=1)  # 2 K/V heads
    assert torch.ops.aten.repeat_interleave.self_int not in _targets(shard_attention_heads(program, 2, "g").chunk)
    sharded = shard_attention_heads(program, 4, "g")
    assert torch.ops.aten.repeat_interleave.self_int in _targets(sharded.chunk)
    assert sharded.attention[0].k_shape[1] == 1
    assert kv_repeats(32, 8, 4) == 1 and kv_repeats(32, 8, 16) == 2 and kv_repeats(8, 1, 8) == 8


@pytest.mark.parametrize("heads,kv,parts,needle", [(4, 2, 3, "query heads do not split"),
                                                   (12, 4, 6, "K/V heads neither split")])
def test_heads_that_do_not_split_are_refused_with_what_to_change(heads, kv, parts, needle):
    with pytest.raises(SppoError, match=needle):
        kv_repeats(heads, kv, parts)


def test_plan_splits_chunks_over_sequence_parallel_ranks():
    plan = Plan(23, [9, 14])
    assert plan.sp_split(0, 2) == [5, 4] and plan.sp_split(1, 4) == [4, 4, 3, 3]
    with pytest.raises(SppoError, match="fewer than seq_parallel=16"):
        plan.sp_split(0, 16)
    mux = Plan(23, [9, 14], sp_splits=[[2, 7], [7, 7]])
    assert mux.sp_split(0, 2) == [2, 7]
    with pytest.raises(SppoError, match="seq_parallel=4"):
        mux.sp_split(0, 4)
    with pytest.raises(SppoError, match="sp_splits"):
        Plan(23, [9, 14], sp_splits=[[9, 0], [7, 7]])
    assert Plan.from_json(mux.to_json()) == mux


def test_planner_json_and_the_runtime_share_one_plan_format(tmp_path):
    from sppo_fx.whatif import get_model, plan
    report = plan(get_model("custom", layers=2, hidden=32, heads=4), 64, 4, "a100")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(report.to_dict()))
    layout, runtime_plan = load_layout_plan(str(path))
    assert layout == {"pp": report.best.stages, "dp": 1, "sp": report.best.seq_parallel}
    assert runtime_plan.chunk_lengths == list(report.best.chunk_lengths) and runtime_plan.seq_len == 64
    assert load_layout_plan(Plan(8, [3, 5]).to_json()) == ({"pp": 1, "dp": 1, "sp": 1}, Plan(8, [3, 5]))
    with pytest.raises(SppoError, match="no seq_len"):
        load_layout_plan('{"layout": {"sp": 2}}')


@pytest.mark.slow
@pytest.mark.distributed
def test_all_to_all_attention_on_two_processes_matches_full_attention():
    procs = start_local_ranks([sys.executable, os.path.join(ROOT, "tests", "helpers", "seq_parallel_worker.py")], 2,
                              cwd=ROOT)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for rank, result in enumerate(outs):
        for case, diffs in result.items():
            assert diffs.pop("q_moved"), (rank, case)
            assert max(diffs.values()) < 1e-12, (rank, case, diffs)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(seq_parallel=2, budget="1GiB"), "budget= with seq_parallel > 1"),
    (dict(seq_parallel=2, skeleton="offload", offload="disk"), "skeleton='offload' is not supported with seq_parallel"),
    (dict(seq_parallel=0), "seq_parallel=0: give a positive integer"),
    (dict(data_parallel=True), "data_parallel=True: give a positive integer"),
])
def test_compile_refuses_layouts_it_cannot_run(kwargs, needle):
    import sppo_fx
    with pytest.raises(SppoError, match=needle):
        sppo_fx.compile(build("gpt", "tiny"), **kwargs)


def test_a_distributed_layout_needs_step_and_the_right_world_size():
    import sppo_fx
    model = build("gpt", "tiny")
    x = torch.zeros(2, 16, dtype=torch.long)
    compiled = sppo_fx.compile(model, seq_parallel=2, chunks=2)
    with pytest.raises(SppoError, match="call compiled.step"):
        compiled(x, x)
    with pytest.raises(SppoError, match="needs torch.distributed"):
        compiled.step(x, x)
