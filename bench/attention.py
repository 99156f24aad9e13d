"""Benchmark chunk attention: sppo_fx's Triton kernels vs SDPA's flash / efficient kernels.

One chunk of ``--chunk`` queries attends to a prefix of ``p`` keys plus itself with the
lower-right causal mask (``torch.nn.attention.bias.causal_lower_right(c, p + c)``), for
growing prefixes.  Reports forward, backward and forward+backward TFLOP/s.

FLOPs count only the visible (query, key) pairs, ``c * p + c * (c + 1) / 2`` per head:
forward ``4 * pairs * d`` (QK^T and PV), backward 2.5x that (five matmuls).

The SDPA baselines call the aten kernels directly (``_scaled_dot_product_flash_attention``
with ``is_causal=True``, which that kernel aligns lower-right when ``c != p + c``, and
``_efficient_attention_forward`` with the lower-right mask type), because
``causal_lower_right`` dispatch ignores ``sdpa_kernel`` backend selection.

Methods on CUDA: SDPA flash (the reference: same queries and keys, one call), the flash
split (`chunk_attention/kernels/flash_split.py`: prefix and causal square as two flash calls merged by
log-sum-exp, what `prefix_causal_attention` runs), the Triton kernel, SDPA efficient.
"speed vs sdpa flash" is SDPA flash's fwd+bwd time over the method's (goal for the split:
>= 0.9x). On CPU (``--device cpu``, or no GPU) it compares the split on ATen's CPU kernels
with SDPA over a materialised mask, at small sizes: a check of the code, not of speed.

Usage::

    python bench/attention.py
    python bench/attention.py --prefixes 0,8192 --iters 5
    python bench/attention.py --device cpu --chunk 64 --prefixes 0,128 --heads 4 --head-dim 32
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=4096, help="queries per chunk (c)")
    ap.add_argument("--prefixes", default="0,4096,16384,32768,65536,131072",
                    help="comma-separated prefix lengths p")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="defaults to --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: tiny-size check of the code paths (also taken when CUDA is missing)")
    return ap.parse_args(argv)


def _time_ms(fn, warmup, iters, device="cuda"):
    """Median milliseconds of fn() over iters runs (CUDA events; a wall clock on CPU)."""
    if device == "cpu":
        import time
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main(argv=None) -> int:
    args = _parse(argv)
    on_cpu = args.device == "cpu" or not torch.cuda.is_available()
    if on_cpu and args.device != "cpu":
        print("bench/attention.py: no CUDA device; running the CPU variant (flash split on ATen's CPU "
              "kernels vs SDPA with a mask), which checks the code, not GPU speed.")
    try:
        from tabulate import tabulate
    except ImportError:  # pragma: no cover
        print("bench/attention.py needs the 'tabulate' package (pip install tabulate).")
        return 1
    from torch.nn.attention.bias import CausalVariant

    from sppo_fx.ops import chunk_attention
    from sppo_fx.chunk_attention.kernels.flash_split import flash_split_attention

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, h, d, c = args.batch, args.heads, args.head_dim, args.chunk
    h_kv = args.kv_heads or h
    scale = 1.0 / math.sqrt(d)
    prefixes = [int(x) for x in args.prefixes.split(",") if x.strip()]
    dev = torch.device("cpu" if on_cpu else "cuda")
    if on_cpu:
        dtype = torch.float32 if args.dtype == "fp16" else dtype  # CPU flash: no fp16 speed
    name = "CPU" if on_cpu else torch.cuda.get_device_name(dev)
    print(f"device: {name}  torch {torch.__version__}")
    print(f"b={b} h={h} h_kv={h_kv} d={d} chunk={c} dtype={args.dtype} "
          f"(median of {args.iters} runs after {args.warmup} warm-up)")

    def triton_fn(q, k, v):
        return chunk_attention(q, k, v, scale=scale)

    def repeat_kv(k, v):
        if h_kv == h:
            return k, v
        return k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)

    def flash_fn(q, k, v):
        k, v = repeat_kv(k, v)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]

    def efficient_fn(q, k, v):
        k, v = repeat_kv(k, v)
        lower_right = int(CausalVariant.LOWER_RIGHT)
        out = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            None, None, None, None, None, 0.0, lower_right, True, scale=scale,
        )[0]
        return out.transpose(1, 2)

    def split_fn(q, k, v):  # what prefix_causal_attention runs on CUDA: no concatenation
        p = k.shape[2] - q.shape[2]
        return flash_split_attention(q, k.narrow(2, 0, p), k.narrow(2, p, c), v.narrow(2, 0, p), v.narrow(2, p, c),
                                     scale=scale)

    def masked_fn(q, k, v):
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q.shape[2], k.shape[2])._materialize(q.device)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                enable_gqa=h_kv != h)

    # the first method is the reference of the max|diff| column; "vs flash" compares fwd+bwd
    # time with SDPA flash over the same queries and keys (full causal over prefix + chunk)
    if on_cpu:
        methods = [("sdpa (mask)", masked_fn), ("flash split", split_fn)]
    else:
        methods = [("sdpa flash", flash_fn), ("flash split", split_fn), ("chunk_attention (triton)", triton_fn),
                   ("sdpa efficient", efficient_fn)]
    rows = []
    for p in prefixes:
        n = p + c
        gen = torch.Generator(device=dev).manual_seed(p)
        q = torch.randn(b, h, c, d, device=dev, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(b, h_kv, n, d, device=dev, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(b, h_kv, n, d, device=dev, dtype=dtype, generator=gen).requires_grad_()
        do = torch.randn(b, h, c, d, device=dev, dtype=dtype, generator=gen)
        pairs = c * p + c * (c + 1) / 2
        fwd_flops = 4.0 * pairs * d * b * h
        bwd_flops = 2.5 * fwd_flops
        baseline = ref_ms = None
        for name, fn in methods:
            try:
                with torch.no_grad():
                    out_check = fn(q, k, v).float()
                if baseline is None:
                    baseline = out_check
                    diff = "0"
                else:
                    diff = f"{(out_check - baseline).abs().max().item():.2e}"
                del out_check

                def fwd():
                    return fn(q, k, v)

                out = fwd()

                def bwd():
                    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

                fwd_ms = _time_ms(fwd, args.warmup, args.iters, dev.type)
                bwd_ms = _time_ms(bwd, args.warmup, args.iters, dev.type)
                if ref_ms is None:
                    ref_ms = fwd_ms + bwd_ms
                del out
                rows.append([
                    p, name,
                    f"{fwd_ms:.3f}", f"{fwd_flops / fwd_ms / 1e9:.1f}",
                    f"{bwd_ms:.3f}", f"{bwd_flops / bwd_ms / 1e9:.1f}",
                    f"{(fwd_flops + bwd_flops) / (fwd_ms + bwd_ms) / 1e9:.1f}",
                    f"{ref_ms / (fwd_ms + bwd_ms):.2f}x", diff,
                ])
            except Exception as exc:  # keep benchmarking the other methods
                msg = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else type(exc).__name__
                rows.append([p, name, "error", "", "", "", "", "", msg])
            torch.cuda.empty_cache()
        del q, k, v, do
        torch.cuda.empty_cache()

    headers = ["prefix", "method", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s",
               "fwd+bwd TFLOP/s", f"speed vs {methods[0][0]}", f"max|out - {methods[0][0]}|"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
