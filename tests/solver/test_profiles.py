"""Device profiles (sppo_fx/solver/profiles.py): built-ins, efficiency curve, JSON, calibrate."""
from __future__ import annotations

import os

import pytest
import torch

from sppo_fx.errors import SppoError
from sppo_fx.solver import PROFILES, DeviceProfile, calibrate, get_profile, profiles_table
from sppo_fx.solver.allocation import PROBE_SIZES

GiB = 1 << 30


def _documented_table():
    """The module docstring's table: name -> (peak TFLOP/s, MFU-scaled TFLOP/s, PCIe GB/s,
    NVMe GB/s, memory GiB)."""
    import re

    import sppo_fx.solver.profiles as profiles
    rows = {}
    for line in profiles.__doc__.splitlines():
        m = re.match(r"\s+(\S+)\s+(\d+) TFLOP/s\s+(\d+) TFLOP/s\s+gen\d ~(\d+) GB/s\s+~(\d+) GB/s\s+([\d.]+) GiB", line)
        if m:
            rows[m.group(1)] = tuple(float(g) for g in m.groups()[1:])
    return rows


def test_builtin_profiles_match_their_documentation_and_each_other():
    """The built-ins agree with the table their module documents (so a changed figure is
    a documented one), each profile's source names the figures it was built from, and the
    generations relate as their spec sheets do."""
    table = _documented_table()
    assert set(table) == set(PROFILES)
    for name, (peak, scaled, pcie, nvme, mem_gib) in table.items():
        pr = get_profile(name)
        assert pr.flops_per_s == pytest.approx(scaled * 1e12, rel=0.01), name
        assert f"{peak:g} TFLOP/s" in pr.source and pr.flops_per_s < peak * 1e12, name
        assert pr.d2h_bytes_per_s == pr.h2d_bytes_per_s == pytest.approx(pcie * 1e9), name
        assert pr.disk_write_bytes_per_s == pr.disk_read_bytes_per_s == pytest.approx(nvme * 1e9), name
        assert pr.memory_bytes / GiB == pytest.approx(mem_gib, abs=0.05), name
    a100, h100, h200 = get_profile("a100-80gb"), get_profile("h100"), get_profile("h200")
    # the marketed capacity (80 GB, 141 GB) in decimal bytes is below what the driver reports
    assert 80e9 <= a100.memory_bytes and 80e9 <= h100.memory_bytes and 141e9 <= h200.memory_bytes
    assert h200.flops_per_s == h100.flops_per_s > 3 * a100.flops_per_s  # same Hopper die; 989 vs 312
    assert h200.memory_bytes > 1.7 * h100.memory_bytes
    assert h100.d2h_bytes_per_s == 2 * a100.d2h_bytes_per_s  # PCIe gen5 vs gen4
    assert get_profile("A100").name == "a100-80gb"
    # get_profile returns a copy
    h100.flops_per_s = 1.0
    assert get_profile("h100").flops_per_s == h200.flops_per_s


def test_unknown_profile_lists_names():
    with pytest.raises(SppoError) as err:
        get_profile("tpu-v5")
    for name in ("a100-80gb", "h100", "h200", "calibrate"):
        assert name in str(err.value)


