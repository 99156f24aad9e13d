"""One rank of the two-process all-to-all attention check (tests/distributed/test_seq_parallel.py).

Each rank holds its share of a chunk's tokens (uneven: 6 and 5 of 11) of q, k, v for all
heads; the all-to-alls give it all 11 tokens of half the heads, the chunk attention runs
over a K/V prefix of those heads, and the inverse all-to-all brings the output back. The
rank compares its output and the gradients of its q, k, v (and of its heads' prefix) with
full causal attention over prefix + chunk computed by one process, and prints the largest
differences as JSON.
"""
import json
import sys

import torch
import torch.distributed as dist

from sppo_fx.chunk_attention.functions import prefix_causal_attention
from sppo_fx.ops.seq_parallel import active_split, heads_to_seq, register_group, seq_to_heads
from sppo_fx.passes.sequence_parallel import kv_repeats


def full_attention(q, k, v):
    """Causal attention of the last q.shape[-2] positions over all of k, v (lower right)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    c, n = q.shape[-2], k.shape[-2]
    mask = torch.ones(c, n, dtype=torch.bool).tril(n - c)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check(rank: int, heads: int, kv_heads: int, prefix: int, split=(6, 5)) -> dict:
    parts, total = len(split), sum(split)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, total, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, prefix + total, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, prefix + total, 8, generator=gen, dtype=torch.float64)
    upstream = torch.randn(2, heads, total, 8, generator=gen, dtype=torch.float64)
    # reference: one process, every token and head
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = full_attention(*ref)
    out_ref.backward(upstream)
    # this rank: its tokens of the chunk, all heads; its heads of the prefix
    lo, hi = sum(split[:rank]), sum(split[:rank + 1])
    reps = kv_repeats(heads, kv_heads, parts)
    kv_block = kv_heads * reps // parts
    q_local = q[:, :, lo:hi].clone().requires_grad_()
    k_local = k[:, :, prefix + lo:prefix + hi].clone().requires_grad_()
    v_local = v[:, :, prefix + lo:prefix + hi].clone().requires_grad_()
    kp_all, vp_all = (t[:, :, :prefix].repeat_interleave(reps, 1) for t in (k, v))
    kp = kp_all[:, rank * kv_block:(rank + 1) * kv_block].clone().requires_grad_()
    vp = vp_all[:, rank * kv_block:(rank + 1) * kv_block].clone().requires_grad_()
    with active_split(split):
        k_in = k_local.repeat_interleave(reps, 1) if reps > 1 else k_local
        v_in = v_local.repeat_interleave(reps, 1) if reps > 1 else v_local
        q2, t = seq_to_heads(q_local, None, total, parts, "sp")
        k2, t = seq_to_heads(k_in, t, total, parts, "sp")
        v2, t = seq_to_heads(v_in, t, total, parts, "sp")
        att = prefix_causal_attention(q2, kp, k2, vp, v2, enable_gqa=True)
        out, _t = heads_to_seq(att, t, hi - lo, parts, "sp")
        out.backward(upstream[:, :, lo:hi])
    gp_ref = [t.grad[:, :, :prefix].reshape(2, kv_heads, 1, prefix, 8) for t in ref[1:]]
    diffs = {
        "out": (out - out_ref[:, :, lo:hi]).abs().max().item(),
        "dq": (q_local.grad - ref[0].grad[:, :, lo:hi]).abs().max().item(),
        "dk": (k_local.grad - ref[1].grad[:, :, prefix + lo:prefix + hi]).abs().max().item(),
        "dv": (v_local.grad - ref[2].grad[:, :, prefix + lo:prefix + hi]).abs().max().item(),
        "q_moved": bool(q2.shape[2] == total and q2.shape[1] == heads // parts),
    }
    # the prefix gradients of every rank's heads, gathered and summed over a head's
    # repeats, are the reference's prefix gradient
    gathered = [torch.empty_like(kp.grad) for _ in range(parts)]
    dist.all_gather(gathered, kp.grad.contiguous())
    dk_prefix = torch.cat(gathered, 1).reshape(2, kv_heads, reps, prefix, 8).sum(2)
    diffs["dk_prefix"] = (dk_prefix - gp_ref[0].reshape(2, kv_heads, prefix, 8)).abs().max().item() if prefix else 0.0
    return diffs


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    register_group("sp", dist.group.WORLD)
    results = {"gqa": check(rank, heads=4, kv_heads=2, prefix=5),
               "repeated_kv": check(rank, heads=4, kv_heads=1, prefix=3),
               "no_prefix_even": check(rank, heads=2, kv_heads=2, prefix=0, split=(4, 4))}
    print(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
