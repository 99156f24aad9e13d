"""What one read of a streamed K/V skeleton block costs, against what the clock charges.

Two measurements (docs/solver-clock.md, "One streamed block, measured"):

* **program**: a 1-layer tiny Llama at 64 tokens in N chunks, op by op, its skeleton kept
  and streamed from disk (`skeleton="offload"`); the streamed step's extra time over the
  kept one, per block read (reads = 2 passes x N (N - 1) / 2 per site). Per-chunk costs of
  the streamed program (puts, handles, gradient takes) are in it too.
* **op**: the skeleton's attention op alone (`ops.skeleton.streamed_prefix_attention`,
  forward and backward through autograd) on 1 query against B blocks read back through the
  runtime's `SkeletonLog` (one file, one in-order read task a pass): (t(64) - t(16)) / 96
  reads, so a stream's fixed cost drops out, and (t(16) - t(0) - 32 reads) / 2 per stream.

The clock charges a read the profile's `skeleton_read_seconds` (measured on the op at
16-token blocks, and again at a model's own attention shape), where a profile has none
`BLOCK_OPS` x op_seconds + attention_call_seconds / 2, and a stream `file_seconds`
(`sppo_fx/solver/clock.py`); the profile is this machine's stored one.

    PYTHONPATH=. OMP_NUM_THREADS=1 taskset -c 1 python bench/streamed_block.py
"""
from __future__ import annotations

import tempfile
import time

import torch

import sppo_fx
from sppo_fx.models import build
from sppo_fx.ops.offload import active_memory
from sppo_fx.ops.skeleton import streamed_prefix_attention
from sppo_fx.runtime.skeleton_log import SkeletonLog
from sppo_fx.solver.clock import BLOCK_OPS
from sppo_fx.solver.clock_calibration import ProbeBlocks
from sppo_fx.solver.profile_cache import device_profile


def program_per_read(n: int, rounds: int = 10) -> tuple[float, float, float]:
    """(kept step, streamed step, extra per block read), seconds."""
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)
    x, y = (torch.randint(0, model.config.vocab_size, (1, 64)) for _ in range(2))
    d = tempfile.mkdtemp()
    runs = {s: sppo_fx.compile(model, chunks=n, compile=False, recompute="none", offload="disk", offload_dir=d,
                               skeleton=s) for s in ("keep", "offload")}
    for run in runs.values():
        run.step(x, y)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):  # interleaved: load hits both alike
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            run.step(x, y)
            best[name] = min(best[name], time.perf_counter() - t0)
    reads = 2 * n * (n - 1) // 2
    return best["keep"], best["offload"], (best["offload"] - best["keep"]) / reads


def op_seconds_with(blocks_n: int, rounds: int = 30, heads: int = 4, dim: int = 16) -> float:
    """Best seconds of one forward + backward of the streamed attention op over `blocks_n` blocks."""
    log = SkeletonLog(tempfile.mkdtemp())
    try:
        blocks = [(log.put(torch.randn(1, heads, 1, dim)), log.put(torch.randn(1, heads, 1, dim)))
                  for _ in range(blocks_n)]
        memory = ProbeBlocks(log, blocks)
        q, k, v = (torch.randn(1, heads, 1, dim, requires_grad=True) for _ in range(3))
        hk, hv = torch.empty(1, heads, blocks_n, dim, 0), torch.empty(1, heads, blocks_n, dim, 0)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            with active_memory(memory):
                streamed_prefix_attention(q, hk, k, hv, v, 0).sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        log.close()


def main() -> int:
    prof = device_profile("cpu")
    composite = BLOCK_OPS * prof.op_seconds + prof.attention_call_seconds / 2
    print(f"clock: {prof.skeleton_read_seconds * 1e6:.0f} us per block read (skeleton_read_seconds; the composite "
          f"of {BLOCK_OPS} ops x {prof.op_seconds * 1e6:.1f} us + half a call of "
          f"{prof.attention_call_seconds * 1e6:.0f} us: {composite * 1e6:.0f} us), "
          f"{prof.file_seconds * 1e6:.0f} us per stream")
    t0, t16, t64 = (op_seconds_with(b) for b in (0, 16, 64))
    per_read = (t64 - t16) / 96
    per_stream = (t16 - t0 - 32 * per_read) / 2
    print(f"op:      {per_read * 1e6:.0f} us per block read, {per_stream * 1e6:.0f} us per stream "
          f"(t(0) {t0 * 1e6:.0f} us, t(16) {t16 * 1e6:.0f} us, t(64) {t64 * 1e6:.0f} us)")
    for n in (16, 32):
        keep, stream, extra = program_per_read(n)
        print(f"program: N = {n}: kept {keep * 1e3:.1f} ms, streamed {stream * 1e3:.1f} ms, "
              f"{extra * 1e6:.0f} us more per block read ({n * (n - 1)} reads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
