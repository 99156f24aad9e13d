"""`sppo-fx bench`: a grid of pass configurations, each run in its own process.

    sppo-fx bench --model llama --size small --seq-len 2048 --chunks 0,4,8 --offload none,disk \\
                  --stages 1,2 --compile off --steps 3 --out bench/results

Every configuration (chunks × offload tier × stages × compile) runs in a fresh process, so
peak memory and compile caches do not leak between them; `chunks 0` is the eager,
unchunked model. Each reports the median step time (after one warm-up step that includes
tracing and compilation), the peak resident memory over the process's post-warm-up
baseline ("extra"), the loss and the ratio to the first configuration. Results are
printed as a table and written as JSON and CSV.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

from tabulate import tabulate


@dataclasses.dataclass
class BenchConfig:
    """One configuration of the grid.

    Attributes:
        model / size: reference model and preset.
        seq_len / batch: the sequence.
        chunks: sequence chunks (0 = eager, unchunked model).
        offload: activation tier for offloaded chunks ("disk", "host", "device") or None.
        stages: pipeline stages (ranks).
        compile: Inductor-compile the chunk programs.
        steps: timed steps after the warm-up step.
    """

    model: str = "llama"
    size: str = "tiny"
    seq_len: int = 256
    batch: int = 1
    chunks: int = 4
    offload: str | None = None
    stages: int = 1
    compile: bool = False
    steps: int = 2

    @property
    def label(self) -> str:
        if self.chunks == 0:
            return "eager"
        parts = [f"N={self.chunks}", f"P={self.stages}", f"offload={self.offload or 'none'}",
                 f"compile={'on' if self.compile else 'off'}"]
        return " ".join(parts)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_config(cfg: BenchConfig) -> dict:
    """Run one configuration in this process; returns its measurements."""
    import torch

    import sppo_fx
    from sppo_fx.models import build

    rank, world = 0, 1
    if cfg.stages > 1:
        from sppo_fx.runtime.distributed import init_from_env
        rank, world = init_from_env(300)
    torch.manual_seed(0)
    model = build(cfg.model, cfg.size)
    gen = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    x = torch.randint(0, v, (cfg.batch, cfg.seq_len), generator=gen)
    y = torch.randint(0, v, (cfg.batch, cfg.seq_len), generator=gen)
    if cfg.chunks == 0:
        def step():
            loss = model(x, y)
            loss.backward()
            return loss.detach()
    else:
        compiled = sppo_fx.compile(model, chunks=cfg.chunks, stages=cfg.stages, compile=cfg.compile,
                                   offload=cfg.offload, timeout_s=300)
        step = lambda: compiled.step(x, y)  # noqa: E731
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    loss = step()
    warmup = time.perf_counter() - t
    times = []
    model.zero_grad(set_to_none=True)
    base = _rss_bytes("VmRSS")
    exact_peak = _reset_peak_rss()
    for _ in range(cfg.steps):
        model.zero_grad(set_to_none=True)
        if cfg.stages > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    peak = _rss_bytes("VmHWM")
    out = {"rank": rank, "step_s": statistics.median(times), "warmup_s": warmup, "loss": float(loss),
           "peak_extra_bytes": max(peak - base, 0) if exact_peak else None}
    if cfg.stages > 1:
        torch.distributed.destroy_process_group()
    return out


def _run_in_process(cfg: BenchConfig, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "sppo_fx.benchgrid", "--worker", json.dumps(dataclasses.asdict(cfg))]
    if cfg.stages == 1:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode:
            return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
        return json.loads(res.stdout.strip().splitlines()[-1])
    from sppo_fx.runtime.launch import start_local_ranks
    procs = start_local_ranks(cmd, cfg.stages)
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        err = next(e for (o, e), p in zip(outs, procs) if p.returncode)
        return {"error": err.strip().splitlines()[-1] if err.strip() else "a rank failed"}
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    peaks = [r["peak_extra_bytes"] for r in results if r["peak_extra_bytes"] is not None]
    return {"step_s": max(r["step_s"] for r in results), "warmup_s": max(r["warmup_s"] for r in results),
            "loss": results[-1]["loss"], "peak_extra_bytes": max(peaks) if peaks else None}


def run_grid(configs: list[BenchConfig], out_dir: str | None = None, progress=print,
             timeout: float = 1800) -> list[dict]:
    """Run every configuration in its own process; print a table; write JSON and CSV.

    Args:
        configs: the grid.
        out_dir: where bench.json and bench.csv go (None: not written).
        progress: called with a line before and after each run.
        timeout: seconds allowed per configuration.

    Returns:
        One row per configuration (its fields and measurements).
    """
    rows = []
    for k, cfg in enumerate(configs, 1):
        progress(f"[{k}/{len(configs)}] {cfg.label} ...")
        t = time.perf_counter()
        res = _run_in_process(cfg, timeout)
        row = {**dataclasses.asdict(cfg), "label": cfg.label, **res}
        rows.append(row)
        status = res.get("error") or f"{res['step_s']:.3f} s/step"
        progress(f"[{k}/{len(configs)}] {cfg.label}: {status} ({time.perf_counter() - t:.0f} s)")
    base = next((r for r in rows if "step_s" in r), None)
    for r in rows:
        if base and "step_s" in r:
            r["time_ratio"] = r["step_s"] / base["step_s"]
            if r.get("peak_extra_bytes") and base.get("peak_extra_bytes"):
                r["memory_ratio"] = r["peak_extra_bytes"] / base["peak_extra_bytes"]
    print(format_rows(rows))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        keys = sorted({k for r in rows for k in r})
        with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The results table."""
    def mib(b):
        return "-" if b is None else f"{b / 2**20:.0f}"
    table = []
    for r in rows:
        if "error" in r:
            table.append((r["label"], "failed", "", "", "", r["error"][:60]))
            continue
        table.append((r["label"], f"{r['step_s']:.3f}", f"{r.get('time_ratio', 1):.2f}",
                      mib(r.get("peak_extra_bytes")), f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "-",
                      f"{r['loss']:.5f}"))
    return tabulate(table, headers=["configuration", "step s", "vs first", "peak extra MiB", "vs first", "loss"])


