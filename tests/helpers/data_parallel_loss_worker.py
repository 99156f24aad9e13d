"""One rank of tests/distributed/test_data_parallel_loss.py: losses that read the batch size (or the
sequence length) as a value, under data_parallel=2 and seq_parallel=2, against the model on
the full batch. Prints {case: {"loss", "ref", "grad_err", "error", "grads_left"}} as JSON
on its last line."""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sppo_fx  # noqa: E402
from sppo_fx.errors import SppoError  # noqa: E402
from sppo_fx.runtime.distributed import init_from_env  # noqa: E402

V = 31


def _loss(mode, logits, ids, y, w):
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    b, t = ids.shape
    if mode == "mean_ce":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if mode == "sum_ce_over_b":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / ids.shape[0]
    if mode == "kl_batchmean":
        return F.kl_div(F.log_softmax(logits, -1), torch.full_like(logits, 1 / V), reduction="batchmean")
    if mode == "none_mean":
        return ce.mean()
    if mode == "batch_mean_then_sum":
        return ce.view(b, t).mean(0).sum() / t
    if mode == "sample_weighted":
        return (ce.view(b, t) * w[:, None]).sum() / (b * t)
    if mode == "mse":
        return F.mse_loss(logits, torch.zeros_like(logits))
    if mode == "ignore_index":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=3)
    if mode == "sum_over_t":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / ids.shape[1]
    raise ValueError(mode)


class LM(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)

    def forward(self, ids, y, w):
        return _loss(self.mode, self.head(torch.tanh(self.embed(ids))), ids, y, w)


def run(mode, **layout) -> dict:
    torch.manual_seed(0)
    model = LM(mode)
    gen = torch.Generator().manual_seed(1)
    ids, y = (torch.randint(0, V, (4, 16), generator=gen) for _ in range(2))
    w = torch.rand(4, generator=gen)
    compiled = sppo_fx.compile(model, chunks=2, compile=False, timeout_s=120, **layout)
    out = {"error": None, "loss": None}
    try:
        out["loss"] = float(compiled.step(ids, y, w))
    except SppoError as e:
        out["error"] = str(e)
        out["grads_left"] = sum(p.grad is not None for p in model.parameters())
        return out
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(ids, y, w)
    ref.backward()
    out["ref"] = float(ref)
    out["grad_err"] = max(float(((got[n] - p.grad).abs() - 1e-4 * p.grad.abs()).max()) for n, p in
                          model.named_parameters())  # <= 1e-5: allclose(rtol 1e-4, atol 1e-5)
    return out


def main() -> int:
    init_from_env()
    cases = ["mean_ce", "sum_ce_over_b", "kl_batchmean", "none_mean", "batch_mean_then_sum", "sample_weighted",
             "mse", "ignore_index"]
    results = {f"dp2/{m}": run(m, data_parallel=2) for m in cases}
    results.update({f"sp2/{m}": run(m, seq_parallel=2) for m in ["sum_over_t", "sum_ce_over_b"]})
    results["dp2_mb2/sum_ce_over_b"] = run("sum_ce_over_b", data_parallel=2, microbatches=2)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
