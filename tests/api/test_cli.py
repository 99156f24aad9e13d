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
