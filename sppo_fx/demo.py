"""The demo: train the Llama-style model on long byte-level sequences through sppo_fx.

The corpus is the Python standard library's own source files (present on every machine
with Python). Each step draws `batch` windows of `seq_len + 1` bytes; tokens are bytes.
The first step's gradients are checked against the eager, unchunked model.
"""
from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import torch
from tabulate import tabulate

import sppo_fx
from sppo_fx.models import build


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted, concatenated) as a uint8 tensor."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python source files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def sample_batch(corpus: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """(tokens, next-byte targets), each [batch, seq_len] int64."""
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def run(steps: int, seq_len: int, chunks: int, batch: int, size: str, lr: float, seed: int,
        compile: bool = True) -> dict:  # noqa: A002
    """Train and report; returns the figures it printed (for tests)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    corpus = stdlib_corpus()
    model = build("llama", size, vocab_size=256)
    n_params = sum(p.numel() for p in model.parameters())
    compiled = sppo_fx.compile(model, chunks=chunks, compile=compile)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    print(f"sppo_fx demo: Llama-style '{size}' model, {n_params / 1e6:.1f}M parameters; "
          f"{corpus.numel() / 1e6:.1f} MB of standard-library source; batch {batch} x {seq_len} bytes, "
          f"{chunks} chunks, chunk programs {'compiled by Inductor (the first step includes compilation)' if compile else 'run eagerly'}")
    report = {"losses": []}
    for step in range(steps):
        x, y = sample_batch(corpus, batch, seq_len, gen)
        t0 = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        elapsed = time.perf_counter() - t0
        if step == 0:
            print("\nChunk plan:")
            print(compiled.plan.table())
            report["grad_check"] = _check_grads(model, x, y, loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        report["losses"].append(loss.item())
        if step == 0:
            print(f"\n{'step':>4}  {'loss':>8}  {'s/step':>7}")
        print(f"{step:4d}  {loss.item():8.4f}  {elapsed:7.2f}")
    return report


def _check_grads(model, x, y, loss):
    chunked = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(x, y)
    ref.backward()
    rows, worst = [], 0.0
    ok = torch.allclose(loss, ref.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        diff = (chunked[name] - p.grad).abs().max().item()
        scale = p.grad.abs().max().item()
        match = torch.allclose(chunked[name], p.grad, rtol=1e-4, atol=1e-5)
        ok &= match
        worst = max(worst, diff)
        rows.append((name, f"{diff:.2e}", f"{scale:.2e}", "ok" if match else "MISMATCH"))
    for name, p in model.named_parameters():  # leave the chunked gradients for the optimizer
        p.grad = chunked[name]
    print(f"\nFirst step vs eager (full sequence): loss {loss.item():.6f} vs {ref.item():.6f}")
    shown = rows[:4] + ([("...", "", "", "")] if len(rows) > 6 else []) + rows[-2:]
    print(tabulate(shown, headers=["parameter", "max |diff|", "max |grad|", "rtol 1e-4, atol 1e-5"]))
    print(f"gradients of all {len(rows)} parameters match eager: {'yes' if ok else 'NO'} "
          f"(largest difference {worst:.2e})")
    if not ok:
        raise SystemExit("gradient check against eager failed")
    return {"ok": ok, "max_abs_diff": worst}


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=4096, help="bytes per sequence")
    parser.add_argument("--chunks", type=int, default=8, help="sequence chunks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "bench"], help="model preset")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="run the chunk programs op by op instead of compiling them with Inductor")


def main(args: argparse.Namespace) -> int:
    run(args.steps, args.seq_len, args.chunks, args.batch, args.size, args.lr, args.seed, args.compile)
    return 0
