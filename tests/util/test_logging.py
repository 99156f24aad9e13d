"""Progress and logging (sppo_fx/util/log.py): quiet in library use, phases at INFO, pass graphs
at DEBUG, and the device profile calibrated once and read back (solver/profile_cache.py)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import sppo_fx
from sppo_fx.util.log import record_phases
from sppo_fx.models import build

# a tiny model traced and chunked without Inductor: what a library user's script does
SCRIPT = """
import torch, sppo_fx
from sppo_fx.models import build
torch.manual_seed(0)
model = build("llama", "tiny")
x = torch.randint(0, 97, (1, 32))
sppo_fx.compile(model, chunks=2, compile=False)(x, x).backward()
print("done")
"""


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPPO_FX_LOG")}
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "done" in res.stdout, res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_library_use_is_quiet_by_default():
    res = _run({})
    assert "sppo_fx" not in res.stderr and "capturing" not in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_env_var_shows_phases_and_pass_graphs():
    info = _run({"SPPO_FX_LOG": "info"}).stderr
    assert "[sppo_fx] capturing the model (torch.export)…" in info
    assert "[sppo_fx] capturing the model (torch.export): " in info and " s\n" in info
    assert "graph passes" in info and "cost model" in info
    assert "---- after recognize_causal_masks" not in info  # graphs only at debug
    debug = _run({"SPPO_FX_LOG": "debug"}).stderr
    assert "---- captured graph (before the passes) ----" in debug
    for name in ("strip_asserts", "recognize_causal_masks", "analyse_seqdims", "chunk_program: chunk"):
        assert f"---- after {name}" in debug, name
    assert "def forward" in debug  # the graph's code itself


@pytest.mark.slow
def test_budget_phases_logged_at_info_and_profile_stored(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPPO_FX_RECALIBRATE", raising=False)
    monkeypatch.delenv("SPPO_FX_PROFILE_CACHE", raising=False)
    from sppo_fx.solver import profile_cache
    # an idle machine: a profile calibrated busy is provisional and measured again when idle
    # (test_a_busy_calibration_is_measured_again_when_the_machine_is_idle)
    monkeypatch.setattr(profile_cache, "others_runnable", lambda: 0.0)
    torch.manual_seed(0)
    model = build("llama", "tiny", n_layers=1)  # the phases do not depend on depth; the traces do
    x = torch.randint(0, 97, (1, 64))
    caplog.set_level(logging.INFO, logger="sppo_fx")
    with record_phases() as phases:
        sppo_fx.compile(model, budget="64MiB", compile=False)(x, x).backward()
    text = caplog.text
    for phase in ("capturing the model", "memory model: saved activations", "calibrating the device profile",
                  "solving the budget for 64 tokens"):
        assert phase in text, phase
        assert any(name.startswith(phase) and seconds >= 0 for name, seconds in phases), (phase, phases)
    stored = list((tmp_path / "profiles").glob("*.json"))
    assert len(stored) == 1
    # a second compile (a new process would do the same) reads the stored profile instead
    caplog.clear()
    again = sppo_fx.compile(model, budget="64MiB", compile=False)
    again(x, x).backward()
    assert "calibrating the device profile" not in caplog.text
    assert "stored calibration" in caplog.text and str(stored[0]) in again.profile.source
    # SPPO_FX_RECALIBRATE=1 measures again (asked of the profile cache the compile asks: a
    # third compile would only repeat the capture and the chunk program's compile around it)
    from sppo_fx.solver import profile_cache
    caplog.clear()
    monkeypatch.setenv("SPPO_FX_RECALIBRATE", "1")
    before = stored[0].read_bytes()
    profile = profile_cache.device_profile("cpu")
    assert "calibrating the device profile" in caplog.text and "stored calibration" not in caplog.text
    assert list((tmp_path / "profiles").glob("*.json")) == stored  # the same key: overwritten
    assert stored[0].read_bytes() != before and "stored in" not in profile.source


def test_a_calibration_on_a_busy_cpu_is_flagged(caplog, tmp_path, monkeypatch):
    """A profile calibrated while other processes ran is slow for as long as it is stored:
    the calibration says the load it ran under and warns how to refresh it."""
    import dataclasses

    from sppo_fx.solver import profile_cache
    from sppo_fx.solver.profiles import get_profile
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_cache, "calibrate",
                        lambda *a, **k: dataclasses.replace(get_profile("h200"), source="measured"))
    monkeypatch.setattr(profile_cache.os, "cpu_count", lambda: 2)
    caplog.set_level(logging.INFO, logger="sppo_fx")
    for load, busy in ((3.1, True), (0.2, False)):
        caplog.clear()
        monkeypatch.setattr(profile_cache, "others_runnable", lambda load=load: load)
        profile = profile_cache.device_profile("cpu", refresh=True)
        assert f"{load:.1f} other runnable threads on 2 cores" in profile.source
        assert ("on an idle machine with SPPO_FX_RECALIBRATE=1" in caplog.text) is busy, caplog.text


def test_a_busy_calibration_is_measured_again_when_the_machine_is_idle(caplog, tmp_path, monkeypatch):
    """A profile calibrated busy is stored as provisional: used while the machine stays busy
    (not measured at every call), replaced at the first call that finds it idle, and an
    idle calibration is kept however busy later calls find the machine."""
    import dataclasses
    import json

    from sppo_fx.solver import profile_cache
    from sppo_fx.solver.profiles import get_profile
    monkeypatch.setenv("SPPO_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPPO_FX_RECALIBRATE", raising=False)
    monkeypatch.delenv("SPPO_FX_PROFILE_CACHE", raising=False)
    calls = []

    def calibrate(*a, **k):
        calls.append(a)
        return dataclasses.replace(get_profile("h200"), name=f"calibration {len(calls)}", source="measured")
    monkeypatch.setattr(profile_cache, "calibrate", calibrate)
    monkeypatch.setattr(profile_cache.os, "cpu_count", lambda: 2)
    caplog.set_level(logging.INFO, logger="sppo_fx")
    got = []
    for load in (3.1, 3.1, 2.5, 0.2, 3.1):
        monkeypatch.setattr(profile_cache, "others_runnable", lambda load=load: load)
        got.append(profile_cache.device_profile("cpu").name)
    assert got == ["calibration 1", "calibration 1", "calibration 1", "calibration 2", "calibration 2"]
    assert len(calls) == 2
    (stored,) = (tmp_path / "profiles").glob("*.json")
    assert json.loads(stored.read_text())["provisional"] is False
    assert caplog.text.count("calibrated while the machine was busy; it is measured again") == 1  # warned once
