"""The demo and the CLI run end to end (small sizes)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from sppo_fx import demo
from sppo_fx.cli import main


def test_demo_trains_and_checks_gradients(capsys):
    report = demo.run(steps=3, seq_len=192, chunks=5, batch=2, size="tiny", lr=3e-3, seed=1, compile=False)
    out = capsys.readouterr().out
    assert report["grad_check"]["ok"]
    assert "Chunk plan" in out and "match eager: yes" in out
    assert len(report["losses"]) == 3 and report["losses"][-1] < report["losses"][0]


def test_demo_summary_reports_medians_and_the_step_that_compiled_chunk_zero(capsys):
    """The demo's summary: the library's median step, without the step that paid chunk 0's
    compile, against eager's median (not one eager step), and the largest peak both with and
    without that step."""
    plan = type("Plan", (), {"peak_bytes": 40 << 20})()
    report = {"peaks": [70 << 20, 50 << 20, 52 << 20], "step_s": [9.0, 1.2, 1.0], "budget": 60 << 20,
              "eager_peak": 200 << 20, "eager_s": 1.0, "losses": [5.0, 4.0], "chunk_zero_compiled_at": 1}
    demo._summary(report, plan)
    out = capsys.readouterr().out
    assert "measured peak extra memory 70 MiB (largest of steps 1-3) vs budget 60 MiB: within the budget's" in out
    assert "step 1, which compiled chunk 0: 70 MiB; without step 1: 52 MiB (26% of eager)" in out
    assert "step time 1.10 s (median of steps 1-3 but step 1, which compiled chunk 0) vs eager 1.00 s (1.10x)" in out
    # step 1's RSS also held the compiled program it took (30 MiB): the budget is the tensors'
    demo._summary(dict(report, compile_kept_bytes=30 << 20), plan)
    out = capsys.readouterr().out
    assert ("measured peak extra memory 52 MiB (largest of steps 1-3, step 1 less chunk 0's compiled program) "
            "vs budget 60 MiB: within the budget;") in out
    assert ("step 1, which compiled chunk 0: 70 MiB; its RSS grew by 30 MiB while it took the compiled program "
            "(code and compiler state, held after garbage collection); without step 1: 52 MiB") in out
    demo._summary(dict(report, compile_kept_bytes=10 << 20), plan)  # step 1 less it is still the largest
    assert "measured peak extra memory 60 MiB (largest of steps 1-3, step 1 less" in capsys.readouterr().out
    demo._summary(dict(report, peaks=[70 << 20], step_s=[9.0], compile_kept_bytes=80 << 20), plan)
    out = capsys.readouterr().out  # one step, the one that compiled: its raw figure is still shown
    assert "measured peak extra memory 0 MiB (largest of steps 1-1, step 1 less" in out
    assert "step 1, which compiled chunk 0: 70 MiB; its RSS grew by 80 MiB" in out
    del report["chunk_zero_compiled_at"]
    demo._summary(dict(report, compile_kept_bytes=30 << 20), plan)  # no compile step: nothing taken off
    out = capsys.readouterr().out
    assert "measured peak extra memory 70 MiB (largest of steps 1-3) vs" in out
    assert "step time 1.20 s (median of steps 1-3) vs eager 1.00 s (1.20x)" in out
    report["eager_between_s"] = [1.5, 1.1, 1.0]  # eager again between the library's steps: the ratio's reference
    demo._summary(report, plan)
    assert ("step time 1.20 s (median of steps 1-3) vs eager 1.10 s (median of 3 eager steps taken between "
            "them; 1.00 s measured first) (1.09x)") in capsys.readouterr().out


def test_demo_under_a_budget_times_eager_between_its_steps(capsys, monkeypatch):
    """Under a budget the demo times an eager step after each training step but the first
    call, and its summary compares with their median; training is unchanged by them (the
    loss still falls, the first step's gradients match eager)."""
    timed = demo.measured_step  # its peaks read RSS, which glibc's defaults do not return: a fixed 64 MiB
    monkeypatch.setattr(demo, "measured_step", lambda step: (timed(step)[0], 64 << 20))
    report = demo.run(steps=3, seq_len=128, batch=1, size="tiny", lr=3e-3, seed=1, compile=False)
    out = capsys.readouterr().out
    assert report["grad_check"]["ok"] and report["losses"][-1] < report["losses"][0]
    assert len(report["eager_between_s"]) == 2 and all(s > 0 for s in report["eager_between_s"])
    assert "eager steps taken between them" in out
    monkeypatch.setattr(demo, "_no_compile_under_way", lambda compiled: False)  # no eager step between
    alone = demo.run(steps=3, seq_len=128, batch=1, size="tiny", lr=3e-3, seed=1, compile=False)
    assert alone["eager_between_s"] == [] and alone["losses"] == report["losses"]  # the same training


def test_corpus_is_real_python_source():
    corpus = demo.stdlib_corpus(max_bytes=1 << 16)
    text = bytes(corpus[:4096].tolist()).decode("utf-8", errors="replace")
    assert corpus.numel() >= 1 << 16 and ("import" in text or "def " in text)


def test_explain_command(capsys):
    assert main(["explain", "--model", "gpt", "--seq-len", "32", "--chunks", "4", "--graphs"]) == 0
    out = capsys.readouterr().out
    assert "Causal attention sites (2)" in out and "prefix_causal_attention" in out
    assert "==== graph: epilogue ====" in out


@pytest.mark.slow
def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "sppo_fx", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "demo" in res.stdout
