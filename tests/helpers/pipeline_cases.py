"""Run several cases of examples/train_pipeline.py in one launch of ranks
(tests/helpers/pipeline_cases_worker.py), for the tests that compare many small layouts.

`CaseLaunches` runs, on the first request for one case, every case of the same world
size in one launch and keeps each case's outcome for the tests that ask later (a module
fixture holds it; the module's tests share one xdist group so one worker launches them).
"""
from __future__ import annotations

import json
import os
import sys

from sppo_fx.runtime.launch import run_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "pipeline_cases_worker.py")


def run_cases(world: int, argvs: list[list[str]], timeout: float) -> list[list[dict]]:
    """Each argv run by `world` ranks, all in one launch: per case, per rank, {"error": None
    or the error it raised, "stdout": what it printed, "seconds"}. A rank that died is an
    AssertionError naming its stderr."""
    results = run_local_ranks([sys.executable, WORKER, json.dumps(argvs)], world, timeout, cwd=ROOT)
    per_rank = []
    for rank, (rc, out, err, _s) in enumerate(results):
        assert rc == 0, f"rank {rank} of the {world}-rank launch failed:\n{err[-4000:]}"
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    return [[r[str(i)] for r in per_rank] for i in range(len(argvs))]


class CaseLaunches:
    """case key -> (world, argv), launched by world size when a test first asks."""

    def __init__(self, cases: dict, timeout: float):
        self.cases, self.timeout, self.results = cases, timeout, {}

    def results_of(self, key) -> list[dict]:
        """Per rank, the case's outcome (`run_cases`), launching its world size's cases once."""
        if key not in self.results:
            world = self.cases[key][0]
            keys = [k for k, (w, _argv) in self.cases.items() if w == world]
            try:
                outcome = run_cases(world, [self.cases[k][1] for k in keys], self.timeout)
            except Exception as e:  # every case of the launch fails with it, without launching again
                outcome = [e] * len(keys)
            self.results.update(zip(keys, outcome))
        if isinstance(self.results[key], Exception):
            raise AssertionError(f"the launch running {key} failed") from self.results[key]
        return self.results[key]

    def errors_of(self, key) -> list[str | None]:
        """Per rank, None or the error the case raised."""
        return [r["error"] for r in self.results_of(key)]

    def check(self, key) -> None:
        """The case ran on every rank without an error."""
        errors = self.errors_of(key)
        assert all(e is None for e in errors), f"{key}: " + "\n".join(
            f"rank {r}: {e}" for r, e in enumerate(errors) if e)
