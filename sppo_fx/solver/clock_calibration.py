"""Measuring the clock's figures (`solver.clock.Clock`) on this machine, for
`calibration.calibrate`: what one op, one disk-tier file and one attention pair cost.

Each figure is the best of interleaved repetitions (`best_each`, which `calibration` times
with too: transient load from other processes slows some repetitions, never speeds one up). Compute figures (matmul,
memcpy, attention) on a CPU with one torch thread are timed in the process's CPU time
(`compute_timer`): a repetition longer than the scheduler's slice on a core shared with
another process is slowed in wall time however many repetitions run (attention figures
came out 3.4x apart a few minutes apart on a loaded 2-core machine), while CPU time stops
whenever the core is elsewhere. The real programs' per-op probe stays in wall time (their
hand-offs to the runtime's threads are waits a user's step pays).
"""
from __future__ import annotations

import functools
import os
import queue
import tempfile
import threading
import time


def compute_timer(device=None):
    """The clock that times compute on `device`: on a CPU with one torch thread, the
    process's CPU time (all its threads; it does not run while other processes hold the
    core); else wall time (several threads' CPU time would add up; a GPU's work is not the
    process's CPU time)."""
    import torch
    if (device is None or getattr(device, "type", device) == "cpu") and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def stopwatch(device=None, timer=None):
    """(start(), stop(token) -> seconds) that time work on `device`: CUDA events on a CUDA
    device (the GPU's time, not the launch's), else `timer` (default `compute_timer(device)`)."""
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end) / 1e3
        return start, stop
    clock = compute_timer(device) if timer is None else timer
    return clock, lambda t0: clock() - t0


def best_each(fns, budget_s: float, *, min_rounds: int = 2, max_rounds: int = 500, device=None,
              timer=None) -> list[float]:
    """Best seconds per call of each fn, in at least `min_rounds` interleaved rounds (at most
    `max_rounds`) within about `budget_s` of wall time, after one warm-up call each.

    The one timing primitive of the calibration: transient load from other processes slows
    some repetitions and never speeds one up, so the best is the figure; interleaving makes a
    burst of load hit every function alike rather than whichever ran during it. Timed by
    `stopwatch(device, timer)`.
    """
    start, stop = stopwatch(device, timer)
    for fn in fns:
        fn()
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch
        torch.cuda.synchronize(device)
    best, t_end, n = [float("inf")] * len(fns), time.perf_counter() + budget_s, 0
    while n < min_rounds or (time.perf_counter() < t_end and n < max_rounds):
        for i, fn in enumerate(fns):
            t0 = start()
            fn()
            best[i] = min(best[i], stop(t0))
        n += 1
    return [max(t, 1e-9) for t in best]


def _best(fn, reps: int, budget_s: float, timer=time.perf_counter) -> float:
    """Best seconds of fn() by `timer` over at least `reps` calls within about `budget_s`."""
    return best_each([fn], budget_s, min_rounds=reps, max_rounds=50 * reps, timer=timer)[0]


def op_seconds(budget_s: float = 0.1) -> float:
    """Fixed cost of one small op of an op-by-op chunk program (dispatch, allocation), per
    op the clock counts: a chain of small ops run forward and backward through autograd,
    over the 3 ops the clock counts per forward op (itself and about two in the backward).
    A bare op from Python (no autograd, no backward) costs a third to a half of that."""
    import torch
    a, b = torch.ones(64, requires_grad=True), torch.ones(64)
    ops = 100

    def run():
        x = a
        for _ in range(ops):
            x = torch.mul(x, b)
        x.sum().backward()
    return _best(run, 3, budget_s, compute_timer()) / (3 * ops)


