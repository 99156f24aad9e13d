"""Bad inputs are refused: each case raises SppoError whose message names what to change,
before any gradient exists (every parameter's .grad stays None) and without leaving files
in offload_dir. More refusals with op and source line are in tests/api/test_errors.py
(non-causal attention, masks, cumsum, flip, ...); some are repeated here for the table."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sppo_fx
from sppo_fx import SppoError
from sppo_fx.models import build

from test_errors import TinyLM


def tokens(t=12, b=2, vocab=97):
    return torch.randint(0, vocab, (b, t)), torch.randint(0, vocab, (b, t))


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(97, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 97)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.drop(self.emb(x))).flatten(0, 1), y.flatten())


class PerTokenLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(97, 16)
        self.out = nn.Linear(16, 97)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten(), reduction="none")


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(97, 4)

    def forward(self, x):
        return {"logits": self.emb(x)}


class FakeWorld:
    """A process group of `world` ranks that never communicates (torch's "fake" backend),
    so that pipeline set-up errors can be tried in one process."""

    def __init__(self, world):
        self.world = world

    def __enter__(self):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def _gpt(**kw):
    return build("gpt", "tiny", **kw)


# (id, model factory, call(model, offload_dir) that must raise, fragments of the message)
CASES = [
    ("budget-malformed", _gpt, lambda m, d: sppo_fx.compile(m, budget="lots", offload_dir=d),
     ["budget", "'24GiB'"]),
    ("budget-negative", _gpt, lambda m, d: sppo_fx.compile(m, budget="-1GiB", offload_dir=d), ["budget"]),
    ("budget-with-chunks", _gpt, lambda m, d: sppo_fx.compile(m, budget="1GiB", chunks=2, offload_dir=d),
     ["either budget=", "chunks="]),
    ("budget-below-minimum", _gpt, lambda m, d: sppo_fx.compile(m, budget=1000, compile=False, offload_dir=d)(
        *tokens(64)), ["minimum", "MiB"]),
    ("chunk-lengths-sum", _gpt, lambda m, d: sppo_fx.compile(m, chunk_lengths=[4, 4], offload="disk",
                                                            offload_dir=d)(*tokens(10)), ["sum to 10"]),
    ("chunk-lengths-zero", _gpt, lambda m, d: sppo_fx.compile(m, chunk_lengths=[12, 0], offload="disk",
                                                             offload_dir=d)(*tokens(12)), ["chunk_lengths", "0"]),
    ("chunk-lengths-negative", _gpt, lambda m, d: sppo_fx.compile(m, chunk_lengths=[14, -2], offload="disk",
                                                                 offload_dir=d)(*tokens(12)), ["chunk_lengths"]),
    ("chunks-and-lengths-disagree", _gpt, lambda m, d: sppo_fx.compile(m, chunks=3, chunk_lengths=[6, 6])(
        *tokens(12)), ["chunks=3", "chunk_lengths"]),
    ("chunks-above-tokens", _gpt, lambda m, d: sppo_fx.compile(m, chunks=7, offload="disk", offload_dir=d)(
        *tokens(5)), ["use chunks <= 5"]),
    ("chunks-zero", _gpt, lambda m, d: sppo_fx.compile(m, chunks=0), ["chunks"]),
    ("seq-dim-out-of-range", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, seq_dim=2)(*tokens(12)),
     ["seq_dim"]),
    ("seq-dim-batch", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, seq_dim=0)(*tokens(12, b=4)),
     ["seq_dim"]),
    ("inputs-disagree-on-length", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2)(tokens(12)[0], tokens(10)[0]),
     ["disagree on the sequence length", "[12, 10]"]),
    ("output-without-loss", lambda: Logits(), lambda m, d: sppo_fx.compile(m, chunks=2)(
        torch.zeros(1, 6, dtype=torch.long)), ["loss_fn"]),
    ("non-scalar-loss", lambda: PerTokenLoss(), lambda m, d: sppo_fx.compile(m, chunks=2)(*tokens(12)),
     ["scalar loss"]),
    ("inputs-on-two-devices", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2)(
        tokens(12)[0], tokens(12)[1].to("meta")), ["several devices", "cpu", "meta", "one device"]),
    ("unknown-schedule", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, schedule="zigzag"),
     ["schedule='zigzag'", "1f1b", "gpipe"]),
    ("unknown-tier", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, offload="tape", offload_dir=d),
     ["offload='tape'", "disk"]),
    ("unknown-recompute", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, recompute="some"),
     ["recompute='some'", "cheap"]),
    ("unknown-skeleton", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, skeleton="cloud"), ["skeleton="]),
    ("skeleton-offload-without-tier", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, skeleton="offload"),
     ["offload='disk'"]),
    ("unknown-partition", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, partition="random")(*tokens(12)),
     ["partition='random'", "balanced"]),
    ("offload-dir-missing", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, offload="disk",
                                                              offload_dir=os.path.join(d, "no", "such")),
     ["offload_dir", "does not exist"]),
    ("microbatches-zero", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, microbatches=0), ["microbatches"]),
    ("microbatches-do-not-divide-batch", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, microbatches=3).step(
        *tokens(12, b=4)), ["divisible by 3"]),
    ("timeout-not-positive", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, timeout_s=0), ["timeout_s"]),
    ("stages-zero", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, stages=0), ["stages"]),
    ("stages-without-distributed", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, stages=2).step(*tokens(12)),
     ["torchrun --nproc-per-node 2"]),
    ("pipeline-called-not-stepped", _gpt, lambda m, d: sppo_fx.compile(m, chunks=2, stages=2)(*tokens(12)),
     ["compiled.step"]),
    ("non-causal-attention", lambda: TinyLM("noncausal"), lambda m, d: sppo_fx.compile(m, chunks=2)(
        *tokens(12, vocab=50)), ["is_causal=True"]),
    ("dense-mask", lambda: TinyLM("dense_mask"), lambda m, d: sppo_fx.compile(m, chunks=2)(*tokens(12, vocab=50)),
     ["not the causal mask"]),
    ("cumsum-over-time", lambda: TinyLM("cumsum"), lambda m, d: sppo_fx.compile(m, chunks=2)(*tokens(12, vocab=50)),
     ["aten.cumsum", "h = h.cumsum(dim=1)"]),
    ("dropout-in-training", lambda: Dropout(), lambda m, d: sppo_fx.compile(m, chunks=2)(*tokens(12)),
     ["dropout", "eval()"]),
    ("not-a-module", lambda: None, lambda m, d: sppo_fx.compile(42), ["nn.Module or a function"]),
    ("decorated-without-model", lambda: None, lambda m, d: sppo_fx.compile(chunks=2)(lambda mm, x: mm(x, x))(
        tokens(4)[0]), ["first argument must be the nn.Module"]),
]


def _pipeline_cases():
    """Set-up errors of a pipeline, tried in a fake process group of `world` ranks."""
    return [
        ("world-does-not-match-stages", 3, lambda m, d: sppo_fx.compile(m, chunks=2, stages=2).step(*tokens(12)),
         ["stages=2", "3 ranks", "--nproc-per-node 2"]),
        ("stages-above-pieces", 5, lambda m, d: sppo_fx.compile(m, chunks=2, stages=5).step(*tokens(12)),
         ["stages=5", "use stages <= 4"]),
        ("split-point-not-a-module", 2, lambda m, d: sppo_fx.compile(m, chunks=2, stages=2,
                                                                     split_points=["h.7"]).step(*tokens(12)),
         ["h.7"]),
    ]


def _assert_refused(model, call, fragments, tmp_path):
    with pytest.raises(SppoError) as err:
        call(model, str(tmp_path))
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in the message: {msg}"
    if model is not None:
        assert all(p.grad is None for p in model.parameters()), "gradients exist after the refusal"
    left = [os.path.relpath(os.path.join(r, f), tmp_path) for r, ds, fs in os.walk(tmp_path) for f in fs + ds]
    assert not left, f"left in offload_dir: {left}"
    return msg


@pytest.mark.parametrize("make,call,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_gradient(tmp_path, make, call, fragments):
    torch.manual_seed(0)
    _assert_refused(make(), call, fragments, tmp_path)


@pytest.mark.parametrize("world,call,fragments", [c[1:] for c in _pipeline_cases()],
                         ids=[c[0] for c in _pipeline_cases()])
def test_bad_pipeline_layout_is_refused_before_any_gradient(tmp_path, world, call, fragments):
    with FakeWorld(world):
        _assert_refused(_gpt(), call, fragments, tmp_path)


def test_at_least_twenty_kinds():
    assert len(CASES) + len(_pipeline_cases()) >= 20


# ---------------------------------------------------------------- issue 31: refused by name, before any step

def _plan_json(**fields):
    import json
    return json.dumps({"seq_len": 4, "chunk_lengths": [2, 2], **fields})


# (id, call(model, offload_dir) that must raise, fragments of the message)
ARGUMENT_CASES = [
    # the table
    ("budget-nan", lambda m, d: sppo_fx.compile(m, budget=float("nan")), ["budget=nan", "not a finite size"]),
    ("budget-inf", lambda m, d: sppo_fx.compile(m, budget=float("inf")), ["budget=inf", "not a finite size"]),
    ("budget-1e400", lambda m, d: sppo_fx.compile(m, budget="1e400"), ["budget='1e400'", "not a finite size"]),
    ("budget-below-one-byte", lambda m, d: sppo_fx.compile(m, budget=0.5), ["budget=0.5", "did you mean a fraction"]),
    ("offload-dir-not-writable", lambda m, d: sppo_fx.compile(m, chunks=2, offload="disk", offload_dir="/proc"),
     ["offload_dir='/proc'", "not writable"]),
    ("seq-dim-float", lambda m, d: sppo_fx.compile(m, chunks=2, seq_dim=1.0), ["seq_dim=1.0", "integer"]),
    ("seq-dim-negative", lambda m, d: sppo_fx.compile(m, chunks=2, seq_dim=-1), ["seq_dim=-1", ">= 0"]),
    ("one-token", lambda m, d: sppo_fx.compile(m, compile=False)(*tokens(1)), ["too short", "1 token(s)"]),
    # more arguments
    ("timeout-inf", lambda m, d: sppo_fx.compile(m, chunks=2, timeout_s=float("inf")), ["timeout_s=inf", "finite"]),
    ("timeout-nan", lambda m, d: sppo_fx.compile(m, chunks=2, timeout_s=float("nan")), ["timeout_s=nan", "finite"]),
    ("budget-list", lambda m, d: sppo_fx.compile(m, budget=[1]), ["budget=[1]", "'24GiB'"]),
    ("budget-percent", lambda m, d: sppo_fx.compile(m, budget="50%"), ["budget='50%'", "sppo-fx bench"]),
    ("budget-bool", lambda m, d: sppo_fx.compile(m, budget=True), ["budget=True"]),
    ("budget-larger-than-any-machine", lambda m, d: sppo_fx.compile(m, budget=10**30), ["more than any machine"]),
    ("budget-empty-string", lambda m, d: sppo_fx.compile(m, budget=""), ["budget=''", "cannot be read"]),
    ("loss-fn-not-callable", lambda m, d: sppo_fx.compile(m, chunks=2, loss_fn="cross_entropy"),
     ["loss_fn='cross_entropy'", "not callable"]),
    ("compile-a-string", lambda m, d: sppo_fx.compile(m, chunks=2, compile="no"), ["compile='no'", "True"]),
    ("log-passes-a-string", lambda m, d: sppo_fx.compile(m, chunks=2, log_passes="no"), ["log_passes='no'"]),
    ("split-points-a-string", lambda m, d: sppo_fx.compile(m, chunks=2, split_points="h.1"),
     ["split_points='h.1'", "list of module names"]),
    ("partition-none", lambda m, d: sppo_fx.compile(m, chunks=2, partition=None), ["partition=None", "balanced"]),
    ("mesh-not-a-device-mesh", lambda m, d: sppo_fx.compile(m, chunks=2, mesh="pp"), ["mesh='pp'", "DeviceMesh"]),
    ("seq-dim-string", lambda m, d: sppo_fx.compile(m, chunks=2, seq_dim="1"), ["seq_dim='1'", "integer"]),
    ("offload-dir-a-file", lambda m, d: sppo_fx.compile(m, chunks=2, offload="disk", offload_dir=__file__),
     ["offload_dir=", "not a directory"]),
    # plan JSON
    ("plan-not-json", lambda m, d: sppo_fx.compile(m, plan='{"seq_len": 4'), ["plan=", "not valid JSON"]),
    ("plan-seq-len-a-string", lambda m, d: sppo_fx.compile(m, plan=_plan_json(seq_len="4")), ["seq_len='4'"]),
    ("plan-seq-len-zero", lambda m, d: sppo_fx.compile(m, plan=_plan_json(seq_len=0)), ["seq_len=0"]),
    ("plan-lengths-floats", lambda m, d: sppo_fx.compile(m, plan=_plan_json(chunk_lengths=[2.0, 2.0])),
     ["chunk_lengths=[2.0, 2.0]", "whole"]),
    ("plan-lengths-negative", lambda m, d: sppo_fx.compile(m, plan=_plan_json(chunk_lengths=[6, -2])),
     ["chunk lengths must be >= 1"]),
    # model inputs
    ("empty-batch", lambda m, d: sppo_fx.compile(m, chunks=2)(torch.zeros(0, 12, dtype=torch.long),
                                                               torch.zeros(0, 12, dtype=torch.long)),
     ["input 0 is empty", "(0, 12)"]),
    ("empty-sequence", lambda m, d: sppo_fx.compile(m, chunks=2)(torch.zeros(2, 0, dtype=torch.long),
                                                                  torch.zeros(2, 0, dtype=torch.long)),
     ["input 0 is empty"]),
    ("sparse-input", lambda m, d: sppo_fx.compile(m, chunks=2)(tokens(12)[0].to_sparse(), tokens(12)[1]),
     ["sparse", "to_dense"]),
]


def _children() -> set[int]:
    """This process's child processes (Linux)."""
    out = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # the thread ended after the listing (a thread, not a child process)
            continue
    return out


@pytest.mark.parametrize("call,fragments", [c[1:] for c in ARGUMENT_CASES], ids=[c[0] for c in ARGUMENT_CASES])
def test_bad_argument_is_refused_by_name(tmp_path, call, fragments):
    if "/proc" in str(fragments) and not os.path.isdir("/proc"):
        pytest.skip("needs /proc (a directory no one can create files in)")
    before = _children() if os.path.isdir("/proc/self/task") else set()
    _assert_refused(_gpt(), call, fragments, tmp_path)
    if before or os.path.isdir("/proc/self/task"):
        left = _children() - before
        # an earlier test's background work (Inductor's CPU probe, a compile child being
        # reaped) may start and end a short-lived child meanwhile: a process this call left
        # behind is one still there seconds later
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left &= _children()
        assert not left, f"a process was left behind: {_cmdlines(left)}"


def _cmdlines(pids) -> dict:
    """Each process's command line, to tell which code started it (a flaky leftover)."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError as e:
            out[pid] = f"({e.strerror})"
    return out


ENV_CASES = [
    ("SPPO_FX_MEMORY_MODEL_CACHE", "maybe", ["SPPO_FX_MEMORY_MODEL_CACHE='maybe'", "on or off"]),
    ("SPPO_FX_PROFILE_CACHE", "sometimes", ["SPPO_FX_PROFILE_CACHE='sometimes'", "on or off"]),
    ("SPPO_FX_FORK", "2", ["SPPO_FX_FORK='2'", "on or off"]),
    ("SPPO_FX_RECALIBRATE", "please", ["SPPO_FX_RECALIBRATE='please'", "on or off"]),
    ("SPPO_FX_BACKGROUND_COMPILE", "sometimes", ["SPPO_FX_BACKGROUND_COMPILE='sometimes'", "auto, on, wait or off"]),
    ("SPPO_FX_LOG_PASSES", "off", ["SPPO_FX_LOG_PASSES='off'", "reads as 1"]),
    ("SPPO_FX_LOG", "loud", ["SPPO_FX_LOG", "'loud'"]),
    ("SPPO_FX_CACHE_DIR", "cache", ["SPPO_FX_CACHE_DIR='cache'", "absolute path"]),
    ("XDG_CACHE_HOME", ".cache", ["XDG_CACHE_HOME='.cache'", "absolute path"]),
]


@pytest.mark.parametrize("var,value,fragments", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_bad_environment_variable_is_refused_by_name(tmp_path, monkeypatch, var, value, fragments):
    monkeypatch.setenv(var, value)
    _assert_refused(_gpt(), lambda m, d: sppo_fx.compile(m, chunks=2), fragments, tmp_path)


CLI_CASES = [
    (["plan", "--host-memory", "1e400"], ["argument --host-memory", "'1e400' is not a finite size"]),
    (["plan", "--seq", "1"], ["--seq 1 gives some of the 128 GPUs no token", "--seq >= --gpus"]),
    (["plan", "--seq", "lots"], ["argument --seq", "'lots'"]),
    (["plan", "--gpus", "0"], ["argument --gpus", "give a whole number >= 1"]),
    (["plan", "--layers", "-2"], ["argument --layers", "-2 is not positive"]),
    (["plan", "--chunks", "0"], ["argument --chunks"]),
    (["plan", "--device", "tpu"], ["argument --device", "unknown device profile 'tpu'"]),
    (["plan", "--stages", "256"], ["--stages 256 is more than --gpus 128"]),
    (["plan", "--host-memory", "0.5"], ["argument --host-memory", "did you mean a fraction"]),
    (["trace", "--out", "MISSING/t.json"], ["--out 'MISSING/t.json'", "existing directory"]),
    (["explain", "--seq-len", "0"], ["argument --seq-len"]),
    (["explain", "--chunks", "9", "--seq-len", "8"], ["--chunks 9 is more than --seq-len 8"]),
    (["bench", "--steps", "0"], ["argument --steps"]),
    (["bench", "--timeout", "inf"], ["argument --timeout", "finite number of seconds"]),
    (["bench", "--offload-dir", "MISSING"], ["argument --offload-dir", "not an existing directory"]),
]


@pytest.mark.parametrize("argv,fragments", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_bad_command_line_is_an_argparse_error(capsys, tmp_path, argv, fragments):
    from sppo_fx.cli import main
    # MISSING: a directory that does not exist on any machine this runs on (a fixed path
    # such as /no/such/dir exists wherever something, run as root, once created it)
    missing = str(tmp_path / "missing")
    argv = [a.replace("MISSING", missing) for a in argv]
    fragments = [f.replace("MISSING", missing) for f in fragments]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"sppo-fx {argv[0]}: error:" in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"


def test_budget_accepts_bytes_and_units():
    from sppo_fx.util.units import parse_bytes
    assert parse_bytes(4096, "budget") == 4096 and parse_bytes(1.5e9, "budget") == 1_500_000_000
    assert parse_bytes("512MiB", "budget") == 512 << 20 and parse_bytes("2 GB", "budget") == 2 * 10**9
    import numpy as np
    assert parse_bytes(np.int64(7), "budget") == 7


def test_two_tokens_are_enough():
    """The shortest sequence check_inputs lets through still trains (one token per chunk)."""
    model = _gpt()
    x, y = tokens(2)
    sppo_fx.compile(model, compile=False)(x, y).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_at_least_twenty_more_kinds():
    assert len(ARGUMENT_CASES) - 8 + len(ENV_CASES) + len(CLI_CASES) - 2 >= 20
