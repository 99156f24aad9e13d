"""Smoke test of examples/train_hf.py: 2 steps on a tiny corpus, checkpoint saved and reloaded."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location("train_hf", os.path.join(ROOT, "examples", "train_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_hf_two_steps_and_checkpoint(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (5 + i))
    ckpt = tmp_path / "ckpt.pt"
    example = _example()
    # compile off and chunks instead of a budget: the smoke test checks the example's flow;
    # Inductor and the budget solver have their own tests (test_codegen.py, test_budget.py),
    # and the solver's first plan alone took ~100 s for this model on a loaded 2-core machine
    args = ["--config", "llama", "--corpus", str(corpus), "--seq-len", "64", "--batch", "2", "--steps", "2",
            "--budget", "none", "--chunks", "4", "--no-compile", "--offload-dir", str(tmp_path / "offload"),
            "--checkpoint", str(ckpt)]
    assert example.main(args) == 0
    out = capsys.readouterr().out
    assert "chunk" in out and "step 1: loss" in out and "step 2: loss" in out and "loss curve:" in out
    assert "tensors equal" in out
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 2 and len(saved["losses"]) == 2 and saved["optimizer"]["state"]
    # resume continues the step count and the loss history
    assert example.main(args[:-2] + ["--steps", "1", "--resume", str(ckpt)]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_pack_separates_documents():
    example = _example()
    stream = example.pack([b"ab", b"c"])
    assert stream.tolist() == [97, 98, example.EOD, 99, example.EOD]


def test_document_positions_restart_after_each_end_of_document():
    example = _example()
    ids = torch.tensor([[5, 6, example.EOD, 7, example.EOD, example.EOD, 8, 9]])
    assert example.document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_document_masking_trains_with_document_sites(tmp_path, capsys, monkeypatch):
    """--document-masking hands the model restarting position_ids without a cache: every
    attention site of the chunk program is document-causal (sppo_fx proved the mask)."""
    import sppo_fx
    corpus = tmp_path / "doc.txt"
    corpus.write_text("tiny documents. " * 20)
    made = []
    compile_fn = sppo_fx.compile
    monkeypatch.setattr(sppo_fx, "compile", lambda *a, **kw: made.append(compile_fn(*a, **kw)) or made[-1])
    args = ["--config", "llama", "--corpus", str(corpus), "--seq-len", "48", "--steps", "1", "--budget", "none",
            "--chunks", "3", "--no-compile", "--document-masking"]
    assert _example().main(args) == 0
    assert "within each document" in capsys.readouterr().out
    sites = made[0].program.attention
    assert sites and all(site.documents for site in sites)
