"""CUDA checks: the Triton chunk-attention kernels, the activation store's host tier,
offloading and Inductor-compiled chunk programs, each against an eager reference.

Every test here needs a CUDA GPU; on a CPU-only machine the whole module is skipped.
Ordered from cheap to expensive (the Inductor compiles come last), so that a run cut short
by a timeout still reports the cheap checks (run with -v to see them as they finish).

    store      host tier (pinned memory, D2H/H2D streams): round trips, the copy waits for
               the kernel that produced the tensor, reads wait for writes, a stress test
               with slowed copies, saved-tensor hooks under autograd's CUDA device thread
    kernels    sppo_fx.chunk_attention.op (the Triton branch) forward and backward vs a
               float64 SDPA with causal_lower_right; fp32 and bf16, prefixes, GQA/MQA,
               a padded head dim; the segmented (log-sum-exp merged) variant
    offload    chunk programs with offload nodes: host tier == device tier == no offload,
               bitwise, and the offloaded activations really leave the GPU; the K/V
               skeleton streamed from the host tier
    inductor   sppo_fx.compile(..., compile=True) of the tiny GPT and Llama vs the eager
               unchunked model (loss and every gradient); then with offload="host"
"""
from __future__ import annotations

import functools
import importlib
import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import sppo_fx
from sppo_fx.models import build
from sppo_fx.plan import Plan
from sppo_fx.runtime.store import ActivationStore

from conftest import ATOL, RTOL, assert_matches_eager, eager_loss_and_grads

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

DEV = "cuda"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _ieee_fp32_matmuls():
    """fp32 comparisons assume IEEE fp32 matmuls (TF32 off, PyTorch's default)."""
    if not torch.cuda.is_available():
        yield
        return
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if tf32:  # set only when needed (torch >= 2.9 also has a newer fp32_precision API)
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.numel() == 0:
        return True
    ac, bc = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(ac, bc)
    return torch.equal(ac.view(torch.uint8), bc.view(torch.uint8))


# ======================================================================================
# Activation store, host tier
# ======================================================================================


def _cuda_tensors():
    g = torch.Generator(device=DEV).manual_seed(0)

    def rn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=DEV, dtype=dtype)

    base = rn(6, 5, 4)
    return [
        rn(3, 4),
        rn(5, 7).t(),                                         # transposed (dense, permuted)
        base.permute(2, 0, 1),                                # permuted 3-d
        base[:, ::2, 1:3],                                    # strided view with gaps
        rn(3, 1).expand(3, 4),                                # expanded (stride 0)
        torch.empty(0, 3, device=DEV),                        # 0-size
        torch.tensor(3.5, device=DEV),                        # 0-dim
        torch.arange(20, dtype=torch.int64, device=DEV)[3:17:2],
        rn(7, 3).to(torch.bfloat16),
        rn(2, 9).to(torch.float16),
        rn(3, 3, dtype=torch.float64),
        rn(11) > 0,                                           # bool
        torch.full((4,), float("nan"), device=DEV),           # NaN payloads stay bitwise
        rn(1 << 20),                                          # 4 MiB
    ]


def test_host_tier_round_trip_bitwise_on_cuda():
    with ActivationStore("host") as store:
        ts = _cuda_tensors()
        hs = [store.offload(t) for t in ts]
        for i, h in enumerate(hs):
            if i % 2:
                store.prefetch(h)
        for t, h in zip(ts, hs):
            out = store.wait(h)
            assert out.device == t.device
            assert _bitwise_equal(out, t), (t, out)
            assert store.wait(h) is out
            if t.is_contiguous() and t.numel() > 1:
                assert out.stride() == t.stride()
        for h in hs:
            h.release()
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 0