def elementwise_bytes_per_s(device, budget_s: float = 0.15, tokens: int = 1024, width: int = 512,
                            allocation: tuple = ()) -> float:
    """Bandwidth of the element-wise term (`Clock.elementwise_bytes_per_s`): the pointwise
    ops of an RMSNorm (pow, mean, rsqrt, two broadcast muls) and of an MLP gate (mul by a
    broadcast weight, add, silu) on [tokens, width] tensors of chunk size, forward and
    backward through autograd,
    each op allocating its output as a program's do; what those allocations cost at the
    `allocation` prices (`solver.allocation`) is taken out, the clock's allocation term
    charges it (the process's allocator settings, e.g. `MALLOC_MMAP_THRESHOLD_`, decide
    it). Returned per byte of
    the forward's reads and writes, times the clock's 1 + `ELEMENTWISE_BACKWARD` passes:
    seconds = forward bytes x 3 / this rate is what the chain's forward + backward took."""
    import torch
    from sppo_fx.solver.clock import ELEMENTWISE_BACKWARD
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(width, device=device, dtype=dtype, requires_grad=True)
    # gate: mul 2 passes, add 3, silu 2; norm: pow 2, mean 1, the muls 2 each ([n, 1] ones
    # are small): 14 passes of [tokens, width], as `passes.cost.elementwise_bytes` counts them
    forward_bytes = 14 * x.numel() * x.element_size()

    def run():
        gate = torch.nn.functional.silu(x * w + x)
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        torch.autograd.backward((gate, norm), (torch.ones_like(gate), torch.ones_like(norm)))
        x.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = _best(run, 3, budget_s, compute_timer(device))
    if allocation:
        from sppo_fx.solver.allocation import allocated_seconds
        # at most half: a probe is never all allocation (a stall mid-probe could say so)
        seconds -= min(allocated_seconds(run, allocation), seconds / 2)
    return (1 + ELEMENTWISE_BACKWARD) * forward_bytes / max(seconds, 1e-12)


def file_seconds(dir: str | None = None, budget_s: float = 0.15, files: int = 32) -> float:
    """Fixed cost of one file the disk tier writes and reads back: create, write, close;
    then open, read, close, remove; each handed to a background thread and waited for, as
    the store does. A 4 KiB file: the bytes' cost is the bandwidths' business."""
    work: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def worker():
        while True:
            job = work.get()
            if job is None:
                return
            done.put(job())

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    data = os.urandom(4096)
    directory = tempfile.mkdtemp(prefix="sppo_calibrate_files_", dir=dir)

    def write(path):
        def job():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
        return job

    def read(path):
        def job():
            with open(path, "rb", buffering=0) as f:
                f.read()
            os.remove(path)
        return job

    def run():
        paths = [os.path.join(directory, f"f{i}") for i in range(files)]
        for jobs in ([write(p) for p in paths], [read(p) for p in paths]):
            for job in jobs:  # one at a time: a chunk's offload waits on each in turn
                work.put(job)
                done.get()
    try:
        return _best(run, 2, budget_s) / files
    finally:
        work.put(None)
        thread.join(5)
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)


