"""Disk faults: a full disk during offload, a corrupted or truncated offload file, and the
leftover files of a killed process (issue: faults survived, nothing half-done)."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest
import torch

import sppo_fx
import sppo_fx.runtime.store.disk as disk
from sppo_fx.models import build
from sppo_fx.runtime.store import ActivationStore
from sppo_fx.runtime.store.records import StoreReadError, StoreWriteError


def _files(d):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)


@pytest.mark.slow
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "inductor"])
def test_full_disk_mid_step_fails_cleanly_and_the_next_step_works(tmp_path, monkeypatch, compile_):
    model = build("llama", "tiny", n_layers=1)  # one block: 8 offloads a step, each block more is compile time
    x, y = (torch.randint(0, 97, (1, 1024)) for _ in range(2))
    compiled = sppo_fx.compile(model, chunks=4, offload="disk", offload_dir=str(tmp_path), compile=compile_)
    # a reference step without faults, whose gradients stay in .grad (the failing step must
    # leave them exactly as they are: no half-accumulated gradients)
    ref = compiled(x, y)
    ref.backward()
    before = [p.grad.clone() for p in model.parameters()]
    writes, real_write = [], disk._write_bytes

    def full_after_three(path, view, overwrite=False):
        writes.append(path)
        if len(writes) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(path, view, overwrite)

    monkeypatch.setattr(disk, "_write_bytes", full_after_three)
    with pytest.raises(StoreWriteError, match="No space left on device.*check free space"):
        compiled(x, y).backward()
    assert len(writes) > 3, "the fault was never injected: the test would prove nothing"
    assert _files(tmp_path) == [], "a failed step left offload files behind"
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g), "the failed step changed a gradient"
    monkeypatch.setattr(disk, "_write_bytes", real_write)  # space freed
    model.zero_grad(set_to_none=True)
    loss = compiled(x, y)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def _stored(tmp_path, n=3 << 20):
    store = ActivationStore("disk", dir=str(tmp_path))
    t = torch.arange(n // 4, dtype=torch.float32)
    h = store.offload(t)
    store.synchronize()
    (path,) = _files(tmp_path)
    return store, h, t, path


def test_an_intact_file_reads_back(tmp_path):
    store, h, t, _ = _stored(tmp_path)
    assert torch.equal(store.wait(h), t)
    store.close()


@pytest.mark.parametrize("offset", [0, (1 << 20) + 100, (3 << 20) - 1], ids=["start", "second-mib", "end"])
def test_a_corrupted_offload_file_is_detected_on_read(tmp_path, offset):
    store, h, _, path = _stored(tmp_path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(StoreReadError, match="checksum mismatch"):
        store.wait(h)
    store.close()


def test_a_truncated_offload_file_is_detected_on_read(tmp_path):
    store, h, _, path = _stored(tmp_path)
    os.truncate(path, 1000)
    with pytest.raises(StoreReadError, match="ended after 1000"):
        store.wait(h)
    store.close()


@pytest.mark.slow
def test_leftovers_of_a_killed_process_are_swept_and_only_those(tmp_path):
    code = (f"import os, torch; from sppo_fx.runtime.store import ActivationStore\n"
            f"s = ActivationStore('disk', dir={str(tmp_path)!r}); h = s.offload(torch.ones(1 << 16)); s.synchronize()\n"
            f"os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -9
    (leftover,) = [d for d in os.listdir(tmp_path)]
    assert _files(tmp_path / leftover), "the killed process wrote no file: the test would prove nothing"
    other_host = tmp_path / "sppo_store_another-host_1_abc"
    other_host.mkdir()
    live = ActivationStore("disk", dir=str(tmp_path))  # sweeps on creation
    names = set(os.listdir(tmp_path))
    assert leftover not in names
    assert other_host.name in names  # another host's pids mean nothing here
    assert os.path.basename(live.dir) in names
    assert os.path.basename(live.dir).startswith(f"sppo_store_{socket.gethostname()}_{os.getpid()}_")
    # a live process's store is never swept
    assert disk.sweep_leftovers(str(tmp_path)) == []
    live.close()
