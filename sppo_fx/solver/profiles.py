"""Device profiles: the rates the solver turns FLOPs and bytes into seconds.

A `DeviceProfile` holds what one accelerator (or the CPU) achieves: matmul FLOP/s, the
device<->host copy bandwidths, the disk bandwidths of the offload tier and the device
memory. Chunks shorter than a few thousand tokens run matmuls below peak, which the
profile models with a saturating efficiency curve

    efficiency(n) = n / (n + n_half)        (n = tokens per chunk; 0.5 at n = n_half)

so that the effective rate of a chunk of n tokens is `flops_per_s * efficiency(n)`.

Built-in profiles use public spec figures, scaled to what training actually achieves:

    name        dense bf16 peak   x MFU 0.5    PCIe (effective)  NVMe      memory
    a100-80gb   312 TFLOP/s       156 TFLOP/s  gen4 ~25 GB/s     ~5 GB/s   80 GiB
    h100        989 TFLOP/s       495 TFLOP/s  gen5 ~50 GB/s     ~5 GB/s   79.6 GiB (81559 MiB)
    h200        989 TFLOP/s       495 TFLOP/s  gen5 ~50 GB/s     ~5 GB/s   140.4 GiB (143771 MiB)

(memory is what the driver reports for the 80 GB / 141 GB parts; `n_half` is a rough
figure: faster devices need longer chunks to saturate.) `calibrate()` measures the same
quantities on the current machine in a couple of seconds.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
import time

from tabulate import tabulate

from sppo_fx.errors import SppoError

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass
class DeviceProfile:
    """Achievable rates and capacity of one device.

    Attributes:
        name: profile name ("h100", "calibrated-cpu", ...).
        flops_per_s: dense matmul FLOP/s achievable on long chunks (the asymptote of the
            efficiency curve), in the training dtype (bf16 on GPUs, fp32 on CPU).
        d2h_bytes_per_s: device -> host copy bandwidth (pinned memory).
        h2d_bytes_per_s: host -> device copy bandwidth (pinned memory).
        disk_write_bytes_per_s: write bandwidth of the disk tier.
        disk_read_bytes_per_s: read bandwidth of the disk tier.
        memory_bytes: device memory (bytes).
        n_half: tokens per chunk at which compute efficiency is 0.5 (see `efficiency`).
        source: where the figures come from ("spec", "calibrate(...)", a file, ...).
        disk_cached_write_bytes_per_s: write bandwidth into the OS page cache (no fsync, a
            file overwritten in place, as the disk tier's pooled files are); None: unknown
            (`disk_write_bytes_per_s` applies to every byte).
        disk_cache_bytes: how much written data the OS keeps in its page cache before it
            starts writing back to the disk (Linux: vm.dirty_background_bytes or
            dirty_background_ratio of available memory); beyond it writes go at the
            disk's speed. 0: unknown.
        op_seconds, file_seconds, attention_pair_seconds, attention_pair_dim_seconds,
        compiled_speedup: the clock's figures (`solver.clock.Clock`): fixed cost of one op,
            of one disk-tier file written and read, attention seconds per pair and head
            (e + d·f), compiled programs' speed over op-by-op ones; 0 (1 for the speedup):
            unknown, the term is left out.
        attention_call_seconds: fixed cost of one chunk attention call, forward + backward
            (`solver.clock`); 0: unknown, not charged.
        attention_by_dim: ((head dim, seconds per pair and head), ...) measured at those
            dims, which the clock interpolates (e + d·f is not the cost's shape); (): e + d·f.
        attention_square: ((chunk length, factor), ...): a chunk's causal-square pair over a
            prefix pair (>= 1) at those lengths; (): 1.
        attention_size: ((chunk length, factor), ...): a pair's cost at that many queries
            over `attention_by_dim`'s (measured at 256); (): 1.
    """

    name: str
    flops_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    memory_bytes: int
    n_half: float = 512.0
    source: str = ""
    disk_cached_write_bytes_per_s: float | None = None
    disk_cache_bytes: int = 0
    op_seconds: float = 0.0
    file_seconds: float = 0.0
    attention_pair_seconds: float = 0.0
    attention_pair_dim_seconds: float = 0.0
    compiled_speedup: float = 1.0
    attention_call_seconds: float = 0.0
    attention_by_dim: tuple = ()
    attention_square: tuple = ()
    attention_size: tuple = ()

    def efficiency(self, tokens_per_chunk: float) -> float:
        """Fraction of `flops_per_s` reached by a chunk of this many tokens.

        Args:
            tokens_per_chunk: tokens in the chunk (per sequence in the batch times batch).

        Returns:
            n / (n + n_half), in [0, 1); 0 for n <= 0.
        """
        n = float(tokens_per_chunk)
        if n <= 0:
            return 0.0
        return n / (n + max(float(self.n_half), 0.0))

    def compute_seconds(self, flops: float, tokens_per_chunk: float) -> float:
        """Seconds to run `flops` FLOPs in chunks of `tokens_per_chunk` tokens.

        Args:
            flops: FLOPs to run.
            tokens_per_chunk: chunk size that sets the efficiency.

        Returns:
            flops / (flops_per_s * efficiency); inf for an empty chunk with work to do.
        """
        eff = self.efficiency(tokens_per_chunk)
        if flops <= 0:
            return 0.0
        return float("inf") if eff <= 0 else flops / (self.flops_per_s * eff)

    def copy_seconds(self, nbytes: float, direction: str) -> float:
        """Seconds to move `nbytes` one way.

        Args:
            nbytes: bytes to move.
            direction: "d2h", "h2d", "disk_write" or "disk_read".

        Returns:
            nbytes / bandwidth.
        """
        rates = {"d2h": self.d2h_bytes_per_s, "h2d": self.h2d_bytes_per_s,
                 "disk_write": self.disk_write_bytes_per_s, "disk_read": self.disk_read_bytes_per_s}
        if direction not in rates:
            raise SppoError(f"unknown copy direction {direction!r}; choose one of {sorted(rates)}")
        return float(nbytes) / rates[direction]

    def to_dict(self) -> dict:
        """The fields as a plain dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """JSON text (round-trips through `from_json`)."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        """Build from a dict; unknown keys raise `SppoError` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SppoError(f"unknown DeviceProfile field(s) {unknown}; known: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise SppoError(f"DeviceProfile is missing field(s) {missing}")
        for table in ("attention_by_dim", "attention_square", "attention_size"):  # JSON gives lists
            if isinstance(data.get(table), (list, tuple)):
                data = dict(data, **{table: tuple(tuple(x) if isinstance(x, (list, tuple)) else x
                                                  for x in data[table])})
        profile = cls(**data)
        profile.check()
        return profile

    def check(self) -> None:
        """Raise SppoError naming the first field the solver could not use: rates must be
        positive and finite (a rate of 0 would divide by zero, inf or NaN would make every
        plan free), sizes whole and not negative."""
        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not isinstance(self.name, str) or not isinstance(self.source, str):
            raise SppoError("DeviceProfile name and source must be strings")
        for field in ("flops_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s", "disk_write_bytes_per_s",
                      "disk_read_bytes_per_s"):
            value = getattr(self, field)
            if not number(value) or value <= 0:
                raise SppoError(f"DeviceProfile {field}={value!r}: give a positive finite rate")
        if self.disk_cached_write_bytes_per_s is not None and (
                not number(self.disk_cached_write_bytes_per_s) or self.disk_cached_write_bytes_per_s <= 0):
            raise SppoError(f"DeviceProfile disk_cached_write_bytes_per_s={self.disk_cached_write_bytes_per_s!r}: "
                            "give a positive finite rate, or None (unknown)")
        for field in ("op_seconds", "file_seconds", "attention_pair_seconds", "attention_pair_dim_seconds",
                      "attention_call_seconds"):
            value = getattr(self, field)
            if not number(value) or value < 0:
                raise SppoError(f"DeviceProfile {field}={value!r}: give a finite number of seconds >= 0")
        for field, least, what in (("attention_by_dim", 0, "head dim > 0, seconds >= 0"),
                                   ("attention_square", 1, "chunk length > 0, factor >= 1"),
                                   ("attention_size", 1e-3, "chunk length > 0, factor > 0")):
            table = getattr(self, field)
            if not isinstance(table, tuple) or not all(isinstance(x, tuple) and len(x) == 2 and all(map(number, x))
                                                       and x[0] > 0 and x[1] >= least for x in table):
                raise SppoError(f"DeviceProfile {field}={table!r}: give (({what}), ...)")
        if not number(self.compiled_speedup) or self.compiled_speedup <= 0:
            raise SppoError(f"DeviceProfile compiled_speedup={self.compiled_speedup!r}: give a positive finite factor")
        if not number(self.n_half) or self.n_half < 0:
            raise SppoError(f"DeviceProfile n_half={self.n_half!r}: give a finite number of tokens >= 0")
        for field, least in (("memory_bytes", 1), ("disk_cache_bytes", 0)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise SppoError(f"DeviceProfile {field}={value!r}: give a whole number of bytes >= {least}")

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        """Parse `to_json` output."""
        return cls.from_dict(json.loads(text))

    def table(self) -> str:
        """A two-column table with human units."""
        rows = [
            ("name", self.name),
            ("matmul", f"{self.flops_per_s / 1e12:.3f} TFLOP/s"),
            ("efficiency", f"n/(n + {self.n_half:g}): {self.efficiency(1024):.2f} at 1K tokens, "
                           f"{self.efficiency(8192):.2f} at 8K"),
            ("device -> host", f"{self.d2h_bytes_per_s / 1e9:.2f} GB/s"),
            ("host -> device", f"{self.h2d_bytes_per_s / 1e9:.2f} GB/s"),
            ("disk write", f"{self.disk_write_bytes_per_s / 1e9:.2f} GB/s"),
            ("disk read", f"{self.disk_read_bytes_per_s / 1e9:.2f} GB/s"),
            *([("disk write, cached", f"{self.disk_cached_write_bytes_per_s / 1e9:.2f} GB/s up to "
                                      f"{self.disk_cache_bytes / GiB:.1f} GiB")]
              if self.disk_cached_write_bytes_per_s else []),
            *([("clock", f"op {self.op_seconds * 1e6:.1f} us, disk file {self.file_seconds * 1e6:.0f} us, "
                         + (("attention " + ", ".join(f"{t * 1e9:.1f}" for _, t in self.attention_by_dim)
                             + " ns per pair and head at d = " + "/".join(f"{d:g}" for d, _ in self.attention_by_dim)
                             + ", square x" + "/".join(f"{x:.2f}" for _, x in self.attention_square)
                             + " at c = " + "/".join(f"{c:g}" for c, _ in self.attention_square)
                             + ", per pair x" + "/".join(f"{x:.2f}" for _, x in self.attention_size)
                             + " at c = " + "/".join(f"{c:g}" for c, _ in self.attention_size) + "; ")
                            if self.attention_by_dim else
                            f"attention {self.attention_pair_seconds * 1e9:.2f} + d x "
                            f"{self.attention_pair_dim_seconds * 1e9:.3f} ns per pair and head, ")
                         + f"{self.attention_call_seconds * 1e6:.0f} us per call")]
              if self.op_seconds or self.file_seconds or self.attention_pair_seconds or self.attention_call_seconds
              or self.attention_by_dim else []),
            ("memory", f"{self.memory_bytes / GiB:.1f} GiB"),
            ("source", self.source),
        ]
        return tabulate(rows, tablefmt="plain")

    def __str__(self):
        return self.table()


def _spec(name, peak_tflops, mfu, pcie_gbs, nvme_gbs, memory_bytes, n_half):
    return DeviceProfile(
        name=name, flops_per_s=peak_tflops * 1e12 * mfu, d2h_bytes_per_s=pcie_gbs * 1e9,
        h2d_bytes_per_s=pcie_gbs * 1e9, disk_write_bytes_per_s=nvme_gbs * 1e9,
        disk_read_bytes_per_s=nvme_gbs * 1e9, memory_bytes=int(memory_bytes), n_half=n_half,
        source=f"spec: {peak_tflops:g} TFLOP/s dense bf16 x MFU {mfu:g}, PCIe {pcie_gbs:g} GB/s, "
               f"NVMe {nvme_gbs:g} GB/s")


#: Built-in profiles (public spec figures, MFU 0.5).
PROFILES: dict[str, DeviceProfile] = {
    "a100-80gb": _spec("a100-80gb", 312, 0.5, 25, 5, 80 * GiB, 256),
    "h100": _spec("h100", 989, 0.5, 50, 5, 81559 * MiB, 512),
    "h200": _spec("h200", 989, 0.5, 50, 5, 143771 * MiB, 512),
}


def get_profile(name: str) -> DeviceProfile:
    """A built-in profile by name (a copy: changing it does not change the built-in).

    Args:
        name: one of `PROFILES` (case-insensitive; "a100" means "a100-80gb").

    Returns:
        The `DeviceProfile`. Raises `SppoError` listing the names for an unknown one.
    """
    key = name.strip().lower()
    key = {"a100": "a100-80gb", "a100-80g": "a100-80gb"}.get(key, key)
    if key not in PROFILES:
        raise SppoError(f"unknown device profile {name!r}; built-in profiles: {', '.join(sorted(PROFILES))} "
                        "(or measure this machine with sppo_fx.solver.calibrate())")
    return dataclasses.replace(PROFILES[key])


def profiles_table(profiles: list[DeviceProfile] | None = None) -> str:
    """One row per profile (default: the built-ins)."""
    profiles = list(PROFILES.values()) if profiles is None else profiles
    rows = [(pr.name, f"{pr.flops_per_s / 1e12:.1f}", f"{pr.d2h_bytes_per_s / 1e9:.1f}",
             f"{pr.h2d_bytes_per_s / 1e9:.1f}", f"{pr.disk_write_bytes_per_s / 1e9:.1f}",
             f"{pr.disk_read_bytes_per_s / 1e9:.1f}", f"{pr.memory_bytes / GiB:.1f}", f"{pr.n_half:g}")
            for pr in profiles]
    return tabulate(rows, headers=["profile", "TFLOP/s", "D2H GB/s", "H2D GB/s", "disk W GB/s",
                                   "disk R GB/s", "memory GiB", "n_half"])


# ------------------------------------------------------------------------ calibration


def _timer(device):
    """(start(), stop() -> seconds) measuring device work (CUDA events on CUDA)."""
    import torch

    if device.type == "cuda":
        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end) / 1e3
    else:  # CPU time with one thread: a core shared with another process (clock_calibration)
        from sppo_fx.solver.clock_calibration import compute_timer
        clock = compute_timer(device)

        def start():
            return clock()

        def stop(t0):
            return clock() - t0
    return start, stop


def _repeat(fn, budget_s: float, device, min_reps: int = 2, max_reps: int = 200) -> float:
    """Best seconds per call of fn() within roughly `budget_s` (after one warm-up call)."""
    start, stop = _timer(device)
    fn()
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
    best, spent, reps = float("inf"), 0.0, 0
    t_end = time.perf_counter() + budget_s
    while reps < min_reps or (time.perf_counter() < t_end and reps < max_reps):
        t0 = start()
        fn()
        dt = stop(t0)
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return max(best, 1e-9)


def _repeat_round_robin(fns, budget_s: float, device, min_rounds: int = 2, max_rounds: int = 500) -> list[float]:
    """Best seconds per call of each fn, measured in interleaved rounds within ~`budget_s`.

    Interleaving spreads transient contention (other processes) over all the functions
    instead of penalising whichever ran during it.
    """
    start, stop = _timer(device)
    for fn in fns:
        fn()
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
    best = [float("inf")] * len(fns)
    t_end = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() < t_end and rounds < max_rounds):
        for i, fn in enumerate(fns):
            t0 = start()
            fn()
            best[i] = min(best[i], stop(t0))
        rounds += 1
    return [max(t, 1e-9) for t in best]


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
      * memory: total device memory (CUDA) or physical RAM capped by the cgroup limit (CPU).

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
    w = torch.randn(d, d, dtype=dtype, device=dev)
    xs = [torch.randn(n, d, dtype=dtype, device=dev) for n in token_counts]
    times = _repeat_round_robin([functools.partial(torch.mm, x, w) for x in xs], 0.45 * seconds, dev)
    rates = [2.0 * n * d * d / dt for n, dt in zip(token_counts, times)]
    # The model is monotone in n; a larger chunk can always run as the smaller one did, so
    # noise (a busy machine) is smoothed with a running maximum before the fit.
    points = [(n, max(rates[:i + 1])) for i, n in enumerate(token_counts)]
    del xs, w
    flops, n_half = _fit_saturating(points)

    # Copy bandwidth.
    copy_budget = 0.125 * seconds
    if dev.type == "cuda":
        nbytes = 256 * MiB
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d2h = nbytes / _repeat(lambda: host.copy_(devbuf, non_blocking=True), copy_budget, dev)
        h2d = nbytes / _repeat(lambda: devbuf.copy_(host, non_blocking=True), copy_budget, dev)
        del host, devbuf
    else:
        nbytes = 64 * MiB
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        h2d = d2h = nbytes / _repeat(lambda: dst.copy_(src), 2 * copy_budget, dev)
        del src, dst

    # Disk.
    disk_bytes = 64 * MiB if seconds >= 1.0 else 16 * MiB
    disk_w, disk_r, disk_cached_w = _measure_disk(dir, disk_bytes)

    # The clock's fixed costs and attention (solver/clock.py).
    from sppo_fx.solver import clock_calibration as cc
    op_s = cc.op_seconds(0.05 * seconds)
    file_s = cc.file_seconds(dir, 0.075 * seconds)
    attn_e, attn_f, attn_by_dim, attn_square, attn_size = cc.attention_figures(dev, 0.25 * seconds)
    attn_call = cc.attention_call_seconds(dev, 0.05 * seconds)
    if dev.type == "cpu":  # a real chunk program's per-op cost (on CUDA: the plain-op figure)
        op_s = cc.program_op_seconds(attn_call, 0.3 * seconds) or op_s

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
        source=f"calibrate(device={str(dev)!r}) in {elapsed:.1f} s; matmul d={d} {str(dtype).replace('torch.', '')}, "
               f"{torch.get_num_threads()} threads, "
               f"tokens {token_counts}; disk {disk_bytes // MiB} MiB in {dir or tempfile.gettempdir()}")
