"""nanoGPT / minGPT as written: sliced inputs at batch > 1 and explicit causal attention."""
from __future__ import annotations

import pytest
import torch

import sppo_fx

from conftest import assert_matches_eager
from nanogpt_style import NanoGPT

T = 32


def _data(batch, seq=T, vocab=101):
    g = torch.Generator().manual_seed(batch)
    return (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_nanogpt_view_loss_at_batch(batch):
    # `targets.view(-1)` on the chunk's slice of the targets: strided at batch > 1.
    torch.manual_seed(0)
    model = NanoGPT(flash=True)
    x, y = _data(batch)
    compiled = sppo_fx.compile(model, chunks=4, compile=False)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y))

