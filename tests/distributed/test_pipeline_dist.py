"""Multi-process pipeline tests (gloo on this CPU machine): loss and gradients equal eager's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sppo_fx.models import build
from sppo_fx.runtime.launch import run_local_ranks, start_local_ranks

from pipeline_cases import CaseLaunches  # tests/helpers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_pipeline.py")


def launch(nprocs: int, args: list[str], timeout: float = 240.0):
    """Start `nprocs` ranks of the example script directly (as torchrun would set them up)."""
    return run_local_ranks([sys.executable, SCRIPT, *args], nprocs, timeout, cwd=ROOT)


def _build(model_kind, layers, width=None):
    key = "n_layer" if model_kind == "gpt" else "n_layers"
    overrides = {key: layers}
    if width:
        overrides.update({"n_embd": width} if model_kind == "gpt" else {"dim": width, "ffn_dim": 2 * width})
    return build(model_kind, "tiny", **overrides)


def _reference(model_kind, layers, seq_len, batch, microbatches, seed=0, width=None):
    torch.manual_seed(seed)
    model = _build(model_kind, layers, width)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    size = batch // microbatches
    total = 0.0
    for m in range(microbatches):
        loss = model(x[m * size:(m + 1) * size], y[m * size:(m + 1) * size]) / microbatches
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in model.named_parameters()}


def _check_solver_choice(chosen, model_kind, layers, seq_len, batch, stages, microbatches):
    """The runtime's chunking is the fastest of the alternatives the pipeline solver
    promises to consider (every power-of-two chunk count from 1 up to seq_len / 16, each
    FLOPs-balanced and, with stages, multiplexed), each predicted from the same cost model;
    and the alternatives differ, so a bad pick would be caught."""
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform
    from sppo_fx.solver.partition import balanced_lengths, cost_model_from_graph, multiplexed_lengths
    from sppo_fx.solver.pipeline_chunks import ComputeModel, predict
    m = _build(model_kind, layers)
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    cap = capture(m, None, None, (x, x), {}, None, 1)
    graph, _ = transform(cap)
    cost, compute = cost_model_from_graph(graph, cap.seq), ComputeModel(1.0)
    alternatives = {}
    n = 1
    while n <= seq_len // 16:
        lengths = balanced_lengths(seq_len, n, cost)
        alternatives[tuple(lengths)] = predict(cost, compute, lengths, stages, microbatches).step_seconds
        if n > 1:
            mux = multiplexed_lengths(lengths, stages)
            alternatives[tuple(mux)] = predict(cost, compute, mux, stages, microbatches).step_seconds
        n *= 2
    assert tuple(chosen) in alternatives, (chosen, alternatives)
    best = min(alternatives.values())
    assert alternatives[tuple(chosen)] <= best * (1 + 1e-9), (chosen, alternatives)
    assert max(alternatives.values()) > best * 1.01, "every alternative predicts the same time"


CASES = [
    # (model, stages, layers, chunks-or-lengths, microbatches, schedule[+offload tier])
    ("llama", 2, 4, "3", 2, "1f1b"),
    ("gpt", 2, 4, "5,11,16", 2, "gpipe"),
    ("gpt", 4, 4, "4", 2, "1f1b"),
    ("llama", 4, 4, "2", 1, "1f1b"),
    ("llama", 2, 2, "auto", 2, "1f1b"),  # the pipeline solver picks N and the lengths
    ("llama", 2, 2, "4", 2, "1f1b+disk"),  # OFF/PRE/WAIT actions, activations on disk (a layer a stage)
    # gpipe with offload actions is checked by tests/schedule/test_schedule.py's validator and
    # simulator; per-rank budget plans run in tests/distributed/test_pipeline_budget.py
]


# the last rank perturbs its chunking (--plan-seed): every rank refuses before a step
PLAN_DISAGREE = ["--model", "gpt", "--layers", "2", "--seq-len", "16", "--chunks", "2", "--microbatches", "1",
                 "--plan-seed", "1", "--timeout", "30"]


def _case(model, stages, layers, chunks, microbatches, schedule):
    """(seq_len, width, the example's arguments but --dump) of a case."""
    seq_len, width = 32, None
    if chunks == "auto":
        seq_len = 64  # chunk counts 1, 2 and 4 to choose from
    chunk_args = ["--chunk-lengths", chunks] if "," in chunks else ["--chunks", chunks]
    if "+" in schedule:
        schedule, tier = schedule.split("+")
        chunk_args += ["--offload", tier]
        if tier == "disk":
            # saved activations of 64 KiB and more are offloaded (the executor's threshold):
            # 256 tokens of width 256 make 64-86-token chunks whose hidden states pass it
            seq_len, width = 256, 256
            chunk_args += ["--width", str(width)]
    return seq_len, width, ["--model", model, "--layers", str(layers), "--seq-len", str(seq_len), "--batch", "2",
                            "--microbatches", str(microbatches), "--schedule", schedule, *chunk_args]


def _key(case) -> str:
    return "-".join(map(str, case))


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory):
    """Every case of CASES, the cases of one world size in one launch (tests/helpers/pipeline_cases.py):
    each case dumps under its own directory."""
    base = tmp_path_factory.mktemp("pipeline_cases")
    cases = {_key(c): (c[1], [*_case(*c)[2], "--dump", str(base / _key(c))]) for c in CASES}
    cases["plan_disagree"] = (2, PLAN_DISAGREE)  # last: it stops both ranks at the same check
    launches = CaseLaunches(cases, timeout=400.0)
    launches.base = base
    return launches


