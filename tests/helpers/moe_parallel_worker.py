"""One rank of tests/passes/test_moe.py's parallel layouts: Mixtral (2 layers, the router's auxiliary
loss at coefficient 1) in sequence-parallel, pipeline and data-parallel layouts on 2 ranks,
one `compiled.step` each (compile=False), against eager. argv[1]: a JSON list of layouts
("sp", "pp", "dp"). Prints one JSON line: per layout whether the loss matched, the
parameters outside tolerance and the largest relative gradient difference."""
import json
import os
import sys

import torch
import torch.distributed as dist

import sppo_fx
from sppo_fx.runtime.distributed import init_from_env
sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes"),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # tests/: conftest  # test_moe
from test_moe import build

RTOL, ATOL = 1e-4, 1e-5


def run(layout: str) -> dict:
    model = build("mixtral", layers=2, output_router_logits=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    kwargs = {"sp": dict(seq_parallel=2), "pp": dict(stages=2), "dp": dict(data_parallel=2)}[layout]
    compiled = sppo_fx.compile(model, chunks=2, compile=False, **kwargs)
    loss = compiled.step(input_ids=ids, labels=ids)
    worst, bad = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue  # another stage's parameter
        r = ref[name]
        worst = max(worst, ((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
        if not torch.allclose(p.grad, r, rtol=RTOL, atol=ATOL):
            bad.append(name)
    return {"loss_ok": bool(torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)), "bad": bad, "rel": worst}


def main() -> int:
    init_from_env(300.0)
    print(json.dumps({layout: run(layout) for layout in json.loads(sys.argv[1])}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
