"""The streamed K/V skeleton on disk: files and read tasks per step grow as N over N
chunks (not N^2), the result is exact, and a stream holds at most the two blocks the
memory model counts (runtime/skeleton_log.py)."""
from __future__ import annotations

import builtins
import os
import threading
import time

import pytest
import torch

from conftest import SHARES_OFFLOAD_PROGRAMS, offload_program, tiny_program

from sppo_fx import Plan
from sppo_fx.runtime import skeleton_log
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.runtime.skeleton import KVSkeleton
from sppo_fx.runtime.store import ActivationStore

TOKENS = 8  # per chunk


def _step(program, params, n, store, seed=0):
    torch.manual_seed(seed)
    x, y = torch.randint(0, 97, (2, n * TOKENS)), torch.randint(0, 97, (2, n * TOKENS))
    # the runtime runs the orchestrator's streamed program (compile_chunk), compiled once
    loss = chunked_loss(program, params, [x, y], Plan(n * TOKENS, [TOKENS] * n), offload_program(program, "offload"),
                        store=store, skeleton="offload")
    loss.backward()
    return loss.detach()


def _opens_per_step(monkeypatch, tmp_path, n):
    """Files opened under the store's dir in one training step of n chunks (only the
    skeleton goes to the store: no activation offload)."""
    model, cap, program = tiny_program("gpt")
    params = [cap.param_value(p) for p in program.params]
    opened = []
    (tmp_path / f"n{n}").mkdir()
    with ActivationStore("disk", dir=str(tmp_path / f"n{n}")) as store:
        real_open, real_os_open = builtins.open, os.open

        def count(path):
            if str(path).startswith(store.dir):
                opened.append(path)

        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (count(path), real_open(path, *a, **k))[1])
        monkeypatch.setattr(os, "open", lambda path, *a, **k: (count(path), real_os_open(path, *a, **k))[1])
        try:
            _step(program, params, n, store)
        finally:
            monkeypatch.undo()
        assert os.listdir(store.dir) == []  # the skeleton's file went with its last block
    return len(opened)


@SHARES_OFFLOAD_PROGRAMS
@pytest.mark.slow
def test_files_per_step_grow_at_most_linearly(monkeypatch, tmp_path):
    counts = {n: _opens_per_step(monkeypatch, tmp_path, n) for n in (4, 8, 16)}
    assert counts[4] > 0, counts
    # linear: doubling N at most doubles the files (N^2/2 block reads would quadruple them)
    assert counts[8] <= 2 * counts[4] and counts[16] <= 2 * counts[8], counts


def test_read_tasks_per_step_are_one_per_stream(tmp_path):
    """One in-order task per (chunk, site, pass), however many blocks each stream reads."""
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        for n in (4, 8, 16):
            sk = KVSkeleton(store, offload=True, num_chunks=n)
            blocks = {(s, j): torch.randn(1, 2, 3, 4) for s in (0, 1) for j in range(n)}
            for (s, j), t in blocks.items():
                sk.put(s, j, t)
            for _ in ("forward", "backward"):
                for i in range(n):
                    for j, (k_j, v_j) in enumerate(sk.stream(0, i)):
                        assert torch.equal(k_j, blocks[(0, j)]) and torch.equal(v_j, blocks[(1, j)])
            assert sk.log.streams == 2 * (n - 1)  # chunk 0 streams nothing
            assert sk.log.block_reads == n * (n - 1)  # the blocks themselves: N^2 by attention's nature
            assert sk.log.files_opened == 1
            for j in reversed(range(n)):
                sk.release(j)
            assert os.listdir(store.dir) == []


