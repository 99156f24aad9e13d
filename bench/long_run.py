"""A long run that must leak nothing: N training steps with the disk tier.

Checks, against the same chunking without offload (trained side by side from the same
initial weights, SGD):
- the loss at every step is bitwise equal (offloading never changes the arithmetic);
- resident memory after step `--rss-from` and after the last step differ by at most 5%;
- open file descriptors do not grow;
- no offload file is left once the compiled model's store is closed.

    python bench/long_run.py --steps 200            # the full check (a few minutes on 2 cores)

Exit status 1 and the failed checks printed when a check fails. `tests/e2e/test_long_run.py`
runs it with fewer steps.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import tempfile

import torch

import sppo_fx
from sppo_fx.models import build


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _train(model, compiled, x, y, steps, on_step=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses


def long_run(steps: int = 200, rss_from: int = 20, seq_len: int = 1024, chunks: int = 4,
             offload_dir: str | None = None) -> dict:
    """Train `steps` steps with and without disk offload; returns the measurements and the
    list of failed checks (empty when all pass)."""
    torch.manual_seed(0)
    reference = build("llama", "tiny")
    model = copy.deepcopy(reference)
    x, y = (torch.randint(0, 97, (1, seq_len)) for _ in range(2))
    ref_losses = _train(reference, sppo_fx.compile(reference, chunks=chunks, compile=False), x, y, steps)

    own_dir = offload_dir is None
    offload_dir = offload_dir or tempfile.mkdtemp(prefix="sppo_long_run_")
    compiled = sppo_fx.compile(model, chunks=chunks, offload="disk", offload_dir=offload_dir, compile=False)
    marks = {}

    def measure(step):
        if step in (rss_from, steps):
            gc.collect()
            marks[step] = (_rss_bytes(), _open_fds())

    losses = _train(model, compiled, x, y, steps, measure)
    offloaded = compiled.store.peak_bytes_offloaded
    compiled.store.close()
    left = [os.path.join(r, f) for r, _, fs in os.walk(offload_dir) for f in fs]
    if own_dir and not left:
        os.rmdir(offload_dir)

    (rss0, fds0), (rss1, fds1) = marks[rss_from], marks[steps]
    failed = []
    if offloaded == 0:
        failed.append("nothing was offloaded: the run proves nothing")
    mismatched = [i + 1 for i, (a, b) in enumerate(zip(losses, ref_losses)) if a != b]
    if mismatched:
        failed.append(f"loss differs from the run without offload at steps {mismatched[:5]}")
    if abs(rss1 - rss0) > 0.05 * rss0:
        failed.append(f"RSS grew from {rss0 / 2**20:.1f} MiB (step {rss_from}) to {rss1 / 2**20:.1f} MiB")
    if fds1 > fds0:
        failed.append(f"open file descriptors grew from {fds0} to {fds1}")
    if left:
        failed.append(f"{len(left)} offload files left: {left[:3]}")
    return {"steps": steps, "rss_mib": (rss0 / 2**20, rss1 / 2**20), "fds": (fds0, fds1),
            "peak_offloaded_bytes": offloaded, "files_left": len(left), "final_loss": losses[-1],
            "failed": failed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rss-from", type=int, default=20, help="the step whose RSS the last step's is compared to")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=4)
    args = ap.parse_args(argv)
    r = long_run(args.steps, args.rss_from, args.seq_len, args.chunks)
    print(f"steps {r['steps']}: RSS {r['rss_mib'][0]:.1f} -> {r['rss_mib'][1]:.1f} MiB, open fds "
          f"{r['fds'][0]} -> {r['fds'][1]}, peak offloaded {r['peak_offloaded_bytes'] / 2**20:.2f} MiB, "
          f"files left {r['files_left']}, final loss {r['final_loss']:.4f}")
    for f in r["failed"]:
        print("FAILED:", f)
    return 1 if r["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
