"""The activation store (sppo_fx/runtime/store/): tiers, ordering, failures, autograd, RSS."""
from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import sppo_fx.runtime.store.disk as store_mod
from sppo_fx.errors import SppoError
from sppo_fx.runtime.store import ActivationStore, StoreError, StoreReadError, StoreWriteError


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 4, generator=g)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(5, 7, generator=g).t(),                       # transposed (dense, permuted)
        base.permute(2, 0, 1),                                    # permuted 3-d
        base[:, ::2, 1:3],                                        # strided view with gaps
        torch.randn(3, 1, generator=g).expand(3, 4),              # expanded (stride 0)
        torch.empty(0, 3),                                        # 0-size
        torch.empty(4, 0, 2).transpose(0, 2),                     # 0-size, transposed
        torch.tensor(3.5),                                        # 0-dim
        torch.arange(20, dtype=torch.int64)[3:17:2],              # int64 slice
        torch.randn(7, 3, generator=g).to(torch.bfloat16),
        torch.randn(2, 9, generator=g).to(torch.float16),
        torch.randn(3, 3, generator=g, dtype=torch.float64),
        torch.rand(11, generator=g) > 0.5,                        # bool
        torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        torch.randn(2, 3, generator=g, dtype=torch.complex64),
        torch.full((4,), float("nan")),                           # NaN payloads stay bitwise
    ]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    ac, bc = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(ac, bc)
    return torch.equal(ac.view(torch.uint8), bc.view(torch.uint8))


@pytest.mark.parametrize("tier", ["disk", "host", "device"])
def test_round_trip_bitwise(tier, tmp_path):
    with ActivationStore(tier, dir=str(tmp_path)) as store:
        ts = _tensors()
        hs = [store.offload(t) for t in ts]
        for i, h in enumerate(hs):
            if i % 2:
                store.prefetch(h)
        for t, h in zip(ts, hs):
            out = store.wait(h)
            assert _bitwise_equal(out, t), (t, out)
            assert store.wait(h) is out                      # repeated waits: same tensor
            if tier == "disk" and store_mod._dense(t):
                assert out.stride() == t.stride()            # layout kept for dense tensors
        if tier == "disk":
            assert os.listdir(store.dir) == []               # every file removed once read back


