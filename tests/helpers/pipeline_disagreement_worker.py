"""One rank of tests/distributed/test_pipeline_dist.py::test_ranks_that_disagree_are_stopped_before_a_step.

Runs one scenario after another in the same process group; in each, the last rank builds
something different from the others. Prints one JSON line per scenario: the error every
rank raised (or None) and whether any parameter got a gradient.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn

import sppo_fx
from sppo_fx.models import build
from sppo_fx.runtime.distributed import init_from_env


def scenario(name: str, rank: int, world: int):
    """(model, compile kwargs, tokens) of this rank for the scenario."""
    odd = rank == world - 1
    torch.manual_seed(1 if odd and name == "values" else 0)
    model = build("gpt", "tiny", n_layer=2)
    kwargs = dict(chunks=2, stages=world, microbatches=2, compile=False, timeout_s=60)
    batch = 2
    if odd and name == "graph":
        model.h[0].mlp[1] = nn.GELU()  # exact GELU instead of the tanh approximation: no parameter changes
    if odd and name == "dtypes":
        model.h[1].ln_2.bias.data = model.h[1].ln_2.bias.data.double()
    if odd and name == "schedule":
        kwargs["schedule"] = "gpipe"
    if odd and name == "input shapes":
        batch = 4
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 97, (batch, 16), generator=gen)
    return model, kwargs, x


def main() -> int:
    rank, world = init_from_env(60.0)
    for name in sys.argv[1:]:
        model, kwargs, x = scenario(name, rank, world)
        compiled = sppo_fx.compile(model, **kwargs)
        error = None
        try:
            compiled.step(x, x)
        except sppo_fx.SppoError as e:
            error = str(e)
        grads = any(p.grad is not None for p in model.parameters())
        print(json.dumps({"scenario": name, "rank": rank, "error": error, "grads": grads}), flush=True)
    # a tied parameter changed on one rank after the first build: a later build (another
    # input shape) compares the shared parameters' values again
    model, kwargs, x = scenario("same", rank, world)
    compiled = sppo_fx.compile(model, **kwargs)
    compiled.step(x, x)
    model.zero_grad(set_to_none=True)
    if rank == world - 1:
        with torch.no_grad():
            model.wte.weight[0, 0] += 1.0
    error = None
    try:
        compiled.step(x[:, :12], x[:, :12])
    except sppo_fx.SppoError as e:
        error = str(e)
    grads = any(p.grad is not None for p in model.parameters())
    print(json.dumps({"scenario": "shared values", "rank": rank, "error": error, "grads": grads}), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
