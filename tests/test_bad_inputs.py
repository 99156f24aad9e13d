"""Bad inputs are refused: each case raises SppoError whose message names what to change,
before any gradient exists (every parameter's .grad stays None) and without leaving files
in offload_dir. More refusals with op and source line are in tests/test_errors.py
(non-causal attention, masks, cumsum, flip, ...); some are repeated here for the table."""
from __future__ import annotations

import os

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
