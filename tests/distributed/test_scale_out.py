"""Scale-out layouts (pipeline × data × sequence parallel) on gloo with CPU processes:
loss and every parameter gradient equal the single-process eager model's on the full
batch; layouts that cannot run fail before a step; a failing rank in an SP or DP group
makes the others raise SppoError within the timeout."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from sppo_fx.models import build
from sppo_fx.runtime.launch import run_local_ranks

from pipeline_cases import CaseLaunches  # tests/helpers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_pipeline.py")


def _launch(nprocs, args, timeout=300.0):
    return [r[:3] for r in run_local_ranks([sys.executable, SCRIPT, *args], nprocs, timeout, cwd=ROOT)]


def _eager(kind, layers, seq_len, batch, microbatches, ignore_every=0, kv_heads=None):
    """The reference: the example's model and data, one process, micro-batches as
    `compiled.step` takes them (each loss / microbatches)."""
    torch.manual_seed(0)
    overrides = {"n_layer" if kind == "gpt" else "n_layers": layers}
    if kv_heads:
        overrides["n_kv_heads"] = kv_heads
    model = build(kind, "tiny", **overrides)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    if ignore_every:
        y.view(-1)[::ignore_every] = -1 if kind == "gpt" else -100  # the models' ignore_index
    size, total = batch // microbatches, 0.0
    for m in range(microbatches):
        loss = model(x[m * size:(m + 1) * size], y[m * size:(m + 1) * size]) / microbatches
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in model.named_parameters()}


# case -> (ranks, model, the example's arguments, the reference's keywords); the cases of one
# world size run in one launch (tests/helpers/pipeline_cases.py), each dumping under its name
EXACT = {
    # 1 × 1 × 2; the first chunk's 9 tokens split 5 / 4; a third of the targets ignored
    "sp2_gpt": (2, "gpt", ["--seq-parallel", "2", "--chunk-lengths", "9,23"], dict(ignore_every=3)),
    # 1 × 1 × 4, grouped-query attention with 2 K/V heads: each is repeated twice
    "sp4_llama_kv2": (4, "llama", ["--seq-parallel", "4", "--chunks", "2"], dict(kv_heads=2)),
    # 2 × 1 × 2: the bubble-adjacent chunks are cut finer and split unevenly over the SP ranks
    "pp2_sp2_plan": (4, "llama", ["--plan", "{plan}"], dict(batch=2, microbatches=2)),
    # 2 × 2 × 1: each replica takes half of every micro-batch; tied embeddings across stages
    "pp2_dp2_gpt": (4, "gpt", ["--data-parallel", "2", "--chunks", "2"], dict(batch=4, microbatches=2)),
    # 1 × 2 × 2 given as a DeviceMesh: replicas hold different numbers of counted tokens
    "dp2_sp2_mesh": (4, "llama", ["--data-parallel", "2", "--seq-parallel", "2", "--chunks", "2", "--device-mesh"],
                     dict(ignore_every=5)),
}
MUX_PLAN = {"layout": {"pp": 2, "dp": 1, "sp": 2},
            "plan": {"seq_len": 32, "chunk_lengths": [4, 12, 12, 4], "sp_splits": [[1, 3], [6, 6], [7, 5], [3, 1]]}}
# refused before a step: on the 2-rank launch after the exact case (every rank raises at the same point)
TOO_FEW = ["--seq-parallel", "2", "--chunk-lengths", "1,63", "--layers", "1"]


def _argv(kind, args, seq_len=32, batch=2, microbatches=1, layers=2, ignore_every=0, kv_heads=None):
    extra = ["--ignore-every", str(ignore_every)] if ignore_every else []
    if kv_heads:
        extra += ["--kv-heads", str(kv_heads)]
    return ["--model", kind, "--layers", str(layers), "--seq-len", str(seq_len), "--batch", str(batch),
            "--microbatches", str(microbatches), *extra, *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("scale_out")
    plan = base / "plan.json"
    plan.write_text(json.dumps(MUX_PLAN))
    cases = {name: (n, [a.format(plan=plan) for a in _argv(kind, args, **kw)] + ["--dump", str(base / name)])
             for name, (n, kind, args, kw) in EXACT.items()}
    cases["too_few"] = (2, TOO_FEW)
    launches = CaseLaunches(cases, timeout=400.0)
    launches.base = base
    return launches


def _check_exact(runs, name):
    nprocs, kind, _args, kw = EXACT[name]
    runs.check(name)
    kw = dict(dict(seq_len=32, batch=2, microbatches=1, layers=2, ignore_every=0, kv_heads=None), **kw)
    loss, grads = _eager(kind, kw["layers"], kw["seq_len"], kw["batch"], kw["microbatches"], kw["ignore_every"],
                         kw["kv_heads"])
    covered = set()
    for rank in range(nprocs):
        got = torch.load(runs.base / name / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], loss, rtol=1e-5, atol=1e-6)
        for pname, g in got["grads"].items():
            torch.testing.assert_close(g, grads[pname], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {pname}")
            covered.add(pname)
    assert covered == {n for n, g in grads.items() if g is not None}  # every parameter on some rank


# one worker runs the launches these share
_cases = pytest.mark.xdist_group("scale_out_cases")


@_cases
def test_seq_parallel_2_gpt_uneven_chunk_and_ignored_targets(runs):
    _check_exact(runs, "sp2_gpt")
    ops = torch.load(runs.base / "sp2_gpt" / "rank0.pt")["chunk_ops"]  # compiled.graphs["chunk"]: this rank's
    assert "sppo.seq_to_heads.default" in ops and "sppo.heads_to_seq.default" in ops


@_cases
def test_seq_parallel_4_llama_more_ranks_than_kv_heads(runs):
    _check_exact(runs, "sp4_llama_kv2")


@_cases
def test_pipeline_and_seq_parallel_run_a_multiplexed_plan(runs):
    _check_exact(runs, "pp2_sp2_plan")
    assert "loss" in runs.results_of("pp2_sp2_plan")[0]["stdout"]


@_cases
def test_pipeline_and_data_parallel_gpt(runs):
    _check_exact(runs, "pp2_dp2_gpt")


@_cases
def test_data_and_seq_parallel_normalise_by_the_global_token_count(runs):
    _check_exact(runs, "dp2_sp2_mesh")


@_cases
def test_chunk_with_fewer_tokens_than_seq_parallel_fails_before_a_step(runs):
    for rank, got in enumerate(runs.results_of("too_few")):
        err = got["error"]
        assert err is not None and err.startswith("SppoError") and "fewer than seq_parallel=2" in err, (rank, err)
        assert "step 0" not in got["stdout"]


@pytest.mark.parametrize("layout,fail_rank,how", [(["--seq-parallel", "2"], 1, "raise"),
                                                  (["--data-parallel", "2", "--microbatches", "1"], 0, "exit")])
def test_a_failing_rank_makes_its_group_raise_within_the_timeout(tmp_path, layout, fail_rank, how):
    timeout = 15.0
    results = _launch(2, [*layout, "--layers", "1", "--chunks", "2", "--timeout", str(timeout), "--fail-rank",
                          str(fail_rank), "--fail-at", "forward", "--fail-how", how], timeout=240)
    fault = next(float(m.group(1)) for _rc, _o, err in results for m in [re.search(r"fault at ([\d.]+)", err)] if m)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc != 0
        if rank == fail_rank:
            continue
        assert "SppoError" in err, err[-3000:]
        raised = float(re.search(r"SppoError raised at ([\d.]+)", err).group(1))
        assert raised - fault < timeout, (raised - fault, err[-2000:])
        if how == "raise":
            assert f"rank {fail_rank} raised RuntimeError: injected fault" in err, err[-2000:]
