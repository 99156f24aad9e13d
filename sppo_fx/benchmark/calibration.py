"""Calibration and counting shared by the step-time benchmarks (bench/pipeline.py, bench/scale.py).

- `calibrate_compute`: out of sample, on the eager model in this process: the FLOP rate,
  the backward/forward ratio and the per-chunk efficiency c_half of a two-chunk run (never
  the configuration that is then measured).
- `calibrate_links`: two local ranks on gloo time an all-to-all, an all-reduce and a
  point-to-point exchange at a small and a large size: latency and bandwidth of each
  (`solver.layout.LinkModel`).
- `CommCounter`: counts the bytes this rank sends through torch.distributed (isend,
  all_reduce, all_to_all_single) while it is active, by kind, and the seconds it spends
  inside the blocking collectives (waiting for a slower peer included).

    python -m sppo_fx.benchmark.calibration      # prints the links of this machine
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from sppo_fx.solver.layout import LinkModel
from sppo_fx.solver.partition import ChunkCostModel
from sppo_fx.solver.pipeline_chunks import ComputeModel

SMALL_BYTES, LARGE_BYTES = 4 * 1024, 4 * 2**20


def bench_model_and_data(kind: str, size: str, batch: int, seq_len: int):
    """The benchmark scripts' model (seed 0) and token batch (seed 1): (model, (x, y))."""
    from sppo_fx.models import build
    torch.manual_seed(0)
    model = build(kind, size)
    gen = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    return model, (torch.randint(0, v, (batch, seq_len), generator=gen),
                   torch.randint(0, v, (batch, seq_len), generator=gen))


