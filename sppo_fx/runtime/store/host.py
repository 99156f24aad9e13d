"""The host tier: CUDA tensors go to pinned host memory (the core copies them on a
dedicated device-to-host stream and back on a host-to-device one, each fenced by an
event). On a CPU-only machine the device is host memory, so nothing moves.

docs/architecture.md, section 3 "Memory model" (tiers).
"""
from __future__ import annotations

import torch

from sppo_fx.runtime.store.tier import Tier


class HostTier(Tier):
    name = "host"

    def moves(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    # keep / load: the base class's (the pinned copy, `rec.host`, is the offloaded data)