def grid(model: str, size: str, seq_len: int, batch: int, chunks: list[int], offloads: list[str | None],
         stages: list[int], compiles: list[bool], steps: int) -> list[BenchConfig]:
    """The cross product (eager appears once, without offload/stages/compile variants)."""
    out, seen = [], set()
    for n, off, p, comp in itertools.product(chunks, offloads, stages, compiles):
        cfg = BenchConfig(model, size, seq_len, batch, n, None if n == 0 else off, 1 if n == 0 else p,
                          False if n == 0 else comp, steps)
        key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", choices=["gpt", "llama"], default="llama")
    p.add_argument("--size", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunks", default="0,4", help="comma list; 0 = eager unchunked model")
    p.add_argument("--offload", default="none", help="comma list of none|disk|host|device")
    p.add_argument("--stages", default="1", help="comma list of pipeline stage counts")
    p.add_argument("--compile", default="off", help="comma list of on|off")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for bench.json and bench.csv")


def main(args: argparse.Namespace) -> int:
    def split(text):
        return [t.strip() for t in text.split(",") if t.strip()]
    configs = grid(args.model, args.size, args.seq_len, args.batch, [int(c) for c in split(args.chunks)],
                   [None if o == "none" else o for o in split(args.offload)], [int(s) for s in split(args.stages)],
                   [c == "on" for c in split(args.compile)], args.steps)
    rows = run_grid(configs, args.out, progress=lambda line: print(line, file=sys.stderr, flush=True))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(run_config(BenchConfig(**json.loads(sys.argv[2])))))
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        add_arguments(parser)
        sys.exit(main(parser.parse_args()))
