"""One rank of tests/passes/test_ones_inputs.py's sequence-parallel case: Llama (2 layers) called
with attention_mask=ones under seq_parallel=2 (compile=False), one `compiled.step` against
eager; then a step with a padded mask, which every rank must refuse before any step (each
rank checks the whole batch it was given). Prints one JSON line."""
import json
import os
import sys

import torch
import torch.distributed as dist

import sppo_fx
from sppo_fx.errors import SppoError
from sppo_fx.runtime.distributed import init_from_env
sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes"),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # tests/: conftest  # test_ones_inputs
from test_ones_inputs import _ids, _model, _padded

RTOL, ATOL = 1e-4, 1e-5


def main() -> int:
    init_from_env(300.0)
    model, ids = _model("llama"), _ids()
    call = dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    ref_loss = model(**call).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = sppo_fx.compile(model, chunks=2, compile=False, seq_parallel=2)
    loss = compiled.step(**call)
    bad = [n for n, p in model.named_parameters() if not torch.allclose(p.grad, ref[n], rtol=RTOL, atol=ATOL)]
    model.zero_grad(set_to_none=True)
    try:
        compiled.step(input_ids=ids, labels=ids, attention_mask=_padded(ids))
        refused = ""
    except SppoError as e:
        refused = str(e)
    print(json.dumps({"loss_ok": bool(torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)), "bad": bad,
                      "guarded": bool(compiled.pipeline.graph.meta.get("sppo_ones_inputs")),
                      "refused": refused, "grads_none": all(p.grad is None for p in model.parameters())}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
