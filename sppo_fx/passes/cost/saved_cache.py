"""The memory model's saved activations, kept on disk between processes and in memory
within one (docs/architecture.md, "The memory model").

`saved_tensors_by_policy` (passes/cost/saved.py) traces the chunk program's joint graph with
AOTAutograd and partitions it per recompute policy: the slow part of a budgeted first call.
`stored_saved_tensors_by_policy` returns the same result, read from
`$SPPO_FX_CACHE_DIR/memory_model/` (`sppo_fx/disk_cache.py`; one pickle file per key,
written atomically) or from this process's memo, and computes and stores it otherwise.

The key holds everything the result depends on: the chunk program's code (and its
sub-graphs'), each placeholder's shape (symbols renamed in order of appearance, so two
captures of the same model agree), dtype, stride and device, the placeholder roles the
trace feeds (`shapes._input_specs`), the attention sites, the parameters' shapes and
dtypes, the batch, the requested example (c0, p0), the partition, the policies, the device
(and GPU name), AOTAutograd's config, torch's version and a digest of sppo_fx's sources, so
a change to any pass never reads an entry the old code made. A stored file whose key
differs, or that cannot be read, is ignored and overwritten.
`SPPO_FX_MEMORY_MODEL_CACHE=off` neither reads nor writes (nor keeps the memo).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import time

import sympy
import torch
import torch.fx as fx

from sppo_fx.disk_cache import cache_root, enabled, source_digest, write_atomically
from sppo_fx.log import get_logger, phase
from sppo_fx.passes.cost.data import SavedTensor
from sppo_fx.passes.cost.saved import saved_tensors_by_policy
from sppo_fx.passes.cost.shapes import _input_specs

log = get_logger(__name__)
ENV = "SPPO_FX_MEMORY_MODEL_CACHE"
FORMAT = 1

_memo: dict[str, tuple[dict[str, list[SavedTensor]], tuple[int, int]]] = {}  # file path -> result


def cache_dir() -> str:
    """The directory that holds the stored memory models."""
    return os.path.join(cache_root(), "memory_model")


def forget() -> None:
    """Drop this process's memo (the files stay)."""
    _memo.clear()


class _Symbols:
    """Renames the free symbols of shapes in order of first appearance (s85 -> _s0)."""

    def __init__(self):
        self.names: dict[sympy.Symbol, sympy.Symbol] = {}

    def __call__(self, value) -> str:
        if isinstance(value, torch.SymInt):
            value = value.node.expr
        if isinstance(value, sympy.Expr):
            for s in sorted(value.free_symbols, key=str):
                self.names.setdefault(s, sympy.Symbol(f"_s{len(self.names)}"))
            return str(value.xreplace(self.names))
        return str(value)


def _describe(value, symbols: _Symbols) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor {[symbols(s) for s in value.shape]} {value.dtype} stride "
                f"{[symbols(s) for s in value.stride()]} {value.device.type}")
    if isinstance(value, (torch.SymInt, sympy.Expr)):
        return f"int {symbols(value)}"
    return f"{type(value).__name__} {value!r}"


def _device(device, params) -> dict:
    dev = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    out = {"type": dev.type}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        out["name"] = torch.cuda.get_device_name(index)
        out["capability"] = list(torch.cuda.get_device_capability(index))
    return out


def memory_model_key(program, batch: int, *, params=None, seq=None, partition: str = "default",
                     example: tuple[int, int] | None = None, device=None, recomputes=("none",)) -> dict:
    """What a stored result must match to be used (a JSON-able dict, stored with it)."""
    import torch._functorch.config as functorch_config

    symbols = _Symbols()
    placeholders = [(n.name, _describe(n.meta.get("val"), symbols))
                    for n in program.chunk.graph.nodes if n.op == "placeholder"]
    graphs = {name or "chunk": m.code for name, m in program.chunk.named_modules() if isinstance(m, fx.GraphModule)}
    config = repr(sorted(functorch_config.get_config_copy().items()))
    return {
        "format": FORMAT,
        "graphs": graphs,
        "placeholders": placeholders,
        "inputs": repr(_input_specs(program, seq)),
        "seq": symbols(seq) if seq is not None else None,
        "attention": [[site.name, repr(site.window), repr(site.documents)] for site in program.attention],
        "num_partials": program.num_partials,
        "params": [[list(t.shape), str(t.dtype)] for t in params] if params is not None else None,
        "batch": batch,
        "example": list(example) if example is not None else None,
        "partition": partition,
        "recomputes": list(recomputes),
        "device": _device(device, params),
        "functorch_config": hashlib.sha256(config.encode()).hexdigest(),
        "torch": torch.__version__,
        "sppo_fx": source_digest(),
    }


def _path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), f"{key['device']['type']}-{digest}.pkl")


def _copy(result):
    by_policy, example = result
    return {policy: list(saved) for policy, saved in by_policy.items()}, tuple(example)