# one worker launches all of them (each world size once)
@pytest.mark.xdist_group("pipeline_dist_cases")
@pytest.mark.parametrize("model,stages,layers,chunks,microbatches,schedule", CASES)
def test_pipeline_matches_eager(case_runs, model, stages, layers, chunks, microbatches, schedule):
    case = (model, stages, layers, chunks, microbatches, schedule)
    seq_len, width, args = _case(*case)
    batch = 2
    case_runs.check(_key(case))
    tmp_path = case_runs.base / _key(case)
    ref_loss, ref_grads = _reference(model, layers, seq_len, batch, microbatches, width=width)
    dumps = [torch.load(tmp_path / f"rank{r}.pt") for r in range(stages)]
    seen = set()
    for r, d in enumerate(dumps):
        torch.testing.assert_close(d["loss"], ref_loss, rtol=1e-4, atol=1e-5)
        assert d["blocks"] == dumps[0]["blocks"] and len(d["blocks"]) == stages
        for name, g in d["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(ref_grads), f"no rank holds gradients for {set(ref_grads) - seen}"
    # each rank holds only its own stage's parameters (plus tied ones)
    assert all(len(d["grads"]) < len(ref_grads) for d in dumps)
    if "--offload" in args:  # every rank's store held activations, and gave all of them back
        for r, d in enumerate(dumps):
            assert d["store"]["peak_bytes_offloaded"] > 0, f"rank {r} offloaded nothing: {d['store']}"
            assert d["store"]["bytes_offloaded"] == 0, f"rank {r} left activations in its store: {d['store']}"
    if chunks == "auto":  # every rank used the same chunking, the best of the solver's alternatives
        assert all(d["chunk_lengths"] == dumps[0]["chunk_lengths"] for d in dumps)
        _check_solver_choice(dumps[0]["chunk_lengths"], model, layers, seq_len, batch // microbatches, stages,
                             microbatches)


@pytest.mark.xdist_group("pipeline_dist_cases")
def test_ranks_that_disagree_on_the_plan_fail_at_start(case_runs):
    for rank, got in enumerate(case_runs.results_of("plan_disagree")):
        err = got["error"]
        assert err is not None and err.startswith("SppoError"), (rank, err)
        assert "ranks disagree on plan (chunk lengths)" in err, (rank, err)
        assert "step 0" not in got["stdout"]


DISAGREEMENTS = {  # scenario of tests/helpers/pipeline_disagreement_worker.py -> what the error names
    "graph": "model graph",
    "dtypes": "parameter names, shapes and dtypes",
    "values": "parameter values (sampled)",
    "schedule": "schedule",
    "input shapes": "micro-batch input shapes",
}


def test_ranks_that_disagree_are_stopped_before_a_step():
    """Each component of the fingerprint, changed on one rank only, stops every rank before
    any gradient exists, naming that component; the same model on every rank runs."""
    import json
    worker = os.path.join(ROOT, "tests", "helpers", "pipeline_disagreement_worker.py")
    procs = start_local_ranks([sys.executable, worker, *DISAGREEMENTS], 2, cwd=ROOT)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    expected = {**DISAGREEMENTS, "shared values": "values of parameters several stages share"}
    for rank, results in enumerate(outs):
        assert [r["scenario"] for r in results] == list(expected), results
        for r in results:
            what = expected[r["scenario"]]
            assert r["error"] is not None, f"rank {rank} ran the step with a different {r['scenario']}"
            assert f"ranks disagree on {what}" in r["error"] or f", {what}" in r["error"], r["error"]
            assert not r["grads"], f"rank {rank}: gradients exist after the refusal ({r['scenario']})"
            if r["scenario"] not in ("graph", "input shapes"):  # only what differs is named (the graph
                # is traced for the micro-batch's shape, so other shapes also make another graph)
                assert "model graph" not in r["error"], r["error"]


def test_torchrun_launch(tmp_path):
    # --standalone: the rendezvous binds a port the OS picks (none found free and bound later)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          SCRIPT, "--model", "gpt", "--layers", "2",
                          "--seq-len", "24", "--chunks", "3", "--steps", "2", "--lr", "0.1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0]