def test_host_tier_moves_data_to_pinned_memory_and_frees_the_gpu():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with ActivationStore("host") as store:
        t = torch.randn(16 * MiB // 4, device=DEV)            # 16 MiB
        expected = t.sum().item()
        h = store.offload(t)
        del t
        store.synchronize()                                   # the D2H copy has completed
        assert h.state == "stored"
        rec = h._rec
        assert rec.src is None and rec.host is not None and rec.host.device.type == "cpu"
        assert rec.host.is_pinned(), "the host tier must copy into pinned memory"
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 16 * MiB
        freed = torch.cuda.memory_allocated() - base
        assert freed < MiB, f"{freed} bytes still allocated on the GPU after the copy completed"
        out = store.wait(h)
        assert out.device.type == "cuda" and out.sum().item() == expected
        assert store.bytes_on_device == 16 * MiB and store.bytes_offloaded == 0
        h.release()
        del out
    assert torch.cuda.memory_allocated() - base < MiB


def test_host_tier_copy_waits_for_the_producing_kernel():
    """The D2H copy runs on its own stream: it must wait for the kernels (on the current
    stream) that wrote the tensor, or it copies stale data."""
    with ActivationStore("host") as store:
        for value in (7.0, -3.0, 11.0):
            t = torch.zeros(4 * MiB, device=DEV)              # 16 MiB
            torch.cuda._sleep(100_000_000)                    # ~50 ms of GPU time before the write
            t.fill_(value)
            h = store.offload(t)                              # at once, while the stream is busy
            del t
            junk = torch.full((4 * MiB,), -1.0, device=DEV)   # would land in t's block if freed early
            out = store.wait(h)
            assert torch.all(out == value).item(), f"read back {out.unique()[:8].tolist()}, expected {value}"
            h.release()
            del junk, out


def test_host_tier_read_waits_for_write_on_cuda():
    gate = threading.Event()
    reads = []

    def hook(what):
        if what == "write":
            assert gate.wait(10)
        else:
            reads.append(time.monotonic())

    with ActivationStore("host") as store:
        store.delay_hook = hook
        t = torch.randn(257, 3, device=DEV)
        expected = t.clone()
        h = store.offload(t)
        store.prefetch(h)
        time.sleep(0.1)
        assert h.state == "writing" and not reads
        released_at = time.monotonic()
        gate.set()
        out = store.wait(h)
        assert reads and reads[0] >= released_at
        assert _bitwise_equal(out, expected)


def test_host_tier_stress_with_slow_copies_on_cuda():
    """Mirror of test_store's disk stress test for the host tier on CUDA: many handles,
    randomly slowed copies, prefetches racing pending writes, producers still running on
    the GPU, and freed blocks immediately reused by new allocations."""
    rng = random.Random(1234)

    def slow(what):
        time.sleep(rng.random() * 0.003)

    with ActivationStore("host", workers=3) as store:
        store.delay_hook = slow
        g = torch.Generator(device=DEV).manual_seed(7)
        expected, handles, junk = [], [], []
        for i in range(240):
            n = rng.choice([0, 1, 17, 1000, 4096, 20000, 1 << 18])
            if rng.random() < 0.2:
                torch.cuda._sleep(rng.randrange(1_000_000))   # a slow producer
            t = torch.randn(n, generator=g, device=DEV).mul_(i)
            if i % 3 == 0:
                t = t.to(torch.bfloat16)
            elif i % 7 == 0 and n >= 4:
                t = t[: n // 4 * 4].view(-1, 4).t()           # dense, transposed
            expected.append(t.clone())
            handles.append(store.offload(t))
            del t                                             # only the store may hold it now
            junk.append(torch.full((n,), float("nan"), device=DEV))
            if len(junk) > 4:
                junk.pop(0)
            if rng.random() < 0.3:                            # prefetch some while writes are pending
                store.prefetch(handles[rng.randrange(len(handles))])
        order = list(range(len(handles)))
        rng.shuffle(order)
        for k in order[: len(order) // 2]:
            store.prefetch(handles[k])
        bad = [k for k in order if not _bitwise_equal(store.wait(handles[k]), expected[k])]
        assert not bad, f"{len(bad)} of {len(handles)} tensors came back different, e.g. #{bad[:5]}"
        for h in handles:
            h.release()
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 0


def _mlp_grads(store=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8)).to(DEV)
    x = torch.randn(512, 256, device=DEV)
    if store is None:
        loss = model(x).pow(2).mean()
    else:
        with store.scope() as scope, store.saved_tensor_hooks(min_bytes=0, keep_leaves=False):
            loss = model(x).pow(2).mean()
        assert len(scope.handles) > 5
        scope.prefetch()
    loss.backward()                                           # unpack runs on autograd's CUDA thread
    return [p.grad.clone() for p in model.parameters()]


def test_host_tier_saved_tensor_hooks_bitwise_grads_on_cuda():
    ref = _mlp_grads()
    with ActivationStore("host") as store:
        got = _mlp_grads(store)
        assert store.peak_bytes_offloaded > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


# ======================================================================================
# Triton chunk attention
# ======================================================================================

# b, h, h_kv, c, p, d
KERNEL_CASES = {
    torch.float32: [
        (1, 4, 4, 1, 0, 64),          # one query, no prefix
        (2, 8, 2, 17, 63, 64),        # GQA, ragged tiles, a prefix
        (1, 4, 1, 64, 1000, 80),      # MQA, long prefix, head dim padded to 128
    ],
    torch.bfloat16: [
        (2, 8, 2, 17, 63, 64),
        (1, 8, 2, 128, 300, 128),     # several tiles, head dim 128
        (1, 12, 4, 1024, 3072, 64),   # a realistic chunk (llama-bench heads)
    ],
}
KERNEL_PARAMS = [(dt, s) for dt, shapes in KERNEL_CASES.items() for s in shapes]


def _attention_inputs(b, h, h_kv, c, p, d, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)

    return rn(b, h, c, d), rn(b, h_kv, p + c, d), rn(b, h_kv, p + c, d), rn(b, h, c, d)


def _sdpa_lower_right(q, k, v, do, dtype=None):
    """out, dq, dk, dv of SDPA with causal_lower_right on heads-repeated K/V, computed in
    `dtype` (default: float64) from the given (already rounded) inputs."""
    dtype = dtype or torch.float64
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    mask = causal_lower_right(q.shape[2], k.shape[2])
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do.to(dtype)))


