"""One rank of tests/distributed/test_collective_devices.py: every torch.distributed call that hands over
tensors is wrapped to record each tensor's device against the process group's expected
device (`collective_device`), then examples/train_pipeline.py runs a step. Writes
rank<R>.json under the --dump directory: the calls seen and any on the wrong device."""
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from sppo_fx.runtime import distributed  # noqa: E402

_WRAPPED = ("isend", "irecv", "send", "recv", "all_reduce", "all_gather", "broadcast", "reduce_scatter",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "reduce", "gather", "scatter")
calls, wrong = [], []


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _wrap(name, fn):
    def checked(*args, **kwargs):
        expected = distributed.collective_device(kwargs.get("group"))
        tag = kwargs.get("tag", 0)
        for t in _tensors(args, kwargs):
            calls.append((name, tag))
            if t.device != expected:
                wrong.append(f"{name} (tag {tag}): a tensor on {t.device}, the group wants {expected}")
        return fn(*args, **kwargs)
    return checked


for _name in _WRAPPED:
    if hasattr(dist, _name):
        setattr(dist, _name, _wrap(_name, getattr(dist, _name)))

import train_pipeline  # noqa: E402

argv = sys.argv[1:]
dump = argv[argv.index("--dump") + 1]
code = train_pipeline.main(argv)
rank = int(os.environ["RANK"])
with open(os.path.join(dump, f"devices{rank}.json"), "w") as f:
    json.dump({"calls": calls, "wrong": wrong}, f)
sys.exit(code or 0)
