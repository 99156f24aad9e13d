"""One rank of several runs of examples/train_pipeline.py on one process group
(tests/distributed/test_pipeline_dist.py and test_scale_out.py).

    python tests/helpers/pipeline_cases_worker.py '[["--model", "gpt", ...], ...]'

argv[1] is a JSON list of argument lists, each what the example takes on its command line
(every case with its own --dump directory). Each case is `train_pipeline.train` on the
group this process joins once: a rank process spends seconds importing torch and joining
the group, more than a tiny model's whole run, so the cases that fit one world size share
one launch. Each case builds its own `sppo_fx.compile` (its own mesh and process groups),
as a separate launch would. Prints one JSON line: per case (by index) None, or the error
it raised (the rank then goes on with the next case; one that leaves its peers waiting
makes them raise within the case's --timeout), what it printed, and its seconds.
"""
import contextlib
import io
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train_pipeline  # noqa: E402

from sppo_fx.runtime.distributed import init_from_env  # noqa: E402


def main() -> int:
    cases = [train_pipeline.parse_args(argv) for argv in json.loads(sys.argv[1])]
    rank, world = init_from_env(max(max(a.timeout for a in cases), 120.0))
    results = {}
    for i, args in enumerate(cases):
        start, out = time.perf_counter(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                train_pipeline.train(args, rank, world)
            results[i] = {"error": None}
        except BaseException as e:  # noqa: BLE001 (SystemExit too: the test names the case)
            results[i] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        results[i].update(stdout=out.getvalue(), seconds=round(time.perf_counter() - start, 2))
    print(json.dumps(results))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