def _attention_pass(device, c: int, p: int, d: int, heads: int = 4):
    """One forward + backward of the library's chunk attention ops on c queries against
    p + c keys, as a chunk program runs them: the forward op, then the backward op with no
    lse gradient. (Autograd through `chunk_attention(...).sum()` hands the backward a zero
    lse gradient, which takes the plain-PyTorch reference path: 3-5x slower on a CPU than
    what the programs run.)"""
    import math
    import torch
    import sppo_fx.chunk_attention.op  # noqa: F401 - registers torch.ops.sppo_fx
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, heads, c, d, device=device, dtype=dtype)
    k, v = (torch.randn(1, heads, p + c, d, device=device, dtype=dtype) for _ in range(2))
    scale, ops = 1 / math.sqrt(d), torch.ops.sppo_fx
    if device.type == "cuda":
        return _flash_split_pass(q, k, v, p, scale)

    def run():
        out, lse = ops.chunk_attention_fwd(q, k, v, scale, True)
        ops.chunk_attention_bwd(out, q, k, v, out, lse, None, scale, True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def _flash_split_pass(q, k, v, p: int, scale: float):
    """On CUDA a bf16 chunk program's attention is the flash split (docs/gpu.md), forward and
    backward through its autograd function; the Triton ops above would time another kernel
    and autotune each shape, a minute of the first call."""
    import torch
    from sppo_fx.chunk_attention.kernels.flash_split import flash_split_attention
    q = q.requires_grad_()
    k, v = (t.requires_grad_() for t in (k, v))
    grad = torch.ones_like(q)

    def run():
        out = flash_split_attention(q, k[:, :, :p], k[:, :, p:], v[:, :, :p], v[:, :, p:], scale)
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize(q.device)
    return run


def attention_call_seconds(device, budget_s: float = 0.1) -> float:
    """Fixed cost of one call of the library's chunk attention, forward + backward: a call
    on 4 heads of 1 query after 1 prefix key, whose arithmetic is nil. Each attention site of each
    chunk (and each streamed skeleton block) pays it, so short chunks cost more than their
    pairs say."""
    # after a 1-key prefix: the path of every chunk but the first (two kernel calls and their
    # log-sum-exp merge, forward and backward), dearer than one call without a prefix
    return _best(_attention_pass(device, 1, 1, 16), 3, budget_s, compute_timer(device))


#: head dims the attention pair cost is measured at (`Clock.attention_by_dim`)
ATTENTION_DIMS = (8, 16, 32, 64, 128)
#: chunk lengths a causal square's pair cost is measured at (`Clock.attention_square`)
SQUARE_QUERIES = (256, 1024)
#: chunk lengths a pair's cost is measured at, after a prefix of 3x (`Clock.attention_size`);
#: 256 is the per-dim table's shape
SIZE_QUERIES = (128, 256, 1024)


def attention_figures(device, budget_s: float = 0.3) -> tuple[float, float, tuple, tuple, tuple]:
    """(e, f, by_dim, square, size): forward + backward seconds of the library's chunk
    attention per causal (query, key) pair and head, the call's fixed cost taken out:

    - by_dim: ((d, seconds), ...) at each of `ATTENTION_DIMS`, on a chunk's shape (256
      queries after a 768-token prefix); the cost is not linear in d (on a CPU d = 8 costs
      what d = 32 does, twice the line through 16 and 64 says);
    - e, f: that line, e + d·f through d = 16 and 64 (shown in the profile's table, and
      the clock's figure where a profile has no table);
    - size: ((c, factor), ...) at c = 128, 256, 1024 (prefix 3c, d = 32): a pair's cost at
      c queries over its cost at 256 (idle CPU: about 1.05 at 128, 0.9 at 1024);
    - square: ((c, factor), ...) at c = 256 and 1024: a pair of a chunk's causal square (c
      queries, no prefix) over a prefix pair at that c, d = 32. The kernel computes the
      diagonal's tiles whole: 1.3-1.8x at 256-512 queries on a CPU, about 1.1 at 1024.

    On a CPU attention is bound by its softmax and memory traffic more than by FLOPs (a head
    dim of 8 runs at a few percent of the matmul rate), hence figures of its own. At least
    four heads, and no fewer than the torch threads on a CPU: the CPU kernel splits its work
    over heads and query blocks, so one head leaves threads idle (2 threads: 6.2 ns a pair
    and head on one head, 4.4 on two, 4.2 on four, where the models have 4-12 heads), and
    some processes ran one head at twice that again for their whole life (11 ns, one
    calibration in three or four); on 4 heads neither was seen."""
    import torch
    c, p = 256, 768
    heads = max(4, torch.get_num_threads()) if device.type == "cpu" else 4
    timer = compute_timer(device)
    call = attention_call_seconds(device, budget_s / 8)
    fns = [_attention_pass(device, c, p, d, heads) for d in ATTENTION_DIMS]
    fns += [_attention_pass(device, n, 0, 32, heads) for n in SQUARE_QUERIES]
    # shorter shapes on more heads: a repetition of a millisecond or less is what load
    # distorts most (128 queries on one head came out 1.2x and 2.1x in two loaded rounds)
    wide = {n: heads * max(1, c // n) for n in SIZE_QUERIES}
    fns += [_attention_pass(device, n, 3 * n, 32, wide[n]) for n in SIZE_QUERIES if n != c]
    times = best_each(fns, budget_s, min_rounds=3, max_rounds=150, timer=timer)
    k, m = len(ATTENTION_DIMS), len(SQUARE_QUERIES)

    def per_pair(t, n, prefix, h=heads):
        # at most half a pass is the call's: under load its own short probe can come out
        # above a whole pass (every figure 0 then, seen with the suite on 2 busy cores)
        return (t - min(call, t / 2)) / (h * n * (prefix + (n + 1) / 2))
    per = [per_pair(t, c, p) for t in times[:k]]
    by_dim = tuple(zip(ATTENTION_DIMS, per))
    at = dict(by_dim)
    ref = at[32] or 1e-12
    others = iter(times[k + m:])
    size = tuple((n, 1.0 if n == c else max(per_pair(next(others), n, 3 * n, wide[n]) / ref, 1e-3))
                 for n in SIZE_QUERIES)
    sized = dict(size)
    square = tuple((n, max(per_pair(t, n, 0) / (ref * sized.get(n, 1.0)), 1.0))
                   for n, t in zip(SQUARE_QUERIES, times[k:k + m]))
    f = max((at[64] - at[16]) / (64 - 16), 0.0)
    return max(at[16] - 16 * f, 0.0), f, by_dim, square, size


def attention_pair_seconds(device, budget_s: float = 0.3) -> tuple[float, float]:
    """(e, f) of `attention_figures`."""
    return attention_figures(device, budget_s)[:2]


def program_op_seconds(call_seconds: float = 0.0, budget_s: float = 0.6, offload: str | None = None) -> float | None:
    """Fixed cost per op the clock counts, measured on real op-by-op chunk programs: a
    1-layer tiny Llama at 64 tokens in 1 and in 4 chunks (its work is nil), each chunk
    more costing (its forward and backward programs' Python, dispatch, the runtime's
    hooks and the custom ops' dispatch) what the clock charges as 3 x `ops` x op_seconds
    plus its attention calls (`call_seconds` each). A plain-op chain (`op_seconds`) sees
    a tenth of that on this CPU. `offload`: a tier, to measure the programs the memory
    passes build (AOTAutograd's forward and backward graphs with offload nodes, the path
    of every plan with a tier, `orchestrate.stage.needs_chunk_program`): "device" moves
    no bytes, so the figure holds no copy or file cost, which the clock charges apart;
    about 2.3x the plain programs' per chunk on this CPU (docs/solver-clock.md). None
    where the library cannot run the probe (the caller keeps `op_seconds` then)."""
    import torch
    import sppo_fx
    from sppo_fx.models import build
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = build("llama", "tiny", n_layers=1)
        x, y = (torch.randint(0, model.config.vocab_size, (1, 64)) for _ in range(2))
        runs = {n: sppo_fx.compile(model, chunks=n, compile=False, offload=offload) for n in (1, 4)}
        for run in runs.values():
            run.step(x, y)  # capture and build the programs (not timed)
        # wall time: a program's step hands work to the runtime's threads and waits, which a
        # user's step pays on an idle machine and CPU time leaves out (on a loaded one the
        # CPU-time figure came out 4x under: 6 us, against 26 us of wall time at load 2)
        t1, t4 = float("inf"), float("inf")
        t_end, k = time.perf_counter() + budget_s, 0
        while k < 3 or (time.perf_counter() < t_end and k < 50):  # interleaved: load hits both alike
            for n, run in runs.items():
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                run.step(x, y)
                dt = time.perf_counter() - t0
                t1, t4 = (min(t1, dt), t4) if n == 1 else (t1, min(t4, dt))
            k += 1
        cost = runs[4]._require_entry().cost
        ops, sites = getattr(cost, "ops", 0), len(getattr(cost, "attention", ()))
        per_chunk = (t4 - t1) / 3 - sites * call_seconds
        return max(per_chunk, 0.0) / (3 * ops) if ops else None
    except Exception:  # noqa: BLE001 - a probe, not a feature: the plain-op figure stands in
        return None
    finally:
        torch.random.set_rng_state(state)


class ProbeBlocks:
    """The active chunk memory the streamed attention op asks for its blocks' stream and a
    place for their gradients, over a bare `SkeletonLog` (`skeleton_read_seconds`)."""

    def __init__(self, log, blocks):
        self.log, self.blocks, self.grads = log, blocks, {}

    def kv_blocks(self, site):
        return self.log.stream(self.blocks)

    def kv_add_grad(self, site, j, dk, dv):
        for slot, g in ((2 * j, dk), (2 * j + 1, dv)):
            acc = self.grads.get(slot)
            self.grads[slot] = g if acc is None else acc.add_(g)


#: the streamed-block probe's shape at calibration (`skeleton_read_seconds`): 16-token
#: blocks and queries (the minimum plans' chunks), 4 query heads on 2 K/V heads, head dim 16
READ_PROBE = dict(tokens=16, heads=4, kv_heads=2, dim=16)


def skeleton_read_seconds(budget_s: float = 0.1, pair_seconds: float = 0.0, *, heads: int = 4, kv_heads: int = 2,
                          dim: int = 16, tokens: int = 16) -> float:
    """Seconds one streamed K/V skeleton block read adds to a CPU chunk program, the
    block's (query, key) pairs taken out (the attention term charges those): the library's
    streamed attention op, forward and backward, on one chunk of `tokens` queries against 8
    and against 40 blocks of `tokens` keys read back through the runtime's `SkeletonLog`
    (each block is read twice, once a pass), (t(40) - t(8)) / 64, less `pair_seconds` (per
    pair and head at `dim`) times a block's pairs. What a read costs: the block's pread and
    checksum, the attention call on it, the log-sum-exp merge, its gradients' accumulation.
    It grows with the heads and the head dim (the merge and the kernel's per-head work), so
    a model is charged its own shape's figure (`orchestrate.stage.device_profile`). Inside
    a real program the same reads took 1.15-1.35x what this probe reads on this machine
    (docs/solver-clock.md). The clock charged `BLOCK_OPS` ops and half an attention call
    before (121 us, 2-2.5x a read)."""
    import torch
    from sppo_fx.ops.offload import active_memory
    from sppo_fx.ops.skeleton import streamed_prefix_attention
    from sppo_fx.runtime.skeleton_log import SkeletonLog
    c, h, kv, d = tokens, heads, kv_heads, dim
    logs = []

    def probe(directory: str, n_blocks: int):
        log = SkeletonLog(directory)
        logs.append(log)
        memory = ProbeBlocks(log, [(log.put(torch.randn(1, kv, c, d)), log.put(torch.randn(1, kv, c, d)))
                                    for _ in range(n_blocks)])
        q = torch.randn(1, h, c, d, requires_grad=True)
        k, v = (torch.randn(1, kv, c, d, requires_grad=True) for _ in range(2))
        hk, hv = torch.empty(1, kv, n_blocks * c, d, 0), torch.empty(1, kv, n_blocks * c, d, 0)

        def run():
            with active_memory(memory):
                streamed_prefix_attention(q, hk, k, hv, v, 0, enable_gqa=kv != h).sum().backward()
        return run

    with tempfile.TemporaryDirectory(prefix="sppo-fx-read-probe-") as directory:
        try:
            # wall time: a read's pread and checksum are the program's wait, whatever the CPU time
            t8, t40 = best_each([probe(directory, 8), probe(directory, 40)], budget_s, min_rounds=3, max_rounds=60,
                                timer=time.perf_counter)
        finally:
            for log in logs:
                log.close()
    per_read = (t40 - t8) / (2 * 32)
    return max(per_read - c * c * h * pair_seconds / 2, 0.0)


@functools.lru_cache(maxsize=16)
def _read_at(heads: int, dim: int, pair_seconds: float) -> float:
    return skeleton_read_seconds(0.05, pair_seconds, heads=heads, kv_heads=heads, dim=dim)


def with_model_reads(profile, cost):
    """`profile` with its `skeleton_read_seconds` measured at `cost`'s widest attention
    site (batch x heads, head dim; its K/V heads taken as many, which the cost model does
    not tell): a probe of about 0.1 s, once per shape and process. Unchanged where the
    profile has no read figure (a GPU's, a spec's) or the model no attention site."""
    import dataclasses
    from sppo_fx.solver.clock import Clock
    sites = getattr(cost, "attention", ())
    if not getattr(profile, "skeleton_read_seconds", 0.0) or not sites:
        return profile
    heads, dim = max(sites, key=lambda s: s[0] * s[1])
    read = _read_at(int(heads), int(dim), Clock.of(profile).pair_seconds(dim))
    return dataclasses.replace(profile, skeleton_read_seconds=read) if read > 0 else profile


def last_level_cache_bytes() -> int:
    """The processor's largest cache in bytes (Linux sysfs), 0 where unknown."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for name in (n for n in os.listdir(base) if n.startswith("index")):
            with open(os.path.join(base, name, "size")) as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        return 0
    return max(sizes, default=0)


#: rows of the weight-streaming probe's matmuls (`weight_read_seconds`): the minimum plans' chunks
WEIGHT_PROBE_ROWS = 16


def weight_read_seconds(budget_s: float = 0.05, cache_bytes: int = 0) -> float:
    """Seconds per byte of weight that a matmul pays more when its weight comes from
    memory rather than the processor's cache. A model whose weights do not fit the cache
    reads every weight from memory in each chunk's forward and backward, however short the
    chunk. Timed on 16 rows against 512 x 512 fp32 weights: one weight over and over
    (cached) against a rotation of twice the cache's bytes (at least 64 MiB). On this
    machine 0.05-0.07 ns a byte at 16 rows, and within noise the same at 64 and 256
    (docs/solver-clock.md), so the clock charges it per byte at every chunk length."""
    import torch
    d = 512
    weight = d * d * 4
    count = max(2 * cache_bytes, 64 << 20) // weight
    weights = [torch.ones(d, d) for _ in range(count)]
    x = torch.ones(WEIGHT_PROBE_ROWS, d)
    hot, cold = best_each([lambda: [torch.mm(x, weights[0]) for _ in range(count)],
                           lambda: [torch.mm(x, w) for w in weights]],
                          budget_s, min_rounds=3, max_rounds=20, timer=time.perf_counter)
    return max(cold - hot, 0.0) / (count * weight)
