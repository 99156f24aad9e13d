"""How the first call's compile grows with the number of decoder layers: what a program of
one decoder layer, compiled once and called per layer, would save (docs/first-call-and-caches.md).

Rows, each in its own process with fresh Inductor and sppo_fx caches:
- `sppo L=n`: `sppo_fx.compile(model, chunks=4, offload="disk", recompute="cheap")` of the
  Llama preset with n layers, one step; the chunk program's compile phase and chunk 0's
  trace, by the library's own phase log;
- `torch.compile` and `torch.compile region`: torch.compile's first call of the model
  with all layers, without and with `torch.compiler.nested_compile_region` on the decoder
  block's forward (torch's own compile-once-per-layer), and the largest gradient
  difference from eager of that step (relative to each parameter's largest gradient).

    python bench/layer_compile.py --layers 1,2,4,16 --out /tmp/layer_compile.json

On the 2-core test machine the default run takes about 8 minutes (bench preset, T = 1024).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(args) -> None:
    sys.path.insert(0, ROOT)
    import torch
    from sppo_fx.models import build, llama
    torch.manual_seed(0)
    region = args.row == "torch.compile region"
    layers = args.layers_one if args.row == "sppo" else args.all_layers
    model = build("llama", args.size, n_layers=layers)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=gen) for _ in range(2))
    out = {"row": args.row, "layers": layers}
    if args.row == "sppo":
        import sppo_fx
        from sppo_fx.util.log import record_phases, summarize
        with record_phases() as phases:
            t = time.perf_counter()
            sppo_fx.compile(model, chunks=4, offload="disk", recompute="cheap",
                            offload_dir=os.environ["LAYER_COMPILE_OFFLOAD_DIR"])(x, y).backward()
            out["first_s"] = time.perf_counter() - t
        named = summarize(phases, out["first_s"])
        out["compile_s"] = sum(s for n, s in named if n.startswith("compiling chunk program"))
        out["chunk0_trace_s"] = sum(s for n, s in named if n.startswith("tracing chunk program"))
    else:
        forward = llama.Block.forward
        if region:
            llama.Block.forward = torch.compiler.nested_compile_region(forward)
        t = time.perf_counter()
        torch.compile(model)(x, y).backward()
        out["first_s"] = time.perf_counter() - t
        compiled = {n: p.grad.clone() for n, p in model.named_parameters()}
        llama.Block.forward = forward
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        out["max_rel_grad_diff"] = max(((p.grad - compiled[n]).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                                       for n, p in model.named_parameters())
    print(json.dumps(out))


def _run(args, row: str, layers: int) -> dict:
    cache = tempfile.mkdtemp(prefix="layer_compile_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               SPPO_FX_CACHE_DIR=os.path.join(cache, "sppo_fx"), LAYER_COMPILE_OFFLOAD_DIR=cache)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--row", row, "--layers-one", str(layers),
           "--all-layers", str(args.all_layers), "--size", args.size, "--seq-len", str(args.seq_len)]
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if res.returncode:
        raise SystemExit(f"{row} (layers {layers}) failed:\n{res.stderr[-2000:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(r), file=sys.stderr, flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="1,2,4,16", help="layer counts of the sppo rows")
    p.add_argument("--all-layers", type=int, default=16, help="layers of the torch.compile rows")
    p.add_argument("--size", default="bench", choices=["tiny", "small", "bench"])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", default="sppo,torch.compile,torch.compile region")
    p.add_argument("--out", default=None, help="also write the results here (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers-one", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    rows = args.rows.split(",")
    results = [_run(args, "sppo", int(n)) for n in args.layers.split(",")] if "sppo" in rows else []
    results += [_run(args, row, args.all_layers) for row in rows if row != "sppo"]
    record = {"command": " ".join(sys.argv), "load_average_1min": os.getloadavg()[0], "results": results}
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True)
    record["commit"] = commit.stdout.strip()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