def _errors(got, want):
    """[(max abs error, max abs reference)] per tensor, in float64."""
    return [(float((a.detach().double() - b.detach().double()).abs().max()), float(b.detach().double().abs().max()))
            for a, b in zip(got, want)]


@pytest.mark.parametrize("dtype,shape", KERNEL_PARAMS,
                         ids=[f"{str(dt)[6:]}-b{s[0]}h{s[1]}kv{s[2]}c{s[3]}p{s[4]}d{s[5]}" for dt, s in KERNEL_PARAMS])
def test_triton_chunk_attention_matches_sdpa_on_cuda(dtype, shape):
    from sppo_fx.ops import chunk_attention
    CA = importlib.import_module("sppo_fx.chunk_attention.op")   # the module (the package exports the function)

    q, k, v, do = _attention_inputs(*shape, dtype=dtype, seed=sum(shape))
    assert CA._use_triton(q), "the op would not launch the Triton kernels for this CUDA tensor"
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = chunk_attention(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), do))
    assert got[0].dtype == dtype and got[2].shape == k.shape
    want = _sdpa_lower_right(q, k, v, do)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for name, (err, scale) in zip(names, _errors(got, want)):
            assert err <= 1e-5 + 1e-4 * scale, f"{name}: max abs error {err:.3g} (reference max {scale:.3g})"
    else:
        # bf16: against float64 on the same bf16 inputs, and no worse than SDPA's own bf16
        # kernels (flash / memory-efficient) on those inputs
        base = _sdpa_lower_right(q, k, v, do, dtype=torch.bfloat16)
        for name, (err, scale), (err_sdpa, _) in zip(names, _errors(got, want), _errors(base, want)):
            msg = f"{name}: max abs error {err:.3g}, SDPA bf16 {err_sdpa:.3g} (reference max {scale:.3g})"
            assert err <= 1e-2 + 2e-2 * scale, msg
            assert err <= 4 * err_sdpa + 1e-3 * scale, msg


def test_segmented_chunk_attention_on_cuda():
    """Segments merged by log-sum-exp: exercises the non-causal kernels and the lse gradient."""
    from sppo_fx.ops import chunk_attention, segmented_chunk_attention

    g = torch.Generator(device=DEV).manual_seed(5)
    h, h_kv, c, d, lens = 8, 2, 48, 64, [100, 5, 48]
    q = torch.randn(1, h, c, d, generator=g, device=DEV).requires_grad_()
    ks = [torch.randn(1, h_kv, n, d, generator=g, device=DEV).requires_grad_() for n in lens]
    vs = [torch.randn(1, h_kv, n, d, generator=g, device=DEV).requires_grad_() for n in lens]
    do = torch.randn(1, h, c, d, generator=g, device=DEV)
    leaves = [q, *ks, *vs]
    seg = segmented_chunk_attention(q, ks, vs)
    g_seg = torch.autograd.grad(seg, leaves, do)
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)
    ref = _sdpa_lower_right(q, k_all, v_all, do)
    ref_leaves = [ref[1], *ref[2].split(lens, 2), *ref[3].split(lens, 2)]
    for name, (err, scale) in zip(["out", "dq"] + [f"dk{i}" for i in range(3)] + [f"dv{i}" for i in range(3)],
                                  _errors([seg, *g_seg], [ref[0], *ref_leaves])):
        assert err <= 1e-5 + 1e-4 * scale, f"{name}: max abs error {err:.3g} (reference max {scale:.3g})"
    cat = chunk_attention(q, k_all, v_all)
    torch.testing.assert_close(seg, cat, rtol=1e-5, atol=1e-5)


