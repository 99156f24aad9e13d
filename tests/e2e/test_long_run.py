"""A long run leaks nothing (bench/long_run.py, shortened for the suite: 30 steps at T = 768, RSS
compared from step 10; `python bench/long_run.py --steps 200` is the full check)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from long_run import long_run  # noqa: E402


@pytest.mark.slow
def test_long_disk_offload_run_leaks_nothing_and_matches_no_offload(tmp_path):
    r = long_run(steps=30, rss_from=10, seq_len=768, offload_dir=str(tmp_path))
    assert r["peak_offloaded_bytes"] > 0
    assert r["failed"] == [], r
    assert os.listdir(tmp_path) == []  # the store's own dir is gone too
