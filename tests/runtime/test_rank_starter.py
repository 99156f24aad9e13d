"""The suite's rank starter (tests/conftest.py `start_rank`): the ranks of its launches run
torch's fake-tensor dispatch cache off, unless the launch's env says otherwise, whether they
are forked from a zygote or started by Popen."""
from __future__ import annotations

import os
import sys

import pytest

from sppo_fx.runtime.launch import start_local_ranks

pytestmark = pytest.mark.distributed

SCRIPT = "import torch._dynamo\nprint('cache', torch._dynamo.config.fake_tensor_cache_enabled)\n"


def _rank_sees(tmp_path, monkeypatch, fork: str, env_value: str | None) -> str:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("SPPO_TEST_FORK_RANKS", fork)
    if env_value is None:
        monkeypatch.delenv("TORCH_FAKE_TENSOR_DISPATCH_CACHE", raising=False)
    else:
        monkeypatch.setenv("TORCH_FAKE_TENSOR_DISPATCH_CACHE", env_value)
    (proc,) = start_local_ranks([sys.executable, str(script)], 1, capture=True, cwd=os.fspath(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.split()[-1]


@pytest.mark.parametrize("fork", ["1", "0"], ids=["zygote", "popen"])
def test_ranks_run_the_fake_tensor_cache_off(tmp_path, monkeypatch, fork):
    assert _rank_sees(tmp_path, monkeypatch, fork, None) == "False"


def test_a_launch_that_sets_the_cache_keeps_its_value(tmp_path, monkeypatch):
    assert _rank_sees(tmp_path, monkeypatch, "1", "1") == "True"