# ======================================================================================
# Offload: host tier inside chunk programs
# ======================================================================================

WIDE = {"gpt": {"n_embd": 128}, "llama": {"dim": 128, "ffn_dim": 256}}   # activations above 64 KiB


@functools.lru_cache(maxsize=None)
def _cuda_program(kind):
    from sppo_fx.capture import capture
    from sppo_fx.codegen import compile_chunk_program
    from sppo_fx.passes import transform

    torch.manual_seed(0)
    model = build(kind, "tiny", **WIDE[kind]).to(DEV)
    x = torch.randint(0, 97, (2, 512), device=DEV)
    cap = capture(model, None, None, (x, x), {}, None, 1)
    program = transform(cap)[1]
    # AOTAutograd's forward/backward graphs with offload/wait nodes, run op by op (one
    # trace, shared by the device- and host-tier runs)
    return model, cap, program, compile_chunk_program(program.chunk, backend="eager", offload=True)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_host_offload_is_bitwise_neutral_on_cuda(kind):
    from torch.multiprocessing.reductions import StorageWeakRef

    from sppo_fx.runtime.local import chunked_loss

    model, cap, program, offload_fn = _cuda_program(kind)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randint(0, 97, (2, 512), device=DEV, generator=g)
    y = torch.randint(0, 97, (2, 512), device=DEV, generator=g)
    # uneven chunks, multiples of 16: the Triton kernels' integer arguments keep one
    # specialization (fewer JIT compiles)
    plan = Plan(512, [160, 144, 112, 96])
    params = [cap.param_value(n) for n in program.params]

    def run(chunk_fn=None, store=None, offload=None, min_bytes=1 << 16):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        offloaded = []
        if store is not None:
            store_offload = store.offload

            def track(t, *args, **kwargs):
                offloaded.append(StorageWeakRef(t.untyped_storage()))
                return store_offload(t, *args, **kwargs)

            store.offload = track
        loss = chunked_loss(program, params, [x, y], plan, chunk_fn, store, offload, min_bytes)
        if store is not None:
            store.synchronize()                               # every D2H copy has completed
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base           # what forward left on the GPU
        alive = sum(not r.expired() for r in offloaded)
        stats = store.stats() if store is not None else None
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held, alive, len(offloaded), stats

    ref_loss, ref, _, _, _, _ = run()                         # no offload graphs, no store
    with ActivationStore("device") as store:
        dev_loss, dev, dev_held, _, n_dev, _ = run(offload_fn, store)
    with ActivationStore("host") as store:
        loss, got, host_held, alive, n_host, stats = run(offload_fn, store)
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 0   # consumed by backward
    assert n_host > 0 and n_host == n_dev
    assert stats["bytes_offloaded"] > 0 and stats["bytes_on_device"] == 0, stats
    assert alive == 0, f"{alive} of {n_host} offloaded storages are still alive after forward"
    # the offloaded activations left the GPU: forward holds less by (about) what was offloaded
    saved = dev_held - host_held
    assert saved >= 0.9 * stats["bytes_offloaded"], (dev_held, host_held, stats)
    # the host tier's round trips change nothing: same graphs, same bits as the device tier
    assert torch.equal(loss, dev_loss)
    bad = [n for (n, _), a, b in zip(model.named_parameters(), got, dev) if not torch.equal(a, b)]
    assert not bad, f"host tier vs device tier: gradients differ for {bad}"
    # byte quotas per chunk (the budget plans' form), tiny tensors too, and the last chunk,
    # whose backward runs first, also offloading
    quotas = {(0, 0): float("inf"), (0, 1): 1 << 18, (0, 2): 0, (0, 3): float("inf")}
    with ActivationStore("host") as store:
        q_loss, q_got, _, _, n_q, _ = run(offload_fn, store, quotas, 0)
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 0
    assert n_q > 0 and torch.equal(q_loss, dev_loss)
    bad = [n for (n, _), a, b in zip(model.named_parameters(), q_got, dev) if not torch.equal(a, b)]
    assert not bad, f"host tier with byte quotas vs device tier: gradients differ for {bad}"
    # ... and as the same chunking without offload graphs (the op-by-op chunk program)
    bad = [n for (n, _), a, b in zip(model.named_parameters(), got, ref) if not torch.equal(a, b)]
    if bad or not torch.equal(loss, ref_loss):
        _, again, _, _, _, _ = run()
        deterministic = all(torch.equal(a, b) for a, b in zip(again, ref))
        pytest.fail(f"host offload vs no offload: loss equal {torch.equal(loss, ref_loss)}, gradients differ for "
                    f"{bad}; two runs without offload agree bitwise: {deterministic}")


