"""One rank of tests/api/test_verify.py's two-rank check: verify=True over pipeline (pp=2) and
sequence-parallel (sp=2) layouts, with exact programs and with a mask recogniser broken
on purpose. Prints {layout: {"error": message or None, "stepped": bool, "grads_left": n}}
as JSON on its last line."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sppo_fx  # noqa: E402
from sppo_fx.errors import SppoError  # noqa: E402
from sppo_fx.models import build  # noqa: E402
from sppo_fx.runtime.distributed import init_from_env  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "api"))  # test_verify
from test_verify import PeekingLM, _data  # noqa: E402


class Patch:
    """accept_every_mask without pytest's monkeypatch."""

    def __enter__(self):
        import types
        import sppo_fx.passes.masks.causal as causal_mask
        self._saved = causal_mask.prove_mask
        proven = types.SimpleNamespace(kind=types.SimpleNamespace(window=None), documents=None, limit=None)
        causal_mask.prove_mask = lambda *a, **k: proven

    def __exit__(self, *exc):
        import sppo_fx.passes.masks.causal as causal_mask
        causal_mask.prove_mask = self._saved


def run(model, x, y, **layout) -> dict:
    compiled = sppo_fx.compile(model, chunks=4, compile=False, verify=True, timeout_s=120, **layout)
    out = {"error": None, "stepped": False}
    try:
        compiled.step(x, y)
        out["stepped"] = True
    except SppoError as e:
        out["error"] = str(e)
    out["grads_left"] = 0 if out["stepped"] else sum(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return out


def main() -> int:
    init_from_env()
    torch.manual_seed(0)
    llama = build("llama", "tiny", n_layers=2)
    x, y = _data(llama.config.vocab_size, seq=32)
    results = {"pp2": run(llama, x, y, stages=2), "sp2": run(llama, x, y, seq_parallel=2)}
    torch.manual_seed(0)
    peeking = PeekingLM(dim=32, heads=4)
    x, y = _data(seq=32)
    with Patch():
        results["sp2_broken"] = run(peeking, x, y, seq_parallel=2)
        results["pp2_broken"] = run(peeking, x, y, stages=2, split_points=["proj"])
    print(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
