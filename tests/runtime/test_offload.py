"""Offloading chunks' saved activations changes where tensors live, never the arithmetic."""
from __future__ import annotations

import os

import pytest
import torch

import sppo_fx
from sppo_fx.models import build
from conftest import tiny_model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("tier", ["disk", "device"])
def test_offload_is_bitwise_neutral(kind, tier, tmp_path):
    model = tiny_model(kind)  # one block: neutrality is per saved tensor, whatever the depth
    x, y = torch.randint(0, 97, (2, 512)), torch.randint(0, 97, (2, 512))  # activations above 64 KiB
    plain = sppo_fx.compile(model, chunks=4, compile=False)
    loss = plain(x, y)
    loss.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    offloaded = sppo_fx.compile(model, chunks=4, compile=False, offload=tier, offload_dir=str(tmp_path))
    loss2 = offloaded(x, y)
    store = offloaded.store
    # chunks 0..2 hand their saved activations to the store until their backward
    assert (store.bytes_offloaded if tier == "disk" else store.bytes_on_device) > 0
    loss2.backward()
    assert torch.equal(loss, loss2)
    for name, g in _grads(model).items():
        assert torch.equal(g, ref[name]), name
    assert store.bytes_offloaded == 0 and store.bytes_on_device == 0
    if tier == "disk":
        assert store.peak_bytes_offloaded > 0
        # every file was read back: none holds data (sppo_fx.compile's store pools them)
        assert len(os.listdir(store.dir)) == store.pooled_files > 0


def test_unknown_tier_is_refused():
    with pytest.raises(sppo_fx.SppoError, match="offload='nvme'"):  # at compile, before any input is seen
        sppo_fx.compile(build("gpt"), chunks=2, compile=False, offload="nvme")
