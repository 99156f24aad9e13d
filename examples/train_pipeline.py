"""Train a reference model with sppo_fx's sequence pipeline on torch.distributed.

Single node, 2 stages (gloo on CPU, NCCL on GPU):
    torchrun --nproc-per-node 2 examples/train_pipeline.py --model llama --chunks 4 --microbatches 2

Multi-node (run on every node, same --master-addr):
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 4 --master-addr $HOST --master-port 29500 \\
        examples/train_pipeline.py --chunks 8

One pipeline stage runs on each rank; the number of stages is the world size.
`--dump DIR` writes each rank's loss and gradients (used by the tests), and
`--fail-rank R --fail-at backward|forward` makes rank R die mid-step (fault-injection for
the tests: the other ranks must raise SppoError within --timeout seconds).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import sppo_fx
from sppo_fx.models import build
from sppo_fx.runtime.distributed import init_from_env


def _inject_failure(at: str):
    from sppo_fx.runtime import local

    original = getattr(local.StageRunner, at)

    def die(self, *args, **kwargs):
        if at == "forward" and args[1] == 0:  # let chunk 0 through, die at chunk 1
            return original(self, *args, **kwargs)
        sys.stderr.write(f"[fault injection] rank dies in {at}\n")
        sys.stderr.flush()
        os._exit(17)

    setattr(local.StageRunner, at, die)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt", "llama"], default="llama")
    p.add_argument("--size", default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunks", default="4", help="chunk count, or 'auto' for the pipeline solver's choice")
    p.add_argument("--chunk-lengths", type=str, default=None, help="comma-separated, overrides --chunks")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.0, help="SGD learning rate (0: no update)")
    p.add_argument("--compile", action="store_true", help="compile chunk programs with Inductor")
    p.add_argument("--offload", choices=["disk", "host", "device"], default=None,
                   help="offload every chunk's saved activations but the last's to this tier")
    p.add_argument("--budget", default=None, help="per-rank memory budget (e.g. 64MiB): each rank plans its offload")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", default=None)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-at", choices=["forward", "backward"], default="backward")
    p.add_argument("--plan-seed", type=int, default=None, help="(test) perturb this rank's chunking")
    args = p.parse_args(argv)

    rank, world = init_from_env(args.timeout)
    torch.manual_seed(args.seed)
    layer_key = "n_layer" if args.model == "gpt" else "n_layers"
    model = build(args.model, args.size, **{layer_key: args.layers})
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    lengths = [int(c) for c in args.chunk_lengths.split(",")] if args.chunk_lengths else None
    if args.plan_seed is not None and rank == world - 1:
        lengths = [args.seq_len - 1, 1]
    chunks = None if lengths or args.chunks == "auto" else int(args.chunks)
    compiled = sppo_fx.compile(model, chunks=chunks, chunk_lengths=lengths,
                               stages=world, microbatches=args.microbatches, schedule=args.schedule,
                               compile=args.compile, timeout_s=args.timeout, offload=args.offload,
                               budget=args.budget)
    if args.fail_rank == rank:
        _inject_failure(args.fail_at)
    for step in range(args.steps):
        loss = compiled.step(x, y)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        if args.lr:
            with torch.no_grad():
                for prm in model.parameters():
                    if prm.grad is not None:
                        prm -= args.lr * prm.grad
                        prm.grad = None
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        grads = {n: prm.grad for n, prm in model.named_parameters() if prm.grad is not None}
        torch.save({"loss": loss, "grads": grads, "blocks": [s.blocks for s in compiled.pipeline.stages],
                    "chunk_lengths": compiled.plan.chunk_lengths, "offload_ratios": compiled.plan.offload_ratios},
                   os.path.join(args.dump, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
