"""Security (issue 31): caches hold data, not code, and are read only from directories of
this user that no one else can write; stores listen on the address they were given; peers'
data is never unpickled; the leftover sweep removes only what it may; the examples load
checkpoints as data. Each test plants what an attacker (or a bad file) would."""
from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import stat
import subprocess
import sys
import time

import pytest
import sympy
import torch
import torch.distributed as dist

from sppo_fx.util import disk_cache
from sppo_fx.errors import SppoError
from sppo_fx.passes.cost import saved_cache
from sppo_fx.runtime.store import disk
from sppo_fx.solver import profile_cache
from sppo_fx.solver.profiles import DeviceProfile, get_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Plant:
    """Unpickling it creates the file `marker` (what a planted cache file could do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh SPPO_FX_CACHE_DIR (not yet created) and no warnings given yet."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(root))
    monkeypatch.delenv("SPPO_FX_MEMORY_MODEL_CACHE", raising=False)
    monkeypatch.delenv("SPPO_FX_PROFILE_CACHE", raising=False)
    monkeypatch.setattr(disk_cache, "_warned", set(), raising=False)
    saved_cache.forget()
    yield root
    saved_cache.forget()


KEY = {"device": {"type": "cpu"}, "recomputes": ["none"], "format": saved_cache.FORMAT}


def test_a_planted_pickle_in_the_memory_model_cache_runs_no_code(cache, tmp_path, caplog):
    path = saved_cache._path(KEY)
    marker = tmp_path / "owned"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"key": KEY, "saved": _Plant(str(marker)), "example": [1, 0]}, f)
    with caplog.at_level(logging.WARNING, logger="sppo_fx"):
        assert saved_cache._lookup(path, KEY) is None
    assert not marker.exists(), "reading the cache ran the planted code"
    assert path in caplog.text and "ignoring the stored memory model" in caplog.text


def test_the_memory_model_round_trips_through_json_and_refuses_anything_else():
    from sppo_fx.passes.cost.data import AllocatedTensor, SavedTensor, b, c, p
    x = sympy.Symbol("x", positive=True)
    exprs = [3, sympy.Integer(7), sympy.Rational(3, 4) * c + p, sympy.floor(c / 3) + sympy.Max(c, p) * b ** 2,
             c * (p + c) * 4, x + 1]
    saved = [SavedTensor(f"t{i}", (b, e), torch.bfloat16, sympy.Integer(2) * e if i else e, 2, "activation",
                         ("a", "b"), i % 2 == 0) for i, e in enumerate(exprs)]
    allocated = (AllocatedTensor(4 * c * b, False, True, 3), AllocatedTensor(sympy.Integer(256), True, False))
    key = {"recomputes": ["none"], "k": (1, 2)}
    text = saved_cache._encode_result(key, ({"none": saved}, (8, 0), {"none": allocated}))
    by_policy, example, allocs = saved_cache._decode_result(json.loads(text), key)
    assert example == (8, 0) and allocs == {"none": allocated}
    for got, want in zip(by_policy["none"], saved):
        assert got == want and [type(v) for v in got.shape_expr] == [type(v) for v in want.shape_expr]
    assert by_policy["none"][-1].shape_expr[1].free_symbols == {x}  # the symbol's assumptions kept
    # a file can only name the few known functions, symbols and integers: no code, no eval
    data = json.loads(text)
    for bad in ({"f": "__import__", "args": ["os"]}, {"s": "x", "a": {"evil": True}}, "c + p", 1.5, True,
                {"i": "1"}, {"q": [1, 0]}):
        data["saved"]["none"][0]["bytes"] = bad
        with pytest.raises(ValueError):
            saved_cache._decode_result(data, key)
    data = json.loads(text)
    for field, bad in (("dtype", "nn"), ("dtype", "Tensor"), ("level", 3), ("kind", "exec"), ("aliases", [1]),
                       ("exact", "yes")):
        entry = dict(json.loads(text)["saved"]["none"][0], **{field: bad})
        data["saved"]["none"][0] = entry
        with pytest.raises(ValueError):
            saved_cache._decode_result(data, key)
    with pytest.raises(ValueError, match="example"):
        saved_cache._decode_result(dict(json.loads(text), example=[-1, 0]), key)
    for field, bad in (("bytes", {"f": "eval", "args": []}), ("backward", 1), ("matmul", "no"), ("count", 0),
                       ("count", 1.5)):
        data = json.loads(text)
        data["allocated"]["none"][0][field] = bad
        with pytest.raises(ValueError):
            saved_cache._decode_result(data, key)
    with pytest.raises(ValueError, match="allocated"):
        saved_cache._decode_result(dict(json.loads(text), allocated={"full": []}), key)


def test_cache_directories_are_created_private(cache, monkeypatch):
    old = os.umask(0o022)
    try:
        assert saved_cache._path(KEY) is not None
        profile_cache._write(os.path.join(profile_cache.cache_dir(), "x.json"), {"k": 1}, get_profile("h100"))
    finally:
        os.umask(old)
    for d in (cache, cache / "memory_model", cache / "profiles"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    written = cache / "profiles" / "x.json"
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600


def _stub_calibration(monkeypatch):
    calls = []
    measured = DeviceProfile("measured", 1e9, 1e9, 1e9, 1e9, 1e9, 1 << 30)
    monkeypatch.setattr(profile_cache, "calibrate", lambda *a, **k: calls.append(a) or measured)
    monkeypatch.setattr(profile_cache, "others_runnable", lambda: None)
    return calls


def _plant_profile(**fields):
    key = profile_cache.profile_key("cpu")
    path = profile_cache._path(key)
    planted = dict(get_profile("h100").to_dict(), name="planted", **fields)
    profile_cache._write(path, key, DeviceProfile(**planted))
    with open(path) as f:  # write the values as given (the writer keeps what it is handed)
        data = json.load(f)
    data["profile"].update(fields)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


@pytest.mark.parametrize("how", ["group-writable", "other-writable", "another owner"])
def test_a_cache_directory_others_can_write_is_not_read(cache, monkeypatch, caplog, how):
    calls = _stub_calibration(monkeypatch)
    _plant_profile()
    assert profile_cache.device_profile("cpu").name == "planted"  # readable while the directory is private
    if how == "another owner":
        me = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: me + 4242)
    else:
        os.chmod(cache / "profiles", 0o770 if how == "group-writable" else 0o707)
    with caplog.at_level(logging.WARNING, logger="sppo_fx"):
        for _ in range(2):
            got = profile_cache.device_profile("cpu")
            assert got.name == "measured", "a profile was read from a directory someone else can write"
    assert len(calls) == 2
    warnings = [r.getMessage() for r in caplog.records if "not using" in r.getMessage()]
    assert len(warnings) == 1, warnings  # warned once
    why = "belongs to user id" if how == "another owner" else "writable by group or others"
    assert str(cache) in warnings[0] and why in warnings[0], warnings
    assert len(list((cache / "profiles").iterdir())) == 1  # the planted file: nothing written there either


def test_a_cache_root_others_can_write_is_not_used(cache, monkeypatch, caplog):
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    with caplog.at_level(logging.WARNING, logger="sppo_fx"):
        assert saved_cache._path(KEY) is None
    assert str(cache) in caplog.text and "writable by group or others" in caplog.text


@pytest.mark.parametrize("fields", [{"flops_per_s": 0}, {"flops_per_s": float("inf")}, {"flops_per_s": float("nan")},
                                    {"d2h_bytes_per_s": -1}, {"disk_read_bytes_per_s": "fast"},
                                    {"memory_bytes": 1.5}, {"memory_bytes": 0}, {"n_half": -3},
                                    {"disk_cached_write_bytes_per_s": 0}, {"disk_cache_bytes": -1}])
def test_a_stored_profile_with_a_bad_value_is_a_miss_naming_the_file(cache, monkeypatch, caplog, fields):
    calls = _stub_calibration(monkeypatch)
    path = _plant_profile(**fields)
    with caplog.at_level(logging.WARNING, logger="sppo_fx"):
        got = profile_cache.device_profile("cpu")
    assert got.name == "measured" and len(calls) == 1
    assert f"ignoring the stored device profile {path}" in caplog.text and next(iter(fields)) in caplog.text
    with pytest.raises(SppoError, match=next(iter(fields))):
        DeviceProfile.from_dict(dict(get_profile("h100").to_dict(), **fields))


def test_inductor_cache_directory_is_private_or_replaced(tmp_path, monkeypatch, caplog):
    fresh = tmp_path / "inductor" / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh))
    assert disk_cache.secure_inductor_cache() == str(fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700 == stat.S_IMODE(os.stat(fresh.parent).st_mode)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    with caplog.at_level(logging.WARNING, logger="sppo_fx"):
        import sppo_fx
        from sppo_fx.models import build
        sppo_fx.compile(build("gpt", "tiny"), chunks=2)  # checks it before anything compiles
    used = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert used != str(shared) and disk_cache.unsafe_reason(used) is None
    assert str(shared) in caplog.text and "writable by group or others" in caplog.text
    os.rmdir(used)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                addr, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_the_local_launch_store_listens_on_loopback_only():
    from sppo_fx.runtime.launch import start_local_ranks
    procs = start_local_ranks([sys.executable, "-c", "pass"], 1)
    try:
        assert _listening(procs.store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or [::]
        procs.store.set("k", "v")
        assert procs.store.get("k") == b"v"
    finally:
        for p in procs:
            p.communicate(timeout=60)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_a_store_rank_zero_serves_listens_on_master_addr_only(monkeypatch):
    from sppo_fx.runtime.distributed import _served_store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = _served_store(5.0)
    assert _listening(port) == ["0100007F"]
    del store


@pytest.fixture
def one_rank():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fingerprints_are_exchanged_without_pickles(one_rank, monkeypatch):
    from sppo_fx.runtime import distributed
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("a pickle exchange"))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: pytest.fail("a pickle exchange"))
    distributed.check_agreement({"model graph": "abc", "plan": "é"}, 0, 1, timeout_s=5)
    for bad in (float("inf"), 0, -1, float("nan"), "5", True):
        with pytest.raises(SppoError, match="timeout_s"):
            distributed.check_agreement({"a": "b"}, 0, 1, timeout_s=bad)


WAITER = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
from sppo_fx.errors import SppoError
from sppo_fx.runtime.distributed import check_agreement, init_from_env
rank, world = init_from_env(600)  # the group's own timeout is long: the exchange must use its own
if rank == 1:
    time.sleep(40)
    sys.exit(0)
t0 = time.monotonic()
try:
    check_agreement({{"a": "b"}}, rank, world, timeout_s=2)
except SppoError as e:
    print("refused after", time.monotonic() - t0, e)
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_the_fingerprint_exchange_waits_timeout_s_not_the_groups_timeout(tmp_path):
    from sppo_fx.runtime.launch import start_local_ranks
    script = tmp_path / "waiter.py"
    script.write_text(WAITER.format(root=ROOT))
    procs = start_local_ranks([sys.executable, str(script)], 2)
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert "refused after" in out, err[-2000:]
    waited = float(out.split()[2])
    assert 2 <= waited < 20, out
    assert "timed out after 2 s (timeout_s)" in out


# ------------------------------------------------------------------ the leftover sweep

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_sweep_removes_only_this_users_real_leftovers_of_this_host(tmp_path, monkeypatch):
    dead = _dead_pid()
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    mine = tmp_path / f"sppo_store_vm_{dead}_ab_cd123"
    live = tmp_path / f"sppo_store_vm_{os.getpid()}_abcdefgh"
    # host `vm_<dead pid>` shares the prefix: parsed after `sppo_store_vm_` its pid would read as `dead`
    other_host = tmp_path / f"sppo_store_vm_{dead}_{os.getpid()}_abcdefgh"
    not_a_store = tmp_path / f"sppo_store_vm_{dead}_x"
    target = tmp_path / "elsewhere"
    link = tmp_path / f"sppo_store_vm_{dead}_linkdir1"
    for d in (mine, live, other_host, not_a_store, target):
        d.mkdir()
        (d / "f").write_bytes(b"1")
    link.symlink_to(target, target_is_directory=True)
    removed = disk.sweep_leftovers(str(tmp_path))
    assert removed == [str(mine)]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(p.name for p in (live, other_host, not_a_store, target, link))
    assert (target / "f").exists(), "the sweep followed a link"


def test_the_sweep_leaves_another_users_directory(tmp_path, monkeypatch):
    dead = _dead_pid()
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    theirs = tmp_path / f"sppo_store_vm_{dead}_abcdefgh"
    theirs.mkdir()
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 4242)  # the directory now belongs to someone else
    assert disk.sweep_leftovers(str(tmp_path)) == []
    assert theirs.exists()


def test_the_sweep_reports_only_what_it_removed(tmp_path, monkeypatch):
    dead = _dead_pid()
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    stuck = tmp_path / f"sppo_store_vm_{dead}_abcdefgh"
    stuck.mkdir()
    monkeypatch.setattr(disk.shutil, "rmtree", lambda *a, **k: None)  # a removal that fails quietly
    assert disk.sweep_leftovers(str(tmp_path)) == []


# ------------------------------------------------------------------ examples

def test_the_example_loads_checkpoints_as_data_only(tmp_path):
    import argparse
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_hf
    finally:
        sys.path.pop(0)
    marker = tmp_path / "owned"
    path = tmp_path / "ckpt.pt"
    torch.save({"model": _Plant(str(marker)), "optimizer": {}, "step": 0, "config": {}, "losses": []}, path)
    with pytest.raises(pickle.UnpicklingError):
        train_hf.check_reload(str(path), None, None, argparse.Namespace(attn_implementation=None, lr=1e-3))
    with pytest.raises(pickle.UnpicklingError):
        train_hf.main(["--corpus", str(tmp_path), "--resume", str(path), "--steps", "0"])
    assert not marker.exists(), "loading the checkpoint ran the planted code"
