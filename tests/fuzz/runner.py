"""Run generated programs (grammar.py) in eager and through `sppo_fx.compile` and judge each.

Verdicts:
    exact     loss and every gradient within RTOL / ATOL (tests/conftest.py) at every chunking
    refused   an SppoError before any step, with no .grad left on any parameter
    wrong     a loss or gradient differs (or a refusal came after gradients were written)
    internal  any other exception from the library
    invalid   the eager program itself fails or is not finite (a generator issue, not counted
              against the library)

A program is captured once: one `sppo_fx.compile(model, compile=False)` is called with
several chunkings (its capture is cached by input shapes; only `chunk_lengths` changes).

    .venv/bin/python -m tests.fuzz.runner --count 10000 --seed 0 --jobs 1
    .venv/bin/python -m tests.fuzz.runner --program 123          # one program: source and verdict
    .venv/bin/python -m tests.fuzz.runner --count 40 --sp 2      # seq_parallel=2 on 2 gloo ranks
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import sys
import tempfile
import time
import warnings

import torch

from sppo_fx.errors import SppoError
from .grammar import Program, generate

RTOL, ATOL = 1e-4, 1e-5  # tests/conftest.py
ORDER = ("wrong", "internal", "refused", "exact", "invalid")
SEEDS_PER_MASTER = 1_000_000


def program_seed(master: int, k: int) -> int:
    return master * SEEDS_PER_MASTER + k


@dataclasses.dataclass
class Result:
    seed: int
    verdict: str
    reason: str = ""
    detail: str = ""
    tags: frozenset = frozenset()
    cases: list = dataclasses.field(default_factory=list)   # (chunk lengths or mode, verdict, reason)


def reason_class(reason: str) -> str:
    """A refusal's or failure's class: its first line with numbers and quoted names stripped."""
    first = (reason.strip().splitlines() or [""])[0]
    first = re.sub(r'(at )?File "[^"]*", line \d+, in \w+:+ ?', "", first)  # where, not what
    first = first.replace("<no source line recorded>", "")
    first = re.sub(r"'[^']*'", "'_'", first)
    return re.sub(r"\d+(\.\d+)?", "N", first)[:160]


def chunkings(prog: Program) -> list[list[int]]:
    """One-token-ish, uneven, 2 and 4 chunks of the program's sequence."""
    rng = random.Random(prog.seed + 7)
    t = prog.seq
    tiny = [1] * t if rng.random() < 0.5 else [1, 2] * (t // 3) + [1] * (t - 3 * (t // 3))
    cut = rng.randint(1, t - 1)
    half, quarter = t // 2, t // 4
    return [tiny, [cut, t - cut], [half, t - half], [quarter, quarter, quarter, t - 3 * quarter]]


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _clear(model):
    for p in model.parameters():
        p.grad = None


def compare(loss, grads, ref_loss, ref_grads) -> str:
    """'' when equal within tolerance, else what differs."""
    if loss.shape != ref_loss.shape or not torch.allclose(loss.detach().double(), ref_loss.double(), rtol=RTOL,
                                                          atol=ATOL):
        return f"loss {loss.item():.6g} != eager {ref_loss.item():.6g}"
    for name in sorted(set(grads) | set(ref_grads)):
        g, r = grads.get(name), ref_grads.get(name)
        if g is None or r is None:
            other = r if g is None else g
            if other.abs().max() == 0:
                continue
            return f"gradient of {name} {'missing' if g is None else 'unexpected'}"
        if g.shape != r.shape:
            return f"gradient of {name}: shape {tuple(g.shape)} != eager {tuple(r.shape)}"
        if not torch.allclose(g.double(), r.double(), rtol=RTOL, atol=ATOL):
            diff = (g.double() - r.double()).abs().max().item()
            return f"gradient of {name} differs by {diff:.3g} (eager max {r.abs().max().item():.3g})"
    return ""


def eager(model, inputs):
    """(loss, grads) of the unmodified model, or None when the program is invalid."""
    _clear(model)
    loss = model(*inputs)
    loss.backward()
    grads = _grads(model)
    _clear(model)
    if not torch.isfinite(loss) or any(not torch.isfinite(g).all() for g in grads.values()):
        return None
    return loss.detach(), grads


def _one_call(compiled, model, inputs, ref) -> tuple[str, str]:
    """(verdict, reason) of one compiled call."""
    _clear(model)
    stage = "forward"
    try:
        loss = compiled(*inputs)
        stage = "backward"
        loss.backward()
    except SppoError as e:
        left = [n for n, p in model.named_parameters() if p.grad is not None]
        if stage == "backward" or left:
            return "wrong", f"SppoError after a step ({stage}; gradients left on {left[:3]}): {e}"
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 - the verdict
        return "internal", f"{type(e).__name__} in {stage}: {e}"
    got = _grads(model)
    _clear(model)
    diff = compare(loss, got, *ref)
    return ("wrong", diff) if diff else ("exact", "")


def run_program(prog: Program, offload_dir: str | None = None) -> Result:
    """Judge one program: eager once, then one compile at every chunking (and, with
    `offload_dir`, once more with activations offloaded to disk)."""
    # torch.export with the fake-tensor cache off: each program is a fresh ShapeEnv and
    # nearly every op a miss, and a symbolic miss costs more than the meta function it would
    # save (capture ~30% less CPU here; the same graphs, values and stack traces on 60
    # programs). The library keeps torch's default: models that repeat layers hit the cache.
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return _run_program(prog, offload_dir)


def _run_program(prog: Program, offload_dir: str | None) -> Result:
    import sppo_fx
    res = Result(prog.seed, "exact", tags=prog.tags)
    try:
        model = prog.build()
        inputs = prog.inputs()
        ref = eager(model, inputs)
    except Exception as e:  # noqa: BLE001 - a generator issue
        res.verdict, res.reason = "invalid", f"{type(e).__name__}: {e}"
        return res
    if ref is None:
        res.verdict, res.reason = "invalid", "eager loss or gradient not finite"
        return res
    compiled = sppo_fx.compile(model, chunk_lengths=[prog.seq], compile=False)
    for lengths in chunkings(prog):
        compiled.options.chunk_lengths = lengths
        verdict, reason = _one_call(compiled, model, inputs, ref)
        res.cases.append((lengths, verdict, reason))
        if verdict == "refused" and compiled._last is None:
            break  # refused at capture or in the graph passes: every chunking would be
    if offload_dir is not None and not any(v == "refused" for _, v, _ in res.cases):
        lengths = chunkings(prog)[3]
        off = sppo_fx.compile(model, chunk_lengths=lengths, compile=False, offload="disk", offload_dir=offload_dir)
        verdict, reason = _one_call(off, model, inputs, ref)
        res.cases.append(("offload:disk", verdict, reason))
    for verdict in ORDER:
        hit = next(((k, r) for k, v, r in res.cases if v == verdict), None)
        if hit is not None:
            res.verdict, res.reason = verdict, hit[1]
            res.detail = f"chunking {hit[0]}"
            break
    return res


def replay_command(seed: int, sp: int = 1) -> str:
    if sp > 1:
        return f".venv/bin/python -m tests.fuzz.runner --program {seed} --sp {sp}"
    return (f"SPPO_PROGRAM_FUZZ_SEED={seed} .venv/bin/python -m pytest -q -n0 tests/e2e/test_program_fuzz.py"
            f"  (or: .venv/bin/python -m tests.fuzz.runner --program {seed})")


def describe(res: Result, prog: Program | None = None) -> str:
    prog = prog or generate(res.seed)
    cases = "\n".join(f"  {k}: {v} {reason_class(r) if r else ''}" for k, v, r in res.cases)
    return (f"program seed {res.seed}: {res.verdict} ({res.detail}): {res.reason}\n{cases}\n"
            f"replay: {replay_command(res.seed, 2 if 'seq_parallel' in res.detail else 1)}\n"
            f"--- source ---\n{prog.source}")


# ---- sequence parallelism: a batch of programs in one 2-rank gloo launch -----------------
def run_sp(seeds: list[int], world: int = 2, timeout: float = 600.0) -> list[Result]:
    """Run each program with `compile(..., seq_parallel=world).step` on `world` gloo ranks
    (one launch for all of them) and judge it against eager on the full batch."""
    from sppo_fx.runtime.launch import run_local_ranks
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="sppo_sp_fuzz") as out:
        cmd = [sys.executable, "-m", "tests.fuzz.runner", "--sp-worker", out, "--seeds", ",".join(map(str, seeds))]
        ranks = run_local_ranks(cmd, world, timeout, cwd=root)
        dumps = []
        for rank, (rc, _o, err, *_) in enumerate(ranks):
            path = os.path.join(out, f"rank{rank}.pt")
            if rc != 0 or not os.path.exists(path):
                return [Result(s, "internal", f"rank {rank} exited {rc}: {err[-2000:]}") for s in seeds]
            dumps.append(torch.load(path))
    results = []
    for seed in seeds:
        prog = generate(seed)
        res = Result(seed, "exact", tags=prog.tags)
        model = prog.build()
        ref = eager(model, prog.inputs())
        outs = [d[seed] for d in dumps]
        if ref is None:
            res.verdict, res.reason = "invalid", "eager loss or gradient not finite"
        elif any(o[0] == "internal" for o in outs):
            res.verdict, res.reason = "internal", next(o[1] for o in outs if o[0] == "internal")
        elif all(o[0] == "refused" for o in outs):
            res.verdict, res.reason = "refused", outs[0][1]
        elif any(o[0] == "refused" for o in outs):
            res.verdict, res.reason = "internal", "ranks disagree: " + "; ".join(o[1][:200] for o in outs)
        else:
            for rank, (_, loss, grads) in enumerate(outs):
                diff = compare(loss, grads, *ref)
                if diff:
                    res.verdict, res.reason = "wrong", f"rank {rank}: {diff}"
                    break
        res.detail = f"seq_parallel={world}"
        res.cases.append((f"seq_parallel={world}", res.verdict, res.reason))
        results.append(res)
    return results