def timed(fn, reps: int) -> list[float]:
    """Wall-clock seconds of `reps` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


@dataclasses.dataclass
class ComputeCalibration:
    """What `calibrate_compute` measured and derived.

    Attributes:
        t_forward / t_eager: eager forward and forward+backward (s).
        t_two_chunks: forward+backward through sppo_fx with two chunks (s).
        backward_factor: backward / forward time (also written into the cost model).
        compute: the ComputeModel (FLOP rate, c_half).
    """

    t_forward: float
    t_eager: float
    t_two_chunks: float
    backward_factor: float
    compute: ComputeModel

    def describe(self) -> str:
        return (f"eager fwd {self.t_forward:.3f} s, fwd+bwd {self.t_eager:.3f} s -> "
                f"{self.compute.flops_per_s / 1e9:.2f} GFLOP/s, backward/forward {self.backward_factor:.2f}; "
                f"2-chunk run {self.t_two_chunks:.3f} s -> c_half {self.compute.half_efficiency_tokens:.0f} tokens")


def calibrate_compute(model, inputs: tuple, cost: ChunkCostModel, seq_len: int, reps: int = 2) -> ComputeCalibration:
    """Calibrate the compute model on `model(*inputs)` (its loss) in this process.

    Sets cost.backward_factor to the measured ratio. The FLOP rate comes from the eager
    forward+backward over the whole sequence; c_half from a two-chunk sppo_fx run:
    t_two = Σ_chunks flops / (rate · c / (c + c_half)), solved for c_half.
    """
    import sppo_fx

    def eager_forward():
        with torch.no_grad():
            model(*inputs)

    def eager():
        model.zero_grad(set_to_none=True)
        model(*inputs).backward()

    t_fwd = statistics.median(timed(eager_forward, reps))
    t_eager = statistics.median(timed(eager, reps))
    cost.backward_factor = max((t_eager - t_fwd) / t_fwd, 0.5)
    rate = cost.forward_flops(seq_len, 0) * (1 + cost.backward_factor) / t_eager
    two = sppo_fx.compile(model, chunks=2, compile=False)

    def chunked_two():
        model.zero_grad(set_to_none=True)
        two(*inputs).backward()

    t_two = statistics.median(timed(chunked_two, reps))
    model.zero_grad(set_to_none=True)
    lengths = two.plan.chunk_lengths
    flops = [cost.forward_flops(c, s) * (1 + cost.backward_factor) for c, s in zip(lengths, [0, lengths[0]])]
    base = sum(flops) / rate
    extra = sum(f / c for f, c in zip(flops, lengths)) / rate
    c_half = max((t_two - base) / extra, 0.0) if extra else 0.0
    return ComputeCalibration(t_fwd, t_eager, t_two, cost.backward_factor, ComputeModel(rate, c_half))


# ---- links ---------------------------------------------------------------------------------
def _fit(small: float, large: float, sent_large: float) -> LinkModel:
    """Latency = the small transfer's time; bandwidth from the large one less that latency,
    counting at least half of its time as transfer (so that a slow small sample on a busy
    machine cannot make the bandwidth unbounded)."""
    return LinkModel(latency_s=small, bytes_per_s=sent_large / max(large - small, 0.5 * large))


def measure_links(reps: int = 8, small_reps: int = 20) -> dict[str, LinkModel]:
    """Latency and bandwidth of gloo collectives over the initialised default group, by kind
    ("all-to-all", "all-reduce", and with 2 ranks "p2p"), each rank sending SMALL_BYTES and
    LARGE_BYTES. Collective: every rank calls it; every rank gets the same fit (rank 0's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank if world == 2 else None

    def op_time(kind: str, nbytes: int, reps: int) -> float:
        x = torch.ones(nbytes // 4)
        y = torch.empty_like(x)

        def once():
            if kind == "all-to-all":
                dist.all_to_all_single(y, x)
            elif kind == "all-reduce":
                dist.all_reduce(x)
            elif rank == 0:  # p2p: a ping-pong, half of it
                dist.send(x, peer)
                dist.recv(y, peer)
            else:
                dist.recv(y, peer)
                dist.send(x, peer)
        times = []
        for k in range(reps + 1):
            dist.barrier()
            t = time.perf_counter()
            once()
            if k:
                times.append(time.perf_counter() - t)
        return statistics.median(times) / (2 if kind == "p2p" else 1)

    sent = {"all-to-all": (world - 1) / world, "all-reduce": 2 * (world - 1) / world, "p2p": 1.0}
    fits = []
    for kind in ["all-to-all", "all-reduce"] + (["p2p"] if peer is not None else []):
        small, large = op_time(kind, SMALL_BYTES, small_reps), op_time(kind, LARGE_BYTES, reps)
        link = _fit(small, large, sent[kind] * LARGE_BYTES)
        fits += [link.latency_s, link.bytes_per_s]
    fits = torch.tensor(fits, dtype=torch.float64)
    dist.broadcast(fits, 0)
    kinds = ["all-to-all", "all-reduce", "p2p"][:len(fits) // 2]
    return {kind: LinkModel(float(fits[2 * i]), float(fits[2 * i + 1])) for i, kind in enumerate(kinds)}


def _link_worker(out: str, reps: int) -> None:
    from sppo_fx.runtime.distributed import init_from_env
    rank, _ = init_from_env(120)
    links = measure_links(reps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({kind: dataclasses.asdict(link) for kind, link in links.items()}, f)
    dist.destroy_process_group()


def calibrate_links(world: int = 2, reps: int = 8, timeout_s: float = 120.0) -> dict[str, LinkModel]:
    """Latency and bandwidth of gloo collectives between `world` local ranks, by kind
    ("all-to-all", "all-reduce", and for 2 ranks "p2p"), each rank sending SMALL_BYTES
    and LARGE_BYTES."""
    from sppo_fx.runtime.launch import start_local_ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        procs = start_local_ranks([sys.executable, "-m", "sppo_fx.benchmark.calibration", "--link-worker", out,
                                   str(reps)], world, capture=True)
        errors = []
        for p in procs:
            _, err = p.communicate(timeout=timeout_s)
            if p.returncode:
                errors.append(err[-2000:])
        if errors:
            raise RuntimeError("link calibration failed:\n" + "\n".join(errors))
        with open(out) as f:
            return {kind: LinkModel(**v) for kind, v in json.load(f).items()}


# ---- counting ------------------------------------------------------------------------------
class CommCounter:
    """Counts bytes sent by this rank through torch.distributed while active (a context
    manager that wraps dist.isend / all_reduce / all_to_all_single). Bytes "sent" are what
    leaves the rank: an isend's tensor; an all-to-all's input minus this rank's own
    split; an all-reduce's 2·(n-1)/n of the tensor (ring)."""

    def __init__(self):
        self.bytes = {"all-to-all": 0.0, "all-reduce": 0.0, "p2p": 0.0}
        self.calls = dict.fromkeys(self.bytes, 0)
        self.seconds = dict.fromkeys(self.bytes, 0.0)  # isend is asynchronous: not timed
        self._saved = {}

    def reset(self):
        for k in self.bytes:
            self.bytes[k], self.calls[k], self.seconds[k] = 0.0, 0, 0.0

    def _timed(self, kind, fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[kind] += time.perf_counter() - t

    def _add(self, kind, nbytes):
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def __enter__(self):
        self._saved = {name: getattr(dist, name) for name in ("isend", "all_reduce", "all_to_all_single")}
        isend, all_reduce, all_to_all = (self._saved[n] for n in ("isend", "all_reduce", "all_to_all_single"))

        def counted_isend(tensor, *args, **kwargs):
            self._add("p2p", tensor.numel() * tensor.element_size())
            return isend(tensor, *args, **kwargs)

        def counted_all_reduce(tensor, *args, **kwargs):
            n = dist.get_world_size(kwargs.get("group"))
            self._add("all-reduce", 2 * (n - 1) / n * tensor.numel() * tensor.element_size())
            return self._timed("all-reduce", all_reduce, tensor, *args, **kwargs)

        def counted_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            size = input.element_size()
            if input_split_sizes:
                rows = input.numel() // max(input.shape[0], 1) if input.dim() else 1
                mine = input_split_sizes[me] * rows
            else:
                mine = input.numel() // n
            self._add("all-to-all", (input.numel() - mine) * size)
            return self._timed("all-to-all", all_to_all, output, input, output_split_sizes, input_split_sizes,
                               group=group, **kw)

        dist.isend, dist.all_reduce, dist.all_to_all_single = counted_isend, counted_all_reduce, counted_all_to_all
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--link-worker":
        _link_worker(sys.argv[2], int(sys.argv[3]))
    else:
        for kind, link in calibrate_links().items():
            print(f"{kind:11s} latency {link.latency_s * 1e6:8.1f} us  bandwidth {link.bytes_per_s / 1e9:6.2f} GB/s")
