"""Per-rank budgets of a 2-stage pipeline (gloo): each rank's plan comes from the single-stage
solver (recompute policies, CPU copy model, disk cache model; sppo_fx/solver/rank_budget.py),
its chunk program runs the chosen recompute policy, and its measured peak fits its budget
within the benchmark's stated tolerance (sppo_fx/benchmark/engine.py BUDGET_TOLERANCE).

One launch of tests/helpers/pipeline_budget_worker.py measures three runs of the same chunking on
each rank: the solver's choice (recompute "auto"), offload only (recompute "none", a budget
of its own per rank) and no budget.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from sppo_fx.benchmark.engine import BUDGET_TOLERANCE
from sppo_fx.models import build
from sppo_fx.runtime.launch import start_local_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "pipeline_budget_worker.py")
MiB = 2**20
# a llama of 2 layers (one per stage), width 256, 2 sequences of 2048 tokens in 2 micro-batches,
# 4 chunks: without a budget a rank's step adds ~60 MiB; every recompute policy without
# offload needs ~50 MiB on rank 0 (two micro-batches in flight under 1F1B)
SHAPE = dict(dim=256, layers=2, seq_len=2048, batch=2, microbatches=2, chunks=4)
AUTO_BUDGET = 33 * MiB               # below each rank's all-keep prediction (~35 MiB, ~47 MiB)
OFFLOAD_BUDGETS = [54 * MiB, 28 * MiB]  # recompute "none": only offload fits


def _flags(**kw) -> list[str]:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _eager(shape):
    torch.manual_seed(0)
    model = build("llama", "tiny", dim=shape["dim"], ffn_dim=2 * shape["dim"], n_layers=shape["layers"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (shape["batch"], shape["seq_len"]), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (shape["batch"], shape["seq_len"]), generator=gen)
    size = shape["batch"] // shape["microbatches"]
    total = 0.0
    for m in range(shape["microbatches"]):
        loss = model(x[m * size:(m + 1) * size], y[m * size:(m + 1) * size]) / shape["microbatches"]
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in model.named_parameters()}


def test_pipeline_ranks_fit_their_budgets(tmp_path, monkeypatch):
    # freed blocks go back to the OS, so the RSS high-water of a step is what the step adds
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    out = str(tmp_path / "run")
    procs = start_local_ranks([sys.executable, WORKER, out, "--budget", str(AUTO_BUDGET), "--offload-budgets",
                               ",".join(map(str, OFFLOAD_BUDGETS)), "--steps", "1", "--offload-dir", str(tmp_path),
                               *_flags(**SHAPE)], 2, cwd=ROOT)
    start = time.monotonic()
    for rank, p in enumerate(procs):
        try:
            _out, err = p.communicate(timeout=max(1.0, 600 - (time.monotonic() - start)))
        except Exception:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-4000:]}"
    results = [json.load(open(f"{out}.rank{r}")) for r in range(2)]
    grads = [torch.load(f"{out}.rank{r}.grads.pt") for r in range(2)]
    ref_loss, ref_grads = _eager(SHAPE)
    frac, extra = BUDGET_TOLERANCE
    report = []
    for rank, res in enumerate(results):
        free = res["unbudgeted"]
        assert free["offload_ratios"] is None and free["store"] is None  # nothing plans memory there
        for name in ("auto", "offload"):
            run = res[name]
            budget, peak = run["budget"], run["peak_bytes"]
            report.append(f"rank {rank} {name}: peak {peak / MiB:.1f} MiB, predicted "
                          f"{run['predicted_peak_bytes'] / MiB:.1f} MiB, budget {budget / MiB:.1f} MiB, "
                          f"recompute {run['recompute']}, ratios {run['offload_ratios']}; "
                          f"no budget {free['peak_bytes'] / MiB:.1f} MiB")
            # the plan differs from keeping everything, and the chunk program runs its policy
            assert run["offload_ratios"] is not None and len(run["offload_ratios"]) == SHAPE["chunks"]
            assert run["recompute"] != "none" or any(run["offload_ratios"]), f"all-keep plan: {report[-1]}"
            assert run["program_recompute"] == run["recompute"], report[-1]
            assert run["predicted_peak_bytes"] <= budget, report[-1]
            assert run["chunk_lengths"] == free["chunk_lengths"]
            if any(run["offload_ratios"]):  # the store held what the plan offloads, and gave it back
                assert run["store"]["peak_bytes_offloaded"] > 0, report[-1]
                assert run["store"]["bytes_offloaded"] == 0, report[-1]
            # measured: within the stated tolerance of the budget, and below the unbudgeted step's
            assert peak <= budget * (1 + frac) + extra, report[-1]
            assert peak < free["peak_bytes"], report[-1]
        assert res["offload"]["recompute"] == "none" and any(res["offload"]["offload_ratios"]), report[-1]
    # training semantics: every run's loss and gradients equal eager's
    for rank, (res, g) in enumerate(zip(results, grads)):
        for name in ("auto", "offload", "unbudgeted"):
            for loss in res[name]["losses"]:
                torch.testing.assert_close(torch.tensor(loss), ref_loss, rtol=1e-5, atol=1e-6)
            assert g[name], f"rank {rank} {name}: no gradients"
            for pname, grad in g[name].items():
                torch.testing.assert_close(grad, ref_grads[pname], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {name} {pname}: {m}")
    seen = {p for g in grads for p in g["auto"]}
    assert seen == set(ref_grads), f"no rank holds gradients for {set(ref_grads) - seen}"
    print("\n".join(report))


@pytest.mark.parametrize("schedule,stage,expected", [("gpipe", 0, 3), ("1f1b", 0, 2), ("1f1b", 1, 1)])
def test_inflight_microbatches(schedule, stage, expected):
    from sppo_fx.solver.rank_budget import inflight_microbatches
    assert inflight_microbatches(schedule, 2, 3, 4, stage) == expected
