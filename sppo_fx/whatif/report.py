"""Tables of a what-if report."""
from __future__ import annotations

from tabulate import tabulate

from sppo_fx.whatif.results import GiB, WhatIfReport


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def format_report(report: WhatIfReport) -> str:
    """Human-readable tables of a WhatIfReport."""
    m, b = report.model, report.best
    lines = [
        f"SPPO what-if plan — MODEL PREDICTIONS (analytic costs + schedule simulation), not measurements",
        f"model {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, vocab {m.vocab}, "
        f"{m.params / 1e9:.2f}B params; sequence {report.seq_len:,} tokens; {report.gpus} x "
        f"{report.profile.name} ({report.profile.flops_per_s / 1e12:.0f} TFLOP/s achievable, "
        f"D2H {report.profile.d2h_bytes_per_s / 1e9:.0f} GB/s, {_gib(report.profile.memory_bytes)} GiB)",
        "",
    ]
    rows = [("pipeline stages P", b.stages),
            ("sequence-parallel width D (Ulysses)", b.seq_parallel),
            ("chunks N", f"{b.chunks}" + (" (multiplexed: first/last cut P ways)" if b.multiplexed else "")),
            ("tokens per GPU per chunk", f"{min(b.chunk_lengths) / b.seq_parallel:,.0f} .. "
                                         f"{max(b.chunk_lengths) / b.seq_parallel:,.0f}"),
            ("offload tier", b.tier),
            ("offload ratio, stage 0, chunks 0/mid/last",
             " / ".join(f"{b.offload_ratios[0][k]:.2f}" for k in (0, len(b.offload_ratios[0]) // 2, -1))),
            ("step time", f"{b.step_seconds:.3f} s (pipeline {b.pipeline_seconds:.3f} s)"),
            ("bubble fraction", f"{b.bubble_fraction:.1%}"),
            ("prefetch stall (worst stage)", f"{b.stall_seconds:.3f} s"),
            ("tokens / GPU / s", f"{b.tokens_per_gpu_per_s:,.1f}"),
            ("peak device memory / GPU", f"{_gib(b.peak_bytes_per_gpu)} GiB of "
                                         f"{_gib(report.profile.memory_bytes)} GiB"),
            ("peak host memory / GPU", f"{_gib(b.peak_host_bytes_per_gpu)} GiB")]
    lines.append("Chosen SPPO plan (adaptive sequence-aware offload)")
    lines.append(tabulate(rows, tablefmt="simple"))
    lines.append("")
    comp = []
    for name, r in [("sppo (adaptive offload)", b)] + list(report.baselines.items()):
        sp = (b.tokens_per_gpu_per_s / r.tokens_per_gpu_per_s) if r.feasible and r.tokens_per_gpu_per_s else None
        comp.append((name, "yes" if r.feasible else "NO", r.stages or "-", r.seq_parallel or "-",
                     r.chunks or "-", f"{r.tokens_per_gpu_per_s:,.1f}" if r.feasible else "-",
                     f"{r.step_seconds:.3f}" if r.feasible else "-",
                     f"{r.bubble_fraction:.1%}" if r.feasible else "-",
                     _gib(r.peak_bytes_per_gpu), f"{sp:.2f}x" if sp else "-"))
    lines.append("Policies compared (each with its own best P, N)")
    lines.append(tabulate(comp, headers=["policy", "fits", "P", "D", "N", "tokens/GPU/s", "step s",
                                         "bubble", "peak GiB", "SPPO speedup"]))
    lines.append("")
    lines.append(f"Assumptions: one sequence per step; GPUs = P x D with D-way Ulysses sequence "
                 f"parallelism inside a stage; bf16 activations 34·h bytes/token/layer (K+V 4·h); "
                 f"optimizer states {'sharded over D (ZeRO-1)' if report.shard_optimizer else 'not sharded (16 B/param)'}; "
                 f"{_gib(report.cluster.reserve_bytes)} GiB device reserve; host memory "
                 f"{_gib(report.cluster.host_memory_bytes)} GiB/GPU. See sppo_fx/whatif/.")
    lines.append(f"Searched {report.candidates} simulated configurations in {report.search_seconds:.2f} s.")
    return "\n".join(lines)
