"""Multi-process pipeline tests (gloo on this CPU machine): loss and gradients equal eager's."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from sppo_fx.models import build
from sppo_fx.runtime.launch import free_port, start_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_pipeline.py")


def launch(nprocs: int, args: list[str], timeout: float = 240.0):
    """Start `nprocs` ranks of the example script directly (as torchrun would set them up)."""
    procs = start_local_ranks([sys.executable, SCRIPT, *args], nprocs, cwd=ROOT)
    results, start = [], time.monotonic()
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err, time.monotonic() - start))
    return results


def _reference(model_kind, layers, seq_len, batch, microbatches, seed=0):
    torch.manual_seed(seed)
    key = "n_layer" if model_kind == "gpt" else "n_layers"
    model = build(model_kind, "tiny", **{key: layers})
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


def _solver_choice(model_kind, layers, seq_len, batch, stages, microbatches):
    from sppo_fx.capture import capture
    from sppo_fx.passes import transform
    from sppo_fx.solver.partition import cost_model_from_graph
    from sppo_fx.solver.pipeline import ComputeModel, choose_plan
    key = "n_layer" if model_kind == "gpt" else "n_layers"
    m = build(model_kind, "tiny", **{key: layers})
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    cap = capture(m, None, None, (x, x), {}, None, 1)
    graph, _ = transform(cap)
    best, _ = choose_plan(cost_model_from_graph(graph, cap.seq), ComputeModel(1.0), seq_len, stages, microbatches)
    return best.chunk_lengths


CASES = [
    # (model, stages, layers, chunks-or-lengths, microbatches, schedule[+offload tier])
    ("llama", 2, 4, "3", 2, "1f1b"),
    ("gpt", 2, 4, "5,11,16", 2, "gpipe"),
    ("gpt", 4, 4, "4", 2, "1f1b"),
    ("llama", 4, 4, "2", 1, "1f1b"),
    ("llama", 2, 2, "auto", 2, "1f1b"),  # the pipeline solver picks N and the lengths
    ("llama", 2, 4, "4", 2, "1f1b+disk"),  # OFF/PRE/WAIT actions, activations on disk
    ("gpt", 4, 4, "3", 2, "gpipe+disk"),
    ("llama", 2, 4, "4", 2, "1f1b+budget"),  # each rank solves its own offload plan
]


@pytest.mark.parametrize("model,stages,layers,chunks,microbatches,schedule", CASES)
def test_pipeline_matches_eager(tmp_path, model, stages, layers, chunks, microbatches, schedule):
    seq_len, batch = 32, 2
    chunk_args = ["--chunk-lengths", chunks] if "," in chunks else ["--chunks", chunks]
    if "+" in schedule:
        schedule, tier = schedule.split("+")
        chunk_args += ["--budget", "64MiB"] if tier == "budget" else ["--offload", tier]
    results = launch(stages, ["--model", model, "--layers", str(layers), "--seq-len", str(seq_len),
                              "--batch", str(batch), "--microbatches", str(microbatches),
                              "--schedule", schedule, "--dump", str(tmp_path), *chunk_args])
    for rank, (code, out, err, _) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ref_loss, ref_grads = _reference(model, layers, seq_len, batch, microbatches)
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
    if "--budget" in chunk_args:  # each rank's own plan: ratios per chunk, the last chunk offloads nothing
        assert all(d["offload_ratios"] is not None and d["offload_ratios"][-1] == 0 for d in dumps)
    if chunks == "auto":  # every rank used the solver's choice for this model and pipeline
        assert all(d["chunk_lengths"] == _solver_choice(model, layers, seq_len, batch // microbatches, stages,
                                                         microbatches) for d in dumps)


def test_dead_rank_makes_the_others_raise_within_timeout(tmp_path):
    timeout = 20.0
    results = launch(2, ["--model", "llama", "--layers", "2", "--seq-len", "16", "--chunks", "2",
                         "--microbatches", "1", "--timeout", str(timeout), "--fail-rank", "1",
                         "--fail-at", "backward"], timeout=120)
    (code0, _, err0, t0), (code1, _, err1, _) = results
    assert code1 == 17, err1[-2000:]
    assert code0 != 0
    assert "SppoError" in err0 and "rank 1" in err0, err0[-3000:]


def test_ranks_that_disagree_on_the_plan_fail_at_start(tmp_path):
    results = launch(2, ["--model", "gpt", "--layers", "2", "--seq-len", "16", "--chunks", "2",
                         "--microbatches", "1", "--plan-seed", "1", "--timeout", "30"], timeout=120)
    for code, _, err, _ in results:
        assert code != 0
        assert "ranks disagree on plan (chunk lengths)" in err, err[-3000:]


def test_torchrun_launch(tmp_path):
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), SCRIPT, "--model", "gpt", "--layers", "2",
                          "--seq-len", "24", "--chunks", "3", "--steps", "2", "--lr", "0.1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0]