def test_efficiency_curve():
    pr = get_profile("h100")
    assert pr.efficiency(0) == 0.0
    assert pr.efficiency(pr.n_half) == pytest.approx(0.5)
    effs = [pr.efficiency(n) for n in (128, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[-1] < 1.0 and effs[-1] > 0.95
    t_short = pr.compute_seconds(1e15, 256)
    t_long = pr.compute_seconds(1e15, 16384)
    assert t_short > t_long > 1e15 / pr.flops_per_s
    assert pr.compute_seconds(0, 0) == 0.0
    assert pr.copy_seconds(50e9, "d2h") == pytest.approx(1.0)
    with pytest.raises(SppoError):
        pr.copy_seconds(1, "sideways")


def test_json_round_trip_and_table():
    pr = get_profile("h200")
    again = DeviceProfile.from_json(pr.to_json())
    assert again == pr
    with pytest.raises(SppoError, match="unknown DeviceProfile field"):
        DeviceProfile.from_dict({**pr.to_dict(), "bogus": 1})
    with pytest.raises(SppoError, match="missing"):
        DeviceProfile.from_dict({"name": "x"})
    text = pr.table()
    assert "h200" in text and "TFLOP/s" in text and "GiB" in text
    table = profiles_table()
    assert all(name in table for name in PROFILES)


def test_calibrate_cpu(tmp_path, monkeypatch):
    # the element-wise bandwidth is the better of two windows apart: a stall in one (here
    # the first) does not set it
    from sppo_fx.solver import clock_calibration as cc
    readings = iter([2e9, 6e9])
    monkeypatch.setattr(cc, "elementwise_bytes_per_s", lambda device, budget_s, **kw: next(readings))
    pr = calibrate("cpu", seconds=1.0, dir=str(tmp_path))
    assert pr.elementwise_bytes_per_s == 6e9
    assert [n for n, _ in pr.allocation_by_size] == list(PROBE_SIZES)  # priced on this process
    assert pr.flops_per_s > 1e8                       # anything that runs a matmul at all
    assert pr.d2h_bytes_per_s == pr.h2d_bytes_per_s > 1e7
    assert pr.disk_write_bytes_per_s > 1e6 and pr.disk_read_bytes_per_s > 1e6
    assert pr.disk_cached_write_bytes_per_s > 1e6 and pr.disk_cache_bytes >= 0
    assert "disk write, cached" in pr.table()
    assert pr.memory_bytes > 256 << 20
    assert pr.n_half >= 0
    assert os.listdir(tmp_path) == []                  # the temp file is gone
    assert DeviceProfile.from_json(pr.to_json()) == pr
    assert "calibrate" in pr.source


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here; this checks the error calibrate('cuda') raises without it")
def test_calibrate_cuda_without_cuda():
    with pytest.raises(SppoError, match="CUDA is not available"):
        calibrate("cuda")


def test_offload_directories_on_one_filesystem_share_a_stored_profile(tmp_path, monkeypatch):
    # the disk figures are the filesystem's: a new offload directory on it (a test's
    # tmp_path, a run's scratch directory) must not calibrate the machine again
    from sppo_fx.solver import profile_cache
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPPO_FX_PROFILE_CACHE", raising=False)
    monkeypatch.delenv("SPPO_FX_RECALIBRATE", raising=False)
    calls = []
    measured = DeviceProfile("measured", 1e9, 1e9, 1e9, 1e9, 1e9, 1 << 30)
    monkeypatch.setattr(profile_cache, "calibrate", lambda *a, **k: calls.append(k.get("dir")) or measured)
    monkeypatch.setattr(profile_cache, "others_runnable", lambda: 0.0)
    first, second = tmp_path / "run1", tmp_path / "run2"
    first.mkdir()
    second.mkdir()
    assert profile_cache.device_profile("cpu", dir=str(first)).name == "measured"
    assert profile_cache.device_profile("cpu", dir=str(second)).name == "measured"
    assert calls == [str(first)]  # measured once, read back for the second directory
    # a directory on another filesystem (its device number differs) gets a profile of its own
    real_stat, other = os.stat, tmp_path / "mounted"
    other.mkdir()

    def stat(path, *args, **kwargs):
        got = real_stat(path, *args, **kwargs)
        if os.fspath(path) != str(other):
            return got
        fields = list(got)
        fields[2] += 1  # st_dev
        return os.stat_result(fields)
    monkeypatch.setattr(os, "stat", stat)
    assert profile_cache.profile_key("cpu", str(other)) != profile_cache.profile_key("cpu", str(second))


def test_the_memory_passes_op_cost_is_measured_once_per_machine_and_only_op_by_op(tmp_path, monkeypatch):
    """`with_pass_ops` measures the op cost of the memory passes' programs where an
    op-by-op plan with a tier needs it, stores it beside the profile (a later process reads
    it back), and a compiled run or a GPU never pays the probe."""
    import types

    from sppo_fx.options import compile_options
    from sppo_fx.orchestrate.stage import device_profile as stage_profile
    from sppo_fx.solver import clock_calibration, profile_cache
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPPO_FX_PROFILE_CACHE", raising=False)
    monkeypatch.delenv("SPPO_FX_RECALIBRATE", raising=False)
    measured = DeviceProfile("measured", 1e9, 1e9, 1e9, 1e9, 1e9, 1 << 30, op_seconds=1e-5)
    monkeypatch.setattr(profile_cache, "calibrate", lambda *a, **k: measured)
    monkeypatch.setattr(profile_cache, "others_runnable", lambda: 0.0)
    probes = []
    monkeypatch.setattr(clock_calibration, "program_op_seconds",
                        lambda call, budget_s, offload=None: probes.append(offload) or 3e-5)
    monkeypatch.setattr(profile_cache, "_pass_ops_measured", {})
    entry = types.SimpleNamespace(cost=None, device=lambda: "cpu")
    compiled = stage_profile(entry, compile_options(budget="1GiB", offload="disk"))
    assert compiled.pass_op_seconds == 0 and probes == []  # compiled programs: not needed
    op_by_op = compile_options(budget="1GiB", offload="disk", compile=False)
    assert stage_profile(entry, op_by_op).pass_op_seconds == 3e-5 and probes == ["device"]
    assert profile_cache.device_profile("cpu").pass_op_seconds == 3e-5  # stored with the profile
    assert stage_profile(entry, op_by_op).pass_op_seconds == 3e-5 and probes == ["device"]  # not again
    assert profile_cache.with_pass_ops(measured, "cuda") is measured and probes == ["device"]
    monkeypatch.setenv("SPPO_FX_PROFILE_CACHE", "0")  # no cache: measured once per process all the same
    assert profile_cache.with_pass_ops(measured).pass_op_seconds == 3e-5 and probes == ["device"]
    assert stage_profile(entry, op_by_op, measured) is measured  # a profile handed in is used as it is