def test_host_offload_of_the_kv_skeleton_on_cuda():
    """skeleton="offload": every chunk's K/V goes to the host tier once (kept copies) and
    is streamed back block by block for each later chunk's attention (lse-merged Triton
    kernels); bitwise equal to the same plan on the device tier, close to eager."""
    torch.manual_seed(0)
    model = build("llama", "tiny", **WIDE["llama"]).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randint(0, 97, (2, 256), device=DEV, generator=g)
    y = torch.randint(0, 97, (2, 256), device=DEV, generator=g)
    ref_loss, ref_grads = eager_loss_and_grads(model, lambda m: m(x, y))
    results = {}
    for tier in ("device", "host"):
        compiled = sppo_fx.compile(model, chunk_lengths=[96, 64, 64, 32], compile=False, offload=tier,
                                   skeleton="offload")
        loss = compiled(x, y)
        store = compiled.store
        store.synchronize()
        if tier == "host":
            assert store.bytes_offloaded > 0 and store.bytes_on_device == 0, store.stats()
        loss.backward()
        assert store.bytes_offloaded == 0 and store.bytes_on_device == 0, store.stats()
        results[tier] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    (l_dev, g_dev), (l_host, g_host) = results["device"], results["host"]
    assert torch.equal(l_dev, l_host)
    bad = [n for n in g_dev if not torch.equal(g_dev[n], g_host[n])]
    assert not bad, f"skeleton on the host tier vs the device tier: gradients differ for {bad}"
    torch.testing.assert_close(l_host, ref_loss, rtol=RTOL, atol=ATOL)
    for name, grad in g_host.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


# ======================================================================================
# Inductor-compiled chunk programs (Triton codegen) vs the eager model
# ======================================================================================


def _generated_text(compiled) -> str:
    text = []
    for path in compiled.codegen.generated_code():
        with open(path) as f:
            text.append(f.read())
    return "\n".join(text)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_inductor_chunks_match_eager_on_cuda(kind):
    torch.manual_seed(0)
    model = build(kind).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randint(0, 97, (2, 96), device=DEV, generator=g)
    y = torch.randint(0, 97, (2, 96), device=DEV, generator=g)
    y[0, :9] = -100 if kind == "llama" else -1               # ignored targets: a global mean
    compiled = sppo_fx.compile(model, chunks=3)
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y), rtol=RTOL, atol=ATOL)
    stats = compiled.codegen.stats
    assert stats.compiles <= 2, stats.graph_inputs
    # another partition reuses the dynamic graph
    compiled.options.chunk_lengths, compiled.options.chunks = [40, 31, 25], None
    assert_matches_eager(model, lambda m: m(x, y), lambda: compiled(x, y), rtol=RTOL, atol=ATOL)
    assert compiled.codegen.stats.compiles <= 2
    code = _generated_text(compiled)
    assert "triton" in code, "Inductor generated no Triton code for the CUDA chunk program"
    assert "torch.ops.sppo_fx.chunk_attention_opaque.default" in code, \
        "the compiled chunk program does not call the chunk-attention op"