@SHARES_OFFLOAD_PROGRAMS
def test_streamed_skeleton_on_disk_is_bitwise_the_device_one_and_matches_eager(tmp_path):
    model, cap, program = tiny_program("gpt")
    params = [cap.param_value(p) for p in program.params]
    results = []
    for tier in ("device", "disk"):
        (tmp_path / tier).mkdir()
        with ActivationStore(tier, dir=str(tmp_path / tier)) as store:
            loss = _step(program, params, 8, store, seed=3)
            results.append((loss, [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
    (l_dev, g_dev), (l_disk, g_disk) = results
    assert torch.equal(l_dev, l_disk)
    for a, b in zip(g_dev, g_disk):
        assert torch.equal(a, b)
    torch.manual_seed(3)
    x, y = torch.randint(0, 97, (2, 8 * TOKENS)), torch.randint(0, 97, (2, 8 * TOKENS))
    ref = model(x, y)
    ref.backward()
    torch.testing.assert_close(l_disk, ref.detach(), rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), g_disk):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_a_stream_reads_at_most_two_blocks_ahead_of_its_consumer(monkeypatch, tmp_path):
    """The memory model's stream buffer is two blocks (K and V) of one site: the block in
    use and the next one. A slow consumer must not let the reader run further ahead."""
    monkeypatch.setattr(skeleton_log, "INLINE_READ_BYTES", 0)  # these blocks are small: read ahead anyway
    log = skeleton_log.SkeletonLog(str(tmp_path))
    pairs = [(log.put(torch.full((2, 8), float(j))), log.put(torch.full((2, 8), -float(j)))) for j in range(8)]
    done, worst = [0], [0]
    lock = threading.Lock()
    real = os.preadv
    reads = [0]

    def preadv(fd, bufs, offset):
        with lock:
            pair = reads[0] // 2
            reads[0] += 1
            worst[0] = max(worst[0], pair - done[0] + 1)  # pairs alive: read, not yet let go
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    for j, (k, v) in enumerate(log.stream(pairs)):
        assert torch.equal(k, torch.full((2, 8), float(j))) and torch.equal(v, -k)
        time.sleep(0.02)  # the reader has time to run ahead, if it may
        del k, v
        with lock:
            done[0] += 1
    monkeypatch.undo()
    assert worst[0] == skeleton_log._AHEAD == 2, worst
    for a, b in pairs:
        log.drop(a)
        log.drop(b)
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.parametrize("inline_bytes, inline", [(1 << 20, True), (16, False)])
def test_small_cpu_blocks_are_read_inline(monkeypatch, tmp_path, inline_bytes, inline):
    """A stream of small CPU blocks preads each one when the consumer asks for it, in the
    consumer's thread (a handoff to the reader thread cost more than the read); one pair is
    alive at a time, and the bytes are the same."""
    monkeypatch.setattr(skeleton_log, "INLINE_READ_BYTES", inline_bytes)
    log = skeleton_log.SkeletonLog(str(tmp_path))
    pairs = [(log.put(torch.full((2, 8), float(j))), log.put(torch.full((2, 8), -float(j)))) for j in range(4)]
    threads = set()
    real = os.preadv

    def preadv(fd, bufs, offset):
        threads.add(threading.get_ident())
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    for j, (k, v) in enumerate(log.stream(pairs)):
        assert torch.equal(k, torch.full((2, 8), float(j))) and torch.equal(v, -k)
    monkeypatch.undo()
    assert (threads == {threading.get_ident()}) == inline, threads
    assert log.block_reads == 4
    for a, b in pairs:
        log.drop(a)
        log.drop(b)
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.parametrize("inline_bytes", [1 << 20, 0], ids=["inline", "read-ahead"])
def test_a_changed_file_is_refused_at_its_read(monkeypatch, tmp_path, inline_bytes):
    monkeypatch.setattr(skeleton_log, "INLINE_READ_BYTES", inline_bytes)
    log = skeleton_log.SkeletonLog(str(tmp_path))
    a = log.put(torch.arange(4096.0))
    a.written.result()
    os.truncate(log.path, 100)
    with pytest.raises(Exception, match="does not hold"):
        list(log.stream([(a,)]))
    log.close()
    assert os.listdir(str(tmp_path)) == []
