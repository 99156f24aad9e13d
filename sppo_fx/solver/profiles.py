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
quantities on the current machine in a couple of seconds (`solver/calibration.py`).
"""
from __future__ import annotations

import dataclasses
import json
import math

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
        pass_op_seconds: `op_seconds` of the programs the memory passes build (offload
            nodes, AOTAutograd's graphs; every plan with a tier runs them), op by op; 0:
            unknown, `op_seconds` stands in.
        allocation_by_size: ((bytes, seconds per byte), ...): what allocating a fresh
            tensor of that size adds to writing it (`solver.allocation`: the allocator's
            page faults); (): not measured, the clock's allocation term left out.
        attention_call_seconds: fixed cost of one chunk attention call, forward + backward
            (`solver.clock`); 0: unknown, not charged.
        attention_by_dim: ((head dim, seconds per pair and head), ...) measured at those
            dims, which the clock interpolates (e + d·f is not the cost's shape); (): e + d·f.
        attention_square: ((chunk length, factor), ...): a chunk's causal-square pair over a
            prefix pair (>= 1) at those lengths; (): 1.
        attention_size: ((chunk length, factor), ...): a pair's cost at that many queries
            over `attention_by_dim`'s (measured at 256); (): 1.
        elementwise_bytes_per_s: bytes/s a chain of element-wise ops reads and writes on
            chunk-sized fp32 tensors (the clock's element-wise term); 0: unknown, left out.
        skeleton_read_seconds: what one streamed K/V skeleton block read adds to a chunk
            program beyond its pairs (`clock_calibration.skeleton_read_seconds`); 0:
            unknown, the clock charges `BLOCK_OPS` ops and half an attention call instead.
        weight_read_seconds: seconds per byte a matmul pays more for a weight read from
            memory than from the cache (`clock_calibration.weight_read_seconds`); 0: unknown.
        cache_bytes: the processor's last-level cache; weights of a model beyond it are
            read from memory by every chunk (0: unknown, every model's are).
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
    elementwise_bytes_per_s: float = 0.0
    skeleton_read_seconds: float = 0.0
    weight_read_seconds: float = 0.0
    cache_bytes: int = 0
    pass_op_seconds: float = 0.0
    allocation_by_size: tuple = ()

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
        for table in ("attention_by_dim", "attention_square", "attention_size", "allocation_by_size"):  # JSON: lists
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
        for field in ("op_seconds", "pass_op_seconds", "file_seconds", "attention_pair_seconds",
                      "attention_pair_dim_seconds", "attention_call_seconds", "skeleton_read_seconds",
                      "weight_read_seconds"):
            value = getattr(self, field)
            if not number(value) or value < 0:
                raise SppoError(f"DeviceProfile {field}={value!r}: give a finite number of seconds >= 0")
        for field, least, what in (("attention_by_dim", 0, "head dim > 0, seconds >= 0"),
                                   ("attention_square", 1, "chunk length > 0, factor >= 1"),
                                   ("attention_size", 1e-3, "chunk length > 0, factor > 0"),
                                   ("allocation_by_size", 0, "bytes > 0, seconds per byte >= 0")):
            table = getattr(self, field)
            if not isinstance(table, tuple) or not all(isinstance(x, tuple) and len(x) == 2 and all(map(number, x))
                                                       and x[0] > 0 and x[1] >= least for x in table):
                raise SppoError(f"DeviceProfile {field}={table!r}: give (({what}), ...)")
        if not number(self.elementwise_bytes_per_s) or self.elementwise_bytes_per_s < 0:
            raise SppoError(f"DeviceProfile elementwise_bytes_per_s={self.elementwise_bytes_per_s!r}: give a "
                            "finite rate >= 0 (0: unknown)")
        if not number(self.compiled_speedup) or self.compiled_speedup <= 0:
            raise SppoError(f"DeviceProfile compiled_speedup={self.compiled_speedup!r}: give a positive finite factor")
        if not number(self.n_half) or self.n_half < 0:
            raise SppoError(f"DeviceProfile n_half={self.n_half!r}: give a finite number of tokens >= 0")
        for field, least in (("memory_bytes", 1), ("disk_cache_bytes", 0), ("cache_bytes", 0)):
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
            *([("clock", f"op {self.op_seconds * 1e6:.1f} us"
                         + (f" ({self.pass_op_seconds * 1e6:.1f} us through the memory passes)"
                            if self.pass_op_seconds else "") + f", disk file {self.file_seconds * 1e6:.0f} us, "
                         + (("attention " + ", ".join(f"{t * 1e9:.1f}" for _, t in self.attention_by_dim)
                             + " ns per pair and head at d = " + "/".join(f"{d:g}" for d, _ in self.attention_by_dim)
                             + ", square x" + "/".join(f"{x:.2f}" for _, x in self.attention_square)
                             + " at c = " + "/".join(f"{c:g}" for c, _ in self.attention_square)
                             + ", per pair x" + "/".join(f"{x:.2f}" for _, x in self.attention_size)
                             + " at c = " + "/".join(f"{c:g}" for c, _ in self.attention_size) + "; ")
                            if self.attention_by_dim else
                            f"attention {self.attention_pair_seconds * 1e9:.2f} + d x "
                            f"{self.attention_pair_dim_seconds * 1e9:.3f} ns per pair and head, ")
                         + f"{self.attention_call_seconds * 1e6:.0f} us per call"
                         + (f", {self.skeleton_read_seconds * 1e6:.0f} us per streamed block read"
                            if self.skeleton_read_seconds else "")
                         + (f", weights from memory {self.weight_read_seconds * 1e9:.3f} ns a byte beyond a "
                            f"{self.cache_bytes / MiB:.0f} MiB cache" if self.weight_read_seconds else ""))]
              if self.op_seconds or self.file_seconds or self.attention_pair_seconds or self.attention_call_seconds
              or self.attention_by_dim else []),
            *([("element-wise", f"{self.elementwise_bytes_per_s / 1e9:.2f} GB/s")]
              if self.elementwise_bytes_per_s else []),
            *([("allocation", ", ".join(f"{s * 1e9:.3f}" for _, s in self.allocation_by_size)
                + " ns a byte at " + "/".join(_size(n) for n, _ in self.allocation_by_size))]
              if self.allocation_by_size else []),
            ("memory", f"{self.memory_bytes / GiB:.1f} GiB"),
            ("source", self.source),
        ]
        return tabulate(rows, tablefmt="plain")

    def __str__(self):
        return self.table()


def _size(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


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
