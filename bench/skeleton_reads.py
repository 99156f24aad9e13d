"""Step time, streamed skeleton on disk: per-block files (before) vs one file (after)."""
import sys, time, tempfile, torch
sys.path.insert(0, "tests")  # the tiny program of the tests
from conftest import tiny_program
from sppo_fx import Plan
from sppo_fx.runtime import skeleton as skm
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.runtime.store import ActivationStore
model, cap, program = tiny_program("gpt")
params = [cap.param_value(p) for p in program.params]
real = skm.SkeletonLog
def step(n, store):
    x, y = torch.randint(0, 97, (2, n * 8)), torch.randint(0, 97, (2, n * 8))
    chunked_loss(program, params, [x, y], Plan(n * 8, [8] * n), store=store, skeleton="offload").backward()
for n in (8, 16):
    res = {}
    for rnd in range(3):
        for name, log in (("before", None), ("after", real)):
            skm.SkeletonLog = (lambda d: None) if log is None else log
            with ActivationStore("disk", dir=tempfile.mkdtemp()) as store:
                step(n, store)
                t = time.perf_counter(); [step(n, store) for _ in range(3)]
                res.setdefault(name, []).append((time.perf_counter() - t) / 3)
    print(f"N={n}: before {min(res['before'])*1e3:.1f} ms  after {min(res['after'])*1e3:.1f} ms")