def test_disk_store_drops_reference_after_write(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        t = torch.randn(1000)
        h = store.offload(t)
        store.synchronize()
        assert h.state == "stored"
        assert h._rec.src is None and h._rec.result is None  # no reference kept
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 4000
        assert len(os.listdir(store.dir)) == 1
        out = store.wait(h)
        assert torch.equal(out, t)
        assert store.bytes_on_device == 4000 and store.bytes_offloaded == 0
        assert store.peak_bytes_offloaded == 4000
        h.release()
        assert store.bytes_on_device == 0


def test_read_waits_for_write(tmp_path):
    """A prefetch issued while the write is held back must not read until the write is done."""
    gate = threading.Event()
    reads = []

    def hook(what):
        if what == "write":
            assert gate.wait(10)
        else:
            reads.append(time.monotonic())

    with ActivationStore("disk", dir=str(tmp_path)) as store:
        store.delay_hook = hook
        t = torch.randn(257, 3)
        h = store.offload(t)
        store.prefetch(h)
        time.sleep(0.1)
        assert h.state == "writing" and not reads and os.listdir(store.dir) == []
        released_at = time.monotonic()
        gate.set()
        out = store.wait(h)
        assert reads and reads[0] >= released_at
        assert _bitwise_equal(out, t)


def test_settle_waits_for_a_released_handles_read(tmp_path):
    """A prefetch whose handle is released before its read ends (a saved tensor the backward
    freed unread) holds its read-back bytes until the read ends: settle waits for it, so the
    counters then hold no bytes (the fuzz harness's "every byte came back" check raced it)."""
    gate = threading.Event()

    def hook(what):
        if what == "read":
            assert gate.wait(10)

    with ActivationStore("disk", dir=str(tmp_path)) as store:
        store.delay_hook = hook
        h = store.offload(torch.randn(592))
        store.synchronize()
        store.prefetch(h)
        h.release()
        del h
        threading.Timer(0.2, gate.set).start()
        store.settle()
        assert store.bytes_on_device + store.bytes_offloaded == 0
        assert os.listdir(store.dir) == []


def test_stress_many_concurrent_handles_with_slow_copies(tmp_path):
    rng = random.Random(1234)

    def slow(what):
        time.sleep(rng.random() * 0.003)

    with ActivationStore("disk", dir=str(tmp_path), workers=3) as store:
        store.delay_hook = slow
        g = torch.Generator().manual_seed(7)
        expected, handles = [], []
        for i in range(240):
            n = rng.choice([0, 1, 17, 1000, 4096, 20000])
            t = torch.randn(n, generator=g).mul_(i)
            if i % 3 == 0:
                t = t.to(torch.bfloat16)
            expected.append(t.clone())
            handles.append(store.offload(t))
            del t                                             # only the store may hold it now
            if rng.random() < 0.3:                            # prefetch some while writes are pending
                store.prefetch(handles[rng.randrange(len(handles))])
        order = list(range(len(handles)))
        rng.shuffle(order)
        for k in order[: len(order) // 2]:
            store.prefetch(handles[k])
        for k in order:
            assert _bitwise_equal(store.wait(handles[k]), expected[k]), k
        assert os.listdir(store.dir) == []


def test_failing_write_raises_clear_error(tmp_path, monkeypatch):
    def broken(path, view, overwrite=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod, "_write_bytes", broken)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        h = store.offload(torch.randn(64))
        with pytest.raises(StoreWriteError) as err:
            store.wait(h)
        assert isinstance(err.value, SppoError)
        assert "No space left on device" in str(err.value) and "offloading tensor" in str(err.value)
        with pytest.raises(StoreWriteError):
            store.prefetch(h)                                # the same handle keeps failing
        # an error nobody waited for surfaces at the next store call
        h2 = store.offload(torch.randn(8))
        deadline = time.monotonic() + 10
        while h2.state != "failed" and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(StoreWriteError):
            store.offload(torch.randn(8))
        assert store.bytes_on_device == 0 and store.bytes_offloaded == 0


def test_a_released_handles_failed_write_does_not_fail_later_calls(tmp_path, monkeypatch):
    """A failing step releases its handles while their writes still run (the race CI hit):
    `settle` waits those writes out, their files are gone, and their errors stay with them."""
    gate = threading.Event()

    def broken(path, view, overwrite=False):
        gate.wait(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod, "_write_bytes", broken)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        h = store.offload(torch.randn(64))
        assert h.state == "writing"
        store.release(h)                                     # the failing step drops it
        gate.set()                                           # ... and then its write fails
        store.settle()
        assert h._rec.error is not None, "the write never failed: the test would prove nothing"
        assert os.listdir(store.dir) == []
        monkeypatch.setattr(store_mod, "_write_bytes", lambda *a, **k: None)
        store.offload(torch.randn(8))                        # the next step starts cleanly
        store.synchronize()


def test_failing_read_raises_clear_error(tmp_path, monkeypatch):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        h = store.offload(torch.randn(100))
        store.synchronize()
        (name,) = os.listdir(store.dir)
        with open(os.path.join(store.dir, name), "r+b") as f:
            f.truncate(10)                                   # a damaged file
        with pytest.raises(StoreReadError, match="ended after 10 of 400 bytes"):
            store.wait(h)

        def broken(path, view, exact=True):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(store_mod, "_read_bytes", broken)
        h2 = store.offload(torch.randn(10))
        with pytest.raises(StoreReadError, match="Input/output error"):
            store.wait(h2)


def test_temp_files_removed_on_release_close_and_gc(tmp_path):
    store = ActivationStore("disk", dir=str(tmp_path))
    d = store.dir
    hs = [store.offload(torch.randn(100)) for _ in range(4)]
    store.synchronize()
    assert len(os.listdir(d)) == 4
    hs[0].release()
    assert len(os.listdir(d)) == 3
    del hs[1]
    gc.collect()
    assert len(os.listdir(d)) == 2                           # a dropped handle takes its file along
    store.close()
    assert not os.path.exists(d) and store.closed
    with pytest.raises(StoreError, match="closed"):
        store.offload(torch.randn(2))

    store = ActivationStore("disk", dir=str(tmp_path))
    d = store.dir
    h = store.offload(torch.randn(100))
    del h, store
    gc.collect()
    assert not os.path.exists(d)                             # garbage collection removes the dir
    assert os.listdir(tmp_path) == []


def test_unknown_tier():
    with pytest.raises(SppoError, match="disk"):
        ActivationStore("nvram")


def _mlp_grads(store=None, scope_prefetch=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    if store is None:
        loss = model(x).pow(2).mean()
    else:
        with store.scope() as scope, store.saved_tensor_hooks(min_bytes=0, keep_leaves=False):
            loss = model(x).pow(2).mean()
        assert len(scope.handles) > 5 and scope.nbytes > 0
        if scope_prefetch:
            scope.prefetch()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("scope_prefetch", [False, True])
def test_saved_tensor_hooks_bitwise_grads(tmp_path, scope_prefetch):
    ref = _mlp_grads()
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        got = _mlp_grads(store, scope_prefetch)
        assert store.peak_bytes_offloaded > 0
        assert os.listdir(store.dir) == []                   # backward consumed every file
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_saved_tensor_hooks_keep_small_and_leaves(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        w = torch.randn(8, 8, requires_grad=True)
        with store.scope() as scope, store.saved_tensor_hooks(min_bytes=1024):
            y = (torch.randn(4, 8) @ w).sum() + (torch.randn(64, 8) @ w).sum()
        # w is a leaf that requires grad (kept); the 4x8 input is below min_bytes
        assert [tuple(h.shape) for h in scope.handles] == [(64, 8)]
        y.backward()
        assert w.grad is not None


def test_chunk_program_grads_bitwise_through_disk(tmp_path):
    """The GPT chunk program's gradients are bitwise the same with saved tensors on disk."""
    from sppo_fx.capture import capture
    from sppo_fx.models import build
    from sppo_fx.passes import transform
    from sppo_fx.passes.cost import example_inputs

    model = build("gpt", "tiny")
    x = torch.randint(0, 97, (2, 16))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    _, program = transform(cap)

    def grads(store):
        args = example_inputs(program, 24, 40, seq=cap.seq, seed=3)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if store is None:
            outs = program.chunk(*args)
        else:
            with store.saved_tensor_hooks():
                outs = program.chunk(*args)
        total = sum(o.float().sum() * (i + 1) for i, o in enumerate(outs) if o.is_floating_point())
        return torch.autograd.grad(total, leaves)

    ref = grads(None)
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        got = grads(store)
        assert store.peak_bytes_offloaded > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from sppo_fx.runtime.store import ActivationStore
    torch.set_num_threads(1)
    mode, d = sys.argv[1], sys.argv[2]
    kept = []
    with ActivationStore("disk", dir=d) as store:
        for i in range(8):
            t = torch.full((16 << 20,), float(i))             # 64 MiB, pages touched
            if mode == "offload":
                h = store.offload(t)
                del t
                store.synchronize()                           # the write is done: memory freed
                kept.append(h)
            else:
                kept.append(t)
                del t
        if mode == "offload":                                 # bring one back to check it
            assert float(store.wait(kept[3])[123]) == 3.0
    with open("/proc/self/status") as f:
        hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    print(hwm * 1024)
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_peak_rss_drops_with_disk_offload(tmp_path):
    def peak(mode):
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, mode, str(tmp_path)], check=True,
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])

    keep, offload = peak("keep"), peak("offload")
    MiB = 1 << 20
    # keep holds 8 x 64 MiB; offload holds at most ~1-2 tensors at a time (+ one read back)
    assert keep - offload > 256 * MiB, (keep / MiB, offload / MiB)
    assert os.listdir(tmp_path) == []


def test_pooled_files_are_overwritten_and_removed_at_close(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path), reuse_files=True) as store:
        d = store.dir
        first = [torch.randn(1000) for _ in range(3)]
        hs = [store.offload(t) for t in first]
        store.synchronize()
        assert len(os.listdir(d)) == 3
        for h, t in zip(hs, first):
            assert torch.equal(store.wait(h), t)
            h.release()
        assert len(os.listdir(d)) == store.pooled_files == 3  # read back: the files wait in the pool
        # smaller tensors reuse them (a file of at most twice the bytes); a larger one
        # gets a new file, which replaces the oldest pooled one
        second = [torch.randn(900), torch.randn(600), torch.randn(5000)]
        hs = [store.offload(t) for t in second]
        store.synchronize()
        assert len(os.listdir(d)) == 3 and store.pooled_files == 0
        for h, t in zip(hs, second):
            assert torch.equal(store.wait(h), t)  # a reused file is longer than what it holds now
            h.release()
        # the pool stays within the most bytes the tier held at once
        assert store.pooled_bytes <= store.peak_bytes_offloaded
    assert not os.path.exists(d)


