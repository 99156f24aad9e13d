"""Train a reference model with sppo_fx's sequence pipeline on torch.distributed.

Single node, 2 stages (gloo on CPU; NCCL on GPU, each rank on cuda:LOCAL_RANK):
    torchrun --nproc-per-node 2 examples/train_pipeline.py --model llama --chunks 4 --microbatches 2

Multi-node (run on every node, same --master-addr):
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 4 --master-addr $HOST --master-port 29500 \\
        examples/train_pipeline.py --chunks 8

Sequence and data parallelism (world = stages x data-parallel x seq-parallel):
    torchrun --nproc-per-node 4 examples/train_pipeline.py --seq-parallel 2 --data-parallel 2
    torchrun --nproc-per-node 4 examples/train_pipeline.py --plan plan.json   # sppo-fx plan ... --json

The number of stages is the world size divided by data-parallel x seq-parallel.
`--dump DIR` writes each rank's loss and gradients (used by the tests), and
`--fail-rank R --fail-at backward|forward` makes rank R die mid-step (fault-injection for
the tests: the other ranks must raise SppoError within --timeout seconds).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import sppo_fx
from sppo_fx.models import build
from sppo_fx.runtime.distributed import init_from_env, rank_device


def _inject_failure(at: str, how: str):
    """Make this rank fail in StageRunner.forward (at chunk 1) or .backward (its first):
    exit (os._exit(17)), kill (SIGKILL), raise (RuntimeError) or hang (SIGSTOP). The fault's
    wall-clock time goes to stderr as `fault at <time.time()>`."""
    from sppo_fx.runtime import local

    original = getattr(local.StageRunner, at)

    def fail(self, *args, **kwargs):
        if at == "forward" and args[1] == 0:  # let chunk 0 through, fail at chunk 1
            return original(self, *args, **kwargs)
        sys.stderr.write(f"[fault injection] rank {how}s in {at}: fault at {time.time():.3f}\n")
        sys.stderr.flush()
        if how == "exit":
            os._exit(17)
        if how == "raise":
            raise RuntimeError(f"injected fault in {at}")
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        return original(self, *args, **kwargs)  # after SIGCONT

    setattr(local.StageRunner, at, fail)


def parse_args(argv=None) -> argparse.Namespace:
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
    p.add_argument("--fail-how", choices=["exit", "kill", "raise", "hang"], default="exit")
    p.add_argument("--width", type=int, default=None, help="hidden size (n_embd / dim; llama ffn_dim = 2x)")
    p.add_argument("--plan-seed", type=int, default=None, help="(test) perturb this rank's chunking")
    p.add_argument("--seq-parallel", type=int, default=None, help="sequence-parallel ranks per stage (default 1)")
    p.add_argument("--data-parallel", type=int, default=None, help="data-parallel replicas (default 1)")
    p.add_argument("--device-mesh", action="store_true",
                   help="pass the layout as a torch DeviceMesh with dims ('pp', 'dp', 'sp') (mesh=)")
    p.add_argument("--plan", default=None, help="a saved plan (sppo-fx plan ... --json): its layout and chunks")
    p.add_argument("--kv-heads", type=int, default=None, help="(llama) K/V heads (grouped-query attention)")
    p.add_argument("--ignore-every", type=int, default=0,
                   help="(test) set every k-th target to the model's ignore_index")
    return p.parse_args(argv)


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    """Build the model and data, run the steps, write --dump: one run on an initialised
    process group of `world` ranks (the tests run several on one group)."""
    torch.manual_seed(args.seed)
    layer_key = "n_layer" if args.model == "gpt" else "n_layers"
    overrides = {layer_key: args.layers}
    if args.width:
        overrides.update({"n_embd": args.width} if args.model == "gpt" else {"dim": args.width, "ffn_dim": 2 * args.width})
    if args.kv_heads:
        overrides["n_kv_heads"] = args.kv_heads
    model = build(args.model, args.size, **overrides)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    if args.ignore_every:
        y.view(-1)[::args.ignore_every] = -1 if args.model == "gpt" else -100  # the models' ignore_index
    device = rank_device()  # cuda:LOCAL_RANK with CUDA (NCCL), else the CPU (gloo)
    model, x, y = model.to(device), x.to(device), y.to(device)
    layout = {}
    if args.plan:
        from sppo_fx.plan import load_layout_plan
        layout, plan = load_layout_plan(args.plan)
        if layout["pp"] * layout["dp"] * layout["sp"] != world:
            raise SystemExit(f"the plan's layout {layout} needs {layout['pp'] * layout['dp'] * layout['sp']} ranks, "
                             f"not {world}")
    sp, dp = args.seq_parallel or layout.get("sp", 1), args.data_parallel or layout.get("dp", 1)
    if world % (sp * dp):
        raise SystemExit(f"world size {world} does not divide into data-parallel {dp} x seq-parallel {sp}")
    lengths = [int(c) for c in args.chunk_lengths.split(",")] if args.chunk_lengths else None
    if args.plan_seed is not None and rank == world - 1:
        lengths = [args.seq_len - 1, 1]
    chunks = None if lengths or args.chunks == "auto" or args.plan else int(args.chunks)
    layout = dict(stages=world // (sp * dp), seq_parallel=sp, data_parallel=dp)
    if args.device_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        layout = dict(mesh=init_device_mesh(device.type, (world // (sp * dp), dp, sp), mesh_dim_names=("pp", "dp", "sp")))
    compiled = sppo_fx.compile(model, chunks=chunks, chunk_lengths=lengths, microbatches=args.microbatches,
                               schedule=args.schedule, compile=args.compile, timeout_s=args.timeout,
                               offload=args.offload, budget=args.budget, plan=plan if args.plan else None, **layout)
    if args.fail_rank == rank:
        _inject_failure(args.fail_at, args.fail_how)
    for step in range(args.steps):
        try:
            loss = compiled.step(x, y)
        except sppo_fx.SppoError:
            sys.stderr.write(f"SppoError raised at {time.time():.3f}\n")
            raise
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
        grads = {n: prm.grad.cpu() for n, prm in model.named_parameters() if prm.grad is not None}
        torch.save({"loss": loss, "grads": grads, "blocks": [s.blocks for s in compiled.pipeline.stages],
                    "chunk_lengths": compiled.plan.chunk_lengths, "offload_ratios": compiled.plan.offload_ratios,
                    "store": compiled.store.stats() if compiled.store is not None else None,
                    "chunk_ops": sorted({str(n.target) for n in compiled.graphs["chunk"].graph.nodes
                                         if n.op == "call_function"})},
                   os.path.join(args.dump, f"rank{rank}.pt"))


def main(argv=None) -> int:
    args = parse_args(argv)
    # the process group's own timeout covers start-up (every rank traces and compiles, at its
    # own pace); a step's waits for peers use --timeout (compile's timeout_s)
    rank, world = init_from_env(max(args.timeout, 120.0))
    train(args, rank, world)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
