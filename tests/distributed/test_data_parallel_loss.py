"""Losses that read the batch size or the sequence length as a value, on two ranks: with
data_parallel=2 each rank captures its share of the batch, so the batch size in the captured
loss is the share's; sppo_fx proves from a batch-dynamic export how the loss uses it (only as
shapes, through summed partials, or as a value after the reductions, bound to the whole
micro-batch's) and refuses what mixes samples. seq_parallel=2 splits tokens: `/ T` reads the
whole sequence's length. One launch of tests/helpers/data_parallel_loss_worker.py."""
from __future__ import annotations

import json
import os
import sys

import pytest

from sppo_fx.runtime.launch import run_local_ranks

# one worker runs the module, so its one 2-rank launch (the `ranks` fixture) happens once
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("data_parallel_loss")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "data_parallel_loss_worker.py")

EXACT = ["dp2/mean_ce", "dp2/sum_ce_over_b", "dp2/kl_batchmean", "dp2/none_mean", "dp2/sample_weighted",
         "dp2/mse", "dp2/ignore_index", "sp2/sum_over_t", "sp2/sum_ce_over_b", "dp2_mb2/sum_ce_over_b"]
REFUSED = {"dp2/batch_mean_then_sum": "reduces over the batch dimension"}


@pytest.fixture(scope="module")
def ranks():
    results = run_local_ranks([sys.executable, WORKER], 2, 240.0, cwd=ROOT)  # one OpenMP thread a rank
    out = []
    for rc, stdout, stderr, _t in results:
        assert rc == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("case", EXACT)
def test_exact_against_the_model_on_the_full_batch(ranks, case):
    for rank in ranks:
        got = rank[case]
        assert got["error"] is None, got["error"]
        assert got["loss"] == pytest.approx(got["ref"], rel=1e-4, abs=1e-5)
        assert got["grad_err"] <= 1e-5  # every gradient allclose(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_any_step(ranks, case):
    for rank in ranks:
        got = rank[case]
        assert got["error"] is not None and REFUSED[case] in got["error"], got
        assert "data_parallel" in got["error"] and got["grads_left"] == 0