def _read_back(store, t):
    h = store.offload(t)
    out = store.wait(h)
    store.release(h)
    return out


def test_read_buffers_recycled_once_the_reader_lets_go(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path), reuse_files=True) as store:
        store.recycle_read_buffers(1 << 20)
        a, b, c = (torch.randn(64, 64) for _ in range(3))
        x = _read_back(store, a)
        ptr = x.data_ptr()
        y = _read_back(store, b)  # x is still alive: its memory is not handed out again
        assert y.data_ptr() != ptr and torch.equal(x, a) and torch.equal(y, b)
        del x
        z = _read_back(store, c)  # x is gone: its memory serves the next read of its size
        assert z.data_ptr() == ptr and torch.equal(z, c) and torch.equal(y, b)
        assert store.read_buffer_bytes == 2 * a.numel() * 4
        del y, z
        store.trim_read_buffers()
        assert store.read_buffer_bytes == 0


def test_read_buffers_keep_layout_and_stay_within_their_limit(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path), reuse_files=True) as store:
        t = torch.randn(48, 32).t()  # transposed: comes back with the same strides
        store.recycle_read_buffers(t.numel() * 4 * 3 // 2)
        outs = [_read_back(store, t) for _ in range(3)]  # all alive: one pooled, two fresh
        assert all(o.stride() == t.stride() and torch.equal(o, t) for o in outs)
        assert store.read_buffer_bytes == t.numel() * 4
        assert len({o.data_ptr() for o in outs}) == 3


def test_read_buffers_off_by_default(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        x = _read_back(store, torch.randn(32, 32))
        del x
        assert store.read_buffer_bytes == 0


def test_a_read_larger_than_the_limit_leaves_the_pool_alone(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path), reuse_files=True) as store:
        small = torch.randn(32, 32)
        store.recycle_read_buffers(small.numel() * 4)
        x = _read_back(store, small)
        ptr = x.data_ptr()
        del x
        src = torch.randn(64, 64)
        big = _read_back(store, src)  # over the limit: a fresh buffer
        assert torch.equal(big, src) and big.data_ptr() != ptr
        assert store.read_buffer_bytes == small.numel() * 4
        assert _read_back(store, small).data_ptr() == ptr