def _read(path: str, key: dict):
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        by_policy, example = data["saved"], tuple(data["example"])
        if set(by_policy) != set(key["recomputes"]) or not all(
                isinstance(s, SavedTensor) for saved in by_policy.values() for s in saved):
            return None
        return by_policy, (int(example[0]), int(example[1]))
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: compute again, never fail
        log.warning("ignoring the stored memory model %s (%s: %s); tracing again", path, type(e).__name__, e)
        return None


def _write(path: str, key: dict, result) -> None:
    by_policy, example = result
    try:
        write_atomically(path, pickle.dumps({"key": key, "saved": by_policy, "example": list(example)}))
        log.info("memory model stored in %s", path)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        log.warning("could not store the memory model in %s: %s", path, e)


def stored_saved_tensors_by_policy(program, values, batch: int, *, params: list[torch.Tensor] | None = None,
                                   seq=None, partition: str = "default", example: tuple[int, int] | None = None,
                                   device=None, recomputes=("none",), announce: bool = True
                                   ) -> tuple[dict[str, list[SavedTensor]], tuple[int, int]]:
    """`saved.saved_tensors_by_policy`, from this process's memo or the disk cache when
    stored there, else computed (AOTAutograd) and stored. Same arguments and result.
    `announce=False` leaves the progress line to a caller that reports a larger phase."""
    recomputes = tuple(dict.fromkeys(recomputes))
    kw = dict(params=params, seq=seq, partition=partition, example=example, device=device, recomputes=recomputes)
    what = f"memory model: saved activations under recompute {'/'.join(recomputes)} (AOTAutograd partitions)"

    def traced():
        with phase(what, log) if announce else contextlib.nullcontext():
            return saved_tensors_by_policy(program, values, batch, **kw)

    if not enabled(ENV):
        return traced()
    try:
        key = memory_model_key(program, batch, **kw)
    except Exception as e:  # noqa: BLE001 - the cache never fails a call; the trace says what is wrong
        log.debug("memory model: no cache key (%s: %s); tracing", type(e).__name__, e)
        return traced()
    path = _path(key)
    stored = _lookup(path, key)
    if stored is not None:
        return stored
    result = traced()
    _memo[path] = _copy(result)
    _write(path, key, result)
    return result


def _lookup(path: str, key: dict):
    """The result kept in this process's memo or stored in `path`, else None."""
    if path in _memo:
        log.info("memory model: read from cache %s (kept in this process)", path)
        return _copy(_memo[path])
    stored = None
    if os.path.exists(path):
        with phase("memory model: read from cache", log):
            stored = _read(path, key)
    if stored is not None:
        log.info("memory model: read from cache %s", path)
        _memo[path] = stored
        return _copy(stored)
    return None


def _stored_path(program, batch: int, kw: dict) -> str | None:
    """Where the result for these arguments is kept; None with the cache off or no key."""
    if not enabled(ENV):
        return None
    try:
        return _path(memory_model_key(program, batch, **kw))
    except Exception:  # noqa: BLE001 - no key: it will be traced
        return None


def stored_saved_tensors_for_examples(program, values, batch: int, examples: list[tuple[int, int]], *,
                                      params: list[torch.Tensor] | None = None, device=None, **kw) -> list:
    """`stored_saved_tensors_by_policy` at each of two examples (the example chunk and the
    first chunk, `p0 = 0`), in order. When both must be traced on CPU, the second is traced
    in a forked child process while this one traces the first (`sppo_fx/forked.py`): two
    AOTAutograd traces are Python work that one process can only run one after the other.
    The child stores its result on disk like this process; its result is kept in this
    process's memo too. Same results as calling `stored_saved_tensors_by_policy` twice."""
    import functools
    from sppo_fx.forked import ForkedCall, can_fork

    kw = dict(kw, recomputes=tuple(dict.fromkeys(kw.get("recomputes", ("none",)))))  # as the keys are made
    calls = [functools.partial(stored_saved_tensors_by_policy, program, values, batch, example=e,
                               params=params, device=device, **kw) for e in examples]
    paths = [_stored_path(program, batch, dict(kw, params=params, device=device, example=e)) for e in examples]
    stored = any(path is not None and (path in _memo or os.path.exists(path)) for path in paths)
    if stored or not (len(calls) == 2 and _device(device, params)["type"] == "cpu" and can_fork()):
        return [call() for call in calls]
    recomputes = "/".join(kw["recomputes"])
    what = (f"memory model: saved activations under recompute {recomputes} (AOTAutograd partitions; "
            "the first chunk's traced in a forked process)")
    with phase(what, log), ForkedCall(calls[1], "the first chunk's memory model") as child:
        t0 = time.perf_counter()
        first = calls[0](announce=False)  # this phase reports both traces
        # the two traces take about as long: a child far slower than this one is stuck
        second = child.result(timeout=max(60.0, 2.0 * (time.perf_counter() - t0)))
    if paths[1] is not None:
        _memo[paths[1]] = _copy(second)
    return [first, second]
