"""`runtime.memory.CopyWindow`: offload copies in flight stay within the plan's window."""
import os
import time

import pytest
import torch

from sppo_fx.runtime.memory import ChunkMemory, CopyWindow
from sppo_fx.runtime.store import ActivationStore

KIB = 1024


def _tensors(n, nbytes=4 * KIB):
    return [torch.full((nbytes // 4,), float(i)) for i in range(n)]


def _offloaded(store, window_bytes, n, nbytes=4 * KIB):
    """(window, a ChunkMemory using it, the n tensors it offloaded into slots 0..n-1)."""
    window = CopyWindow(store, window_bytes)
    memory = ChunkMemory(store, min_bytes=0, window=window)
    data = _tensors(n, nbytes)
    for slot, t in enumerate(data):
        memory.offload(t, slot)
    return window, memory, data


def test_writes_pending_never_exceed_the_window(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        store.delay_hook = lambda what: time.sleep(0.02) if what == "write" else None
        window = CopyWindow(store, 8 * KIB)
        memory = ChunkMemory(store, min_bytes=0, window=window)
        pending = []
        for slot, t in enumerate(_tensors(8)):
            memory.offload(t, slot)
            pending.append(store.pending_write_bytes)
        assert max(pending) <= 8 * KIB
        assert max(pending) > 0  # the slowed writes did lag: the bound did the work
        memory.release()


def test_reads_start_last_produced_first_and_stay_within_the_window(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        window, memory, data = _offloaded(store, 8 * KIB, 6)
        store.synchronize()
        started = []
        real_prefetch = store.prefetch
        store.prefetch = lambda h: (started.append(h), real_prefetch(h))[1]
        memory.prefetch()  # the whole chunk, as the executor asks before its backward
        assert [memory.entries[s] for s in (5, 4)] == started  # two 4 KiB reads fit 8 KiB
        assert window.reading_bytes <= 8 * KIB
        for slot in (5, 4, 3, 2, 1, 0):  # backward consumes them in that order
            assert torch.equal(memory.wait(slot), data[slot])
            assert window.reading_bytes <= 8 * KIB
        # (store.wait calls prefetch again, a no-op for a started read)
        assert len({id(h) for h in started}) == 6 and not window.queue and window.reading_bytes == 0


def test_a_wait_on_a_slot_not_started_starts_it(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        window, memory, data = _offloaded(store, 0, 4)  # one read at a time
        memory.prefetch()
        assert len(window.reading) == 1 and len(window.queue) == 3
        assert torch.equal(memory.wait(0), data[0])  # last in the queue: started on demand
        assert torch.equal(memory.wait(3), data[3])
        memory.release()  # slots 1 and 2 never waited for: forgotten, files removed
        assert not window.queue and not window.reading
        deadline = time.monotonic() + 5  # a read already running removes its file when it ends
        while os.listdir(store.dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.listdir(store.dir) == []


def test_a_tensor_larger_than_the_window_still_goes_alone(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        window, memory, data = _offloaded(store, KIB, 2, nbytes=16 * KIB)
        memory.prefetch()
        assert len(window.reading) == 1
        assert torch.equal(memory.wait(1), data[1]) and torch.equal(memory.wait(0), data[0])


def test_a_failed_read_leaves_the_window_clean(tmp_path, monkeypatch):
    import sppo_fx.runtime.store.disk as store_mod
    from sppo_fx.runtime.store import StoreReadError

    with ActivationStore("disk", dir=str(tmp_path)) as store:
        window, memory, data = _offloaded(store, 0, 2)
        store.synchronize()

        def broken(path, view, exact=True):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(store_mod, "_read_bytes", broken)
        memory.prefetch()
        with pytest.raises(StoreReadError):
            memory.wait(1)
        assert window.reading_bytes == 0 or window.started(memory.entries[0])
        memory.release()
        assert not window.queue and not window.reading and window.reading_bytes == 0


def test_wait_for_the_whole_chunk_waits_only_for_started_reads(tmp_path):
    with ActivationStore("disk", dir=str(tmp_path)) as store:
        window, memory, data = _offloaded(store, 0, 3)
        memory.prefetch()
        memory.wait()  # a pipeline's WAIT action: the started read only
        assert len(window.reading) == 1 and len(window.queue) == 2
        assert [torch.equal(memory.wait(s), data[s]) for s in (2, 1, 0)] == [True] * 3
