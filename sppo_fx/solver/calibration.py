"""Calibration: the current machine's `DeviceProfile`, measured in a couple of seconds.

`calibrate()` times matmuls at several chunk sizes (the saturating efficiency curve of
`profiles.py`), copies, the offload directory's disk with and without the page cache, and
the clock's figures (`clock_calibration.py`). `profile_cache.py` stores the result once
per machine.
"""
from __future__ import annotations

import functools
import os
import tempfile
import time

from sppo_fx.errors import SppoError
from sppo_fx.solver.allocation import PROBE_SIZES, PROBE_VOLUME
from sppo_fx.solver.clock import Clock
from sppo_fx.solver.clock_calibration import best_each
from sppo_fx.solver.profiles import MiB, DeviceProfile


def _fit_saturating(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit rate(n) = R * n / (n + h) to (n, rate) points; returns (R, h).

    1 / rate = 1/R + (h/R) / n is linear in 1/n: least squares on that line, clamped so that
    R is at least the best measured rate and h >= 0.
    """
    best = max(r for _, r in points)
    if len(points) < 2:
        return best, 0.0
    xs = [1.0 / n for n, _ in points]
    ys = [1.0 / r for _, r in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    if intercept <= 0 or slope < 0:
        return best, 0.0
    rate, h = 1.0 / intercept, slope / intercept
    if rate < best:
        rate = best
        # keep the curve through the best point: h from R and that point
        n_b, r_b = max(points, key=lambda q: q[1])
        h = max(n_b * (rate / r_b - 1.0), 0.0)
    return rate, h


def _memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                total = min(total, int(text))
        except OSError:
            pass
    return int(total)


def _page_cache_bytes() -> int:
    """Dirty page-cache bytes Linux holds before background writeback starts (0: unknown)."""
    try:
        with open("/proc/sys/vm/dirty_background_bytes") as f:
            fixed = int(f.read().strip() or 0)
        if fixed:
            return fixed
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read().strip() or 0)
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return avail * ratio // 100
    except (OSError, ValueError, StopIteration):
        return 0


def _measure_disk(dir: str | None, nbytes: int) -> tuple[float, float, float]:
    """(write, read, cached write) bytes/s of a temp file: write + fsync, drop it from the
    page cache, read; then overwrite it in place without fsync (the page-cache rate)."""
    fd, path = tempfile.mkstemp(prefix="sppo_calibrate_", dir=dir)
    try:
        block = 8 * MiB
        data = memoryview(os.urandom(block))  # incompressible, written nbytes / block times
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, data[:min(block, left)])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the cache
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            chunk = os.read(fd, block)
            if not chunk:
                break
            got += len(chunk)
        read_s = time.perf_counter() - t0
        if got != nbytes:
            raise SppoError(f"calibrate: read back {got} of {nbytes} bytes from {path}")
        cached_s = float("inf")
        for _ in range(2):  # the page cache now holds the file: overwrite it, best of two
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                off += os.pwrite(fd, data[:min(block, nbytes - off)], off)
            cached_s = min(cached_s, time.perf_counter() - t0)
        return nbytes / max(write_s, 1e-9), nbytes / max(read_s, 1e-9), nbytes / max(cached_s, 1e-9)
    finally:
        os.close(fd)
        try:
            os.remove(path)
        except OSError:
            pass


def calibrate(device: str = "cpu", seconds: float = 2.0, dir: str | None = None,
              name: str | None = None) -> DeviceProfile:
    """Measure this machine's profile in about `seconds` seconds.

    Measures (budget split roughly 45% matmul, 25% copies, 30% disk, then
    about 30% more for the clock's figures, `clock_calibration`, and on a CPU the per-op
    cost of two tiny real chunk programs, whose capture adds a few seconds once per machine):
      * matmul FLOP/s of [n, d] x [d, d] for several token counts n (fp32 on CPU, bf16 on
        CUDA), fitted to rate(n) = flops_per_s * n / (n + n_half);
      * copy bandwidth: on CPU a memcpy between two buffers (device and host are the same
        memory, so d2h = h2d = memcpy); on CUDA pinned-host <-> device copies timed with events;
      * disk write (with fsync) and read (after dropping the file from the page cache with
        posix_fadvise where available; on tmpfs/overlay this still measures memory) of a
        temp file in `dir`, removed afterwards; then an overwrite of it without fsync (the
        page-cache rate the disk tier's pooled files see) and the OS's dirty-page limit;
      * memory: total device memory (CUDA) or physical RAM capped by the cgroup limit (CPU);
      * the element-wise bandwidth: a mul/add/silu chain on [1024, 512] tensors, forward
        and backward (`clock_calibration.elementwise_bytes_per_s`), its own allocations
        taken out;
      * what allocating a fresh tensor costs per byte, by size (`allocation_prices`, the
        clock's allocation term, `solver.allocation`); the matmuls above write into outputs
        allocated once, so that no byte is charged twice.

    The figures are what the machine does *now*: on a CPU shared with other busy processes,
    OpenMP threads get descheduled and matmuls run 5-100x slower for whole seconds (seen on
    a 2-core test machine: ~200 GFLOP/s idle, 1-35 GFLOP/s while another process used a
    core), which also inflates `n_half`. Calibrate on an otherwise idle machine, with the
    thread count training will use (`torch.get_num_threads()`, recorded in `source`).

    Args:
        device: "cpu" or "cuda[:i]".
        seconds: total time budget (sizes are small enough that 2 s suffice on 2 cores).
        dir: directory for the disk test (default: the system temp dir).
        name: profile name (default "calibrated-<device>").

    Returns:
        The measured `DeviceProfile`.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SppoError("calibrate(device='cuda'): CUDA is not available on this machine; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise SppoError(f"calibrate: unsupported device {device!r}; use 'cpu' or 'cuda'")
    seconds = max(float(seconds), 0.2)
    t_start = time.perf_counter()

    # Matmul rate vs tokens.
    if dev.type == "cuda":
        dtype, d, token_counts = torch.bfloat16, 4096, [256, 1024, 4096, 8192]
    else:
        dtype, d, token_counts = torch.float32, 512, [32, 128, 512, 1024]
    # What a fresh tensor costs (the allocator's page faults, `solver.allocation`): first,
    # so that the probes below can leave their own allocations out.
    allocation = allocation_prices(dev, 0.05 * seconds)
    w = torch.randn(d, d, dtype=dtype, device=dev)
    xs = [torch.randn(n, d, dtype=dtype, device=dev) for n in token_counts]
    # into outputs allocated once: the allocation term charges a program's fresh outputs
    outs = [torch.empty(n, d, dtype=dtype, device=dev) for n in token_counts]
    times = best_each([functools.partial(torch.mm, x, w, out=o) for x, o in zip(xs, outs)], 0.45 * seconds,
                      device=dev)
    rates = [2.0 * n * d * d / dt for n, dt in zip(token_counts, times)]
    # The model is monotone in n; a larger chunk can always run as the smaller one did, so
    # noise (a busy machine) is smoothed with a running maximum before the fit.
    points = [(n, max(rates[:i + 1])) for i, n in enumerate(token_counts)]
    del xs, w, outs
    flops, n_half = _fit_saturating(points)

    # Copy bandwidth.
    copy_budget = 0.125 * seconds
    if dev.type == "cuda":
        nbytes = 256 * MiB
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d2h = nbytes / best_each([lambda: host.copy_(devbuf, non_blocking=True)], copy_budget, max_rounds=200, device=dev)[0]
        h2d = nbytes / best_each([lambda: devbuf.copy_(host, non_blocking=True)], copy_budget, max_rounds=200, device=dev)[0]
        del host, devbuf
    else:
        nbytes = 64 * MiB
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        h2d = d2h = nbytes / best_each([lambda: dst.copy_(src)], 2 * copy_budget, max_rounds=200, device=dev)[0]
        del src, dst

    # The element-wise chain in two windows apart (here and after the disk), the better kept:
    # one 75 ms window once read 2.3 GB/s against a usual 5-7.5 (the demo's allocator
    # settings), which changed the plan; a stall that passes cannot take both windows.
    from sppo_fx.solver import clock_calibration as cc
    elementwise_early = cc.elementwise_bytes_per_s(dev, 0.04 * seconds, allocation=allocation)

    # Disk.
    disk_bytes = 64 * MiB if seconds >= 1.0 else 16 * MiB
    disk_w, disk_r, disk_cached_w = _measure_disk(dir, disk_bytes)

    # The clock's fixed costs and attention (solver/clock.py).
    op_s = cc.op_seconds(0.05 * seconds)
    file_s = cc.file_seconds(dir, 0.075 * seconds)
    attn_e, attn_f, attn_by_dim, attn_square, attn_size = cc.attention_figures(dev, 0.25 * seconds)
    attn_call = cc.attention_call_seconds(dev, 0.05 * seconds)
    elementwise_bw = max(elementwise_early, cc.elementwise_bytes_per_s(dev, 0.04 * seconds, allocation=allocation))
    read_s = weight_s = 0.0
    cache = cc.last_level_cache_bytes() if dev.type == "cpu" else 0
    if dev.type == "cpu":  # a real chunk program's per-op cost (on CUDA: the plain-op figure)
        op_s = cc.program_op_seconds(attn_call, 0.3 * seconds) or op_s
        # a streamed block's read, its pairs at the probe's head dim taken out (on CUDA: not
        # measured, the clock's composite of ops and half a call)
        probe_pair = Clock(attention_pair_seconds=attn_e, attention_pair_dim_seconds=attn_f,
                           attention_by_dim=tuple(attn_by_dim)).pair_seconds(cc.READ_PROBE["dim"])
        read_s = cc.skeleton_read_seconds(0.03 * seconds, probe_pair)
        weight_s = cc.weight_read_seconds(0.03 * seconds, cache)

    elapsed = time.perf_counter() - t_start
    return DeviceProfile(
        name=name or f"calibrated-{dev}", flops_per_s=float(flops), d2h_bytes_per_s=float(d2h),
        h2d_bytes_per_s=float(h2d), disk_write_bytes_per_s=float(disk_w),
        disk_read_bytes_per_s=float(disk_r), memory_bytes=_memory_bytes(dev), n_half=round(float(n_half), 1),
        disk_cached_write_bytes_per_s=float(disk_cached_w), disk_cache_bytes=_page_cache_bytes(),
        op_seconds=float(op_s), file_seconds=float(file_s), attention_pair_seconds=float(attn_e),
        attention_pair_dim_seconds=float(attn_f), attention_call_seconds=float(attn_call),
        attention_by_dim=tuple((int(d), float(t)) for d, t in attn_by_dim),
        attention_square=tuple((int(c), float(x)) for c, x in attn_square),
        attention_size=tuple((int(c), float(x)) for c, x in attn_size),
        elementwise_bytes_per_s=float(elementwise_bw), skeleton_read_seconds=float(read_s),
        weight_read_seconds=float(weight_s), cache_bytes=int(cache), allocation_by_size=allocation,
        source=f"calibrate(device={str(dev)!r}) in {elapsed:.1f} s; matmul d={d} {str(dtype).replace('torch.', '')}, "
               f"{torch.get_num_threads()} threads, "
               f"tokens {token_counts}; disk {disk_bytes // MiB} MiB in {dir or tempfile.gettempdir()}")


def allocation_prices(device, budget_s: float = 0.1, sizes=PROBE_SIZES) -> tuple:
    """((bytes, seconds per byte), ...): what allocating a fresh tensor of that size adds
    to writing it, per byte: `PROBE_VOLUME` bytes of such tensors allocated, filled and
    freed against the same fills into tensors allocated once, best of interleaved rounds,
    per tensor less the same difference for a tiny tensor (a tensor's fixed cost, which the
    clock's per-op figure already charges). () on a device other than a CPU.

    Many at once, not one: free blocks that earlier work left inside glibc's heap (2.7 MiB
    after two eager steps of the bench model) served a lone 256 KiB or 1 MiB probe from
    resident pages, and the table read 0 there, while a training step's gigabytes of such
    blocks get fresh pages (7.7 GiB of page faults a step, measured with `getrusage`)."""
    import torch
    if getattr(device, "type", device) != "cpu":
        return ()
    probed = (256,) + tuple(sizes)  # 256 bytes: a small bin of the heap, never fresh pages
    # the fixed-cost references (the two smallest sizes) one tensor each, as a program's
    # small outputs come; every larger size PROBE_VOLUME bytes of tensors alive at once
    counts = [1 if i < 2 else max(1, PROBE_VOLUME // n) for i, n in enumerate(probed)]
    kept = [[torch.empty(n // 4, dtype=torch.float32) for _ in range(k)] for n, k in zip(probed, counts)]

    def fresh(n, k):
        blocks = [torch.empty(n // 4, dtype=torch.float32) for _ in range(k)]
        for b in blocks:
            b.fill_(1.0)

    def refill(bufs):
        for b in bufs:
            b.fill_(1.0)

    fns = [f for n, k, bufs in zip(probed, counts, kept)
           for f in (lambda n=n, k=k: fresh(n, k), lambda bufs=bufs: refill(bufs))]
    # wall time: the faults are the kernel's work (system time) on the probe's own thread
    times = best_each(fns, budget_s, min_rounds=3, timer=time.perf_counter)
    extra = [max(times[2 * i] - times[2 * i + 1], 0.0) / k for i, k in enumerate(counts)]  # per tensor
    # a tensor's fixed cost: the cheaper of the two smallest sizes (each is served from the
    # heap or not depending on its state: a 256-byte block freed next to the heap's top can
    # give pages back under `MALLOC_TRIM_THRESHOLD_`, measured at 70 us in a worker)
    fixed = min(extra[:2])
    return tuple((int(n), max(x - fixed, 0.0) / n) for n, x in zip(sizes, extra[1:]))