def sp_chunks(prog: Program, world: int) -> int:
    return max(1, min(2, prog.seq // (2 * world)))


def sp_worker(out: str, seeds: list[int]) -> int:
    """One rank of `run_sp`."""
    import sppo_fx
    from sppo_fx.runtime.distributed import init_from_env
    rank, world = init_from_env(120.0)
    torch.set_num_threads(1)
    results = {}
    for seed in seeds:
        prog = generate(seed)
        model = prog.build()
        inputs = prog.inputs()
        compiled = sppo_fx.compile(model, chunks=sp_chunks(prog, world), seq_parallel=world, compile=False,
                                   timeout_s=30.0)
        try:
            loss = compiled.step(*inputs)
            results[seed] = ("ok", loss.detach(), _grads(model))
        except SppoError as e:
            left = [n for n, p in model.named_parameters() if p.grad is not None]
            results[seed] = ("internal", f"SppoError after gradients were written: {e}") if left else ("refused", str(e))
        except Exception as e:  # noqa: BLE001 - the verdict
            results[seed] = ("internal", f"{type(e).__name__}: {e}")
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()
    return 0


# ---- command line ----------------------------------------------------------------------
def _init_worker():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def _run_seed(args) -> Result:
    seed, offload_dir = args
    try:
        return run_program(generate(seed), offload_dir)
    except Exception as e:  # noqa: BLE001 - the runner itself must not stop a long run
        return Result(seed, "internal", f"runner: {type(e).__name__}: {e}")


def summarize(results: list[Result]) -> str:
    counts = collections.Counter(r.verdict for r in results)
    lines = ["verdicts: " + ", ".join(f"{v} {counts[v]}" for v in ORDER)]
    for verdict in ("refused", "wrong", "internal", "invalid"):
        groups = collections.defaultdict(list)
        for r in results:
            if r.verdict == verdict:
                groups[reason_class(r.reason)].append(r.seed)
        if groups:
            lines.append(f"{verdict} by reason:")
            for reason, seeds in sorted(groups.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"  {len(seeds):6d}  {reason}   seeds {seeds[:4]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="master seed: programs MASTER*1e6 + k")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--program", type=int, default=None, help="run one program seed, print its source and verdict")
    ap.add_argument("--offload-every", type=int, default=50, help="every k-th program also runs offloading to disk")
    ap.add_argument("--sp", type=int, default=0, help="run the seq_parallel-capable programs on this many ranks")
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--sp-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    _init_worker()
    if a.sp_worker:
        return sp_worker(a.sp_worker, [int(s) for s in a.seeds.split(",") if s])
    if a.program is not None and a.sp:
        res = run_sp([a.program], a.sp)[0]
        print(describe(res))
        return 0 if res.verdict in ("exact", "refused", "invalid") else 1
    if a.program is not None:
        prog = generate(a.program)
        res = run_program(prog, tempfile.gettempdir())
        print(describe(res, prog))
        return 0 if res.verdict in ("exact", "refused", "invalid") else 1
    start = time.time()
    seeds = [program_seed(a.seed, k) for k in range(a.count)]
    results: list[Result] = []

    def progress(final=False):
        head = f"{len(results)} programs (master seed {a.seed}) in {time.time() - start:.0f} s"
        print(("" if final else "[progress] ") + head + "\n" + summarize(results), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump([dataclasses.asdict(r) | {"tags": sorted(r.tags)} for r in results], f, default=str)
    if a.sp:
        chosen = [s for s in seeds if "seq_parallel_ok" in generate(s).tags]
        results = run_sp(chosen, a.sp)
    else:
        with tempfile.TemporaryDirectory(prefix="sppo_fuzz") as tmp:
            work = [(s, tmp if a.offload_every and k % a.offload_every == a.offload_every - 1 else None)
                    for k, s in enumerate(seeds)]
            if a.jobs > 1:
                import multiprocessing as mp
                with mp.get_context("fork").Pool(a.jobs, initializer=_init_worker) as pool:
                    for r in pool.imap_unordered(_run_seed, work, chunksize=4):
                        results.append(r)
                        if len(results) % 50 == 0:
                            progress()
            else:
                for w in work:
                    results.append(_run_seed(w))
                    if len(results) % 50 == 0:
                        progress()
    progress(final=True)
    bad = [r for r in results if r.verdict in ("wrong", "internal")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