def test_inductor_with_host_offload_matches_eager_on_cuda():
    torch.manual_seed(0)
    model = build("llama", "tiny", **WIDE["llama"]).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randint(0, 97, (2, 512), device=DEV, generator=g)
    y = torch.randint(0, 97, (2, 512), device=DEV, generator=g)
    ref_loss, ref_grads = eager_loss_and_grads(model, lambda m: m(x, y))
    compiled = sppo_fx.compile(model, chunks=4, offload="host")
    loss = compiled(x, y)
    store = compiled.store
    store.synchronize()
    assert store.bytes_offloaded > 0 and store.bytes_on_device == 0, store.stats()
    loss.backward()
    assert store.bytes_offloaded == 0 and store.bytes_on_device == 0, store.stats()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL, atol=ATOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert compiled.codegen.stats.compiles <= 2
    graphs = compiled.graphs
    fwd = [k for k in graphs if k.startswith("chunk.forward.")]
    assert fwd and any("sppo.offload" in graphs[k].code for k in fwd)


# ---------------------------------------------------------------- flash split, NCCL (issue 28)


def _split_inputs(c, p, h, h_kv, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(2, c, h, d, device=DEV, dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(2, c, h_kv, d, device=DEV, dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(2, c, h_kv, d, device=DEV, dtype=dtype, generator=g).transpose(1, 2)
    kbuf = torch.randn(2, h_kv, p + 17, d, device=DEV, dtype=dtype, generator=g)
    vbuf = torch.randn(2, h_kv, p + 17, d, device=DEV, dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (q, kbuf[:, :, :p], k, vbuf[:, :, :p], v)]


def _split_reference(q, kp, k, vp, v):
    groups = q.shape[1] // k.shape[1]
    k_all = torch.cat([kp, k], -2).repeat_interleave(groups, 1)
    v_all = torch.cat([vp, v], -2).repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=causal_lower_right(q.shape[-2], k_all.shape[-2]))


@pytest.mark.parametrize("c,p,h,h_kv", [(128, 0, 4, 4), (77, 300, 8, 2), (64, 1000, 4, 1), (200, 33, 4, 4)])
def test_flash_split_matches_sdpa_on_cuda(c, p, h, h_kv):
    from sppo_fx.chunk_attention.functions import prefix_causal_attention
    from sppo_fx.chunk_attention.kernels.flash_split import flash_split_supported
    inputs = _split_inputs(c, p, h, h_kv)
    assert flash_split_supported(inputs[0], inputs[2], inputs[4]) is None
    out = prefix_causal_attention(*inputs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = _split_reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_flash_split_routes_and_compiles_on_cuda():
    from torch.utils._python_dispatch import TorchDispatchMode
    from sppo_fx.chunk_attention.functions import prefix_causal_attention

    class Ops(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))
    inputs = _split_inputs(96, 160, 8, 2)
    with Ops() as ops:
        eager = prefix_causal_attention(*inputs)
    assert ops.names.count("aten._scaled_dot_product_flash_attention") == 2 and "aten.cat" not in ops.names
    comp_in = [t.detach().requires_grad_() for t in inputs]
    compiled = torch.compile(prefix_causal_attention, fullgraph=True)(*comp_in)
    torch.testing.assert_close(compiled, eager, atol=1e-2, rtol=1e-2)
    g_e = torch.autograd.grad(eager.float().sum(), inputs)
    g_c = torch.autograd.grad(compiled.float().sum(), comp_in)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_triton_op_compiles_inside_inductor_on_cuda():
    # the triton_op (not the opaque op) inside an Inductor graph: its float scale arrives
    # fp64 there (tests/chunk_attention/test_triton_fp64_args.py); fp32 inputs, which flash does not run
    from sppo_fx.chunk_attention.op import chunk_attention
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, 4, 64, 32, device=DEV, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 160, 32, device=DEV, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 160, 32, device=DEV, generator=g, requires_grad=True)
    eager = chunk_attention(q, k, v)
    compiled = torch.compile(chunk_attention, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(compiled.sum(), (q, k, v)), torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_nccl_world_size_one_collectives_on_device(monkeypatch):
    import socket
    import torch.distributed as dist
    from sppo_fx.runtime import distributed
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    rank, world = distributed.init_from_env(60, backend="nccl")
    try:
        assert (rank, world) == (0, 1) and torch.cuda.current_device() == 0
        assert distributed.collective_device() == torch.device("cuda", 0)
        assert distributed._gather_json({"plan": "x"}, 1, 30.0) == [{"plan": "x"}]  # fingerprint exchange
        t = torch.ones(3, device=distributed.collective_device())
        dist.all_reduce(t)  # the replica sums and tied-gradient tensors are device tensors too
        torch.cuda.synchronize()
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
