"""Every tensor handed to a torch.distributed call is on the process group's device
(`runtime.distributed.collective_device`: cuda:LOCAL_RANK for NCCL, the CPU for gloo).

A 2-rank gloo run of examples/train_pipeline.py with every collective wrapped checks the
loss broadcast, the fingerprint exchange and the tied-gradient reduction in a real step; the
unit tests below stand an NCCL group in (with the meta device as its GPU) so that a tensor
left on the CPU, which gloo would accept, fails here too."""
import json
import os
import sys

import pytest
import torch

from sppo_fx.runtime import distributed
from sppo_fx.runtime.launch import run_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "collective_devices_worker.py")


@pytest.mark.slow  # two ranks trace and run a step (no Inductor): about 14 s on 2 cores
@pytest.mark.distributed
def test_gloo_pipeline_hands_collectives_tensors_on_the_groups_device(tmp_path):
    # gpt ties its embeddings: 2 stages exchange the tied gradient
    args = ["--model", "gpt", "--layers", "2", "--seq-len", "32", "--chunks", "2", "--microbatches", "1",
            "--timeout", "120", "--dump", str(tmp_path)]
    run_local_ranks([sys.executable, WORKER, *args], 2, 240.0, cwd=ROOT)
    seen = set()
    for rank in range(2):
        got = json.loads((tmp_path / f"devices{rank}.json").read_text())
        assert got["wrong"] == [], got["wrong"]
        seen |= {(name, tag) for name, tag in got["calls"]}
    names = {name for name, _ in seen}
    tags = {tag for _, tag in seen}
    assert "all_gather" in names  # the fingerprint exchange
    assert distributed._TAG_LOSS in tags  # the loss broadcast
    assert any(tag >= distributed._TAG_SHARED and tag < distributed._TAG_LOSS for tag in tags)  # tied grads


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


@pytest.fixture
def nccl_on_meta(monkeypatch):
    """An NCCL group whose GPU is the meta device: records (call, tensor devices)."""
    calls = []
    meta = torch.device("meta")

    def record(name):
        def fn(*args, **kwargs):
            devices = [t.device for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            calls.append((name, devices))
            return _Done()
        return fn
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(distributed.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(distributed, "collective_device", lambda group=None: meta)
    for name in ("isend", "irecv", "all_reduce", "all_gather"):
        monkeypatch.setattr(distributed.dist, name, record(name))
    return calls


class _Mesh:
    def __init__(self, stages):
        self.layout = type("L", (), {"pp": stages})()
        self.ranks = [[[s]] for s in range(stages)]

    def stage_rank(self, stage):
        return stage


def _executor(is_last, params, stages=2, rank=0):
    ex = object.__new__(distributed.PipelineExecutor)
    ex.mesh, ex.is_last, ex.params, ex.rank, ex._sends = _Mesh(stages), is_last, params, rank, []
    ex.stage = stages - 1 if is_last else 0
    ex._wait = lambda work, peer, what: work.wait()
    return ex


@pytest.mark.parametrize("is_last", [True, False])
def test_loss_broadcast_sends_device_tensors(nccl_on_meta, is_last):
    ex = _executor(is_last, [torch.empty(3, device="meta")])
    loss = torch.empty((), device="meta") if is_last else None
    ex._broadcast_loss(loss)
    sends = [c for c in nccl_on_meta if c[0] in ("isend", "irecv")]
    assert sends and all(d == [torch.device("meta")] for _, d in sends), nccl_on_meta


def test_tied_gradient_reduction_sends_device_tensors(nccl_on_meta):
    param = torch.empty(4, device="meta")
    ex = _executor(False, [param])
    ex.shared = {0: (7, [0, 1])}
    runner = type("R", (), {"grad_index": [0]})()
    grads = [torch.empty(4, device="meta")]
    # the received buffer is added on the meta device: only shapes and devices matter here
    ex._reduce_shared(runner, grads)
    assert [c[0] for c in nccl_on_meta] == ["isend", "irecv"]
    assert all(d == [torch.device("meta")] for _, d in nccl_on_meta)


def test_fingerprint_exchange_uses_the_groups_device(nccl_on_meta, monkeypatch):
    # all_gather's outputs stay zero here (no peer): the exchange stops at decoding, after
    # every tensor it handed over was checked
    with pytest.raises(Exception):
        distributed._gather_json({"a": "b"}, 2, 5.0)
    assert [c[0] for c in nccl_on_meta][:1] == ["all_gather"]
    assert all(d and all(x == torch.device("meta") for x in d) for _, d in nccl_on_meta), nccl_on_meta
