"""The memory model's saved activations, kept on disk between processes and in memory
within one (docs/architecture.md, "The memory model").

`saved_tensors_by_policy` (passes/cost/saved.py) traces the chunk program's joint graph with
AOTAutograd and partitions it per recompute policy: the slow part of a budgeted first call.
`stored_saved_tensors_by_policy` returns the same result, read from
`$SPPO_FX_CACHE_DIR/memory_model/` (`sppo_fx/util/disk_cache.py`: a directory of this user's
that no one else may write; one JSON file per key, written atomically) or from this
process's memo, and computes and stores it otherwise. A file is data, never code: sympy
expressions are stored as trees of a few known functions, symbols and integers (`_encode`),
rebuilt without `eval` (`_decode`), and every field read is checked; a result that does not
survive that round trip unchanged is not stored.

The key holds everything the result depends on: the chunk program's code (and its
sub-graphs'), each placeholder's shape (symbols renamed in order of appearance, so two
captures of the same model agree), dtype, stride and device, the placeholder roles the
trace feeds (`shapes._input_specs`), the attention sites, the parameters' shapes and
dtypes, the batch, the requested example (c0, p0), the partition, the policies, the device
(and GPU name), AOTAutograd's config, torch's version and a digest of sppo_fx's sources, so
a change to any pass never reads an entry the old code made. A stored file whose key
differs is ignored and overwritten; one that cannot be read or holds a bad value too, with
a warning naming it.
`SPPO_FX_MEMORY_MODEL_CACHE=off` neither reads nor writes (nor keeps the memo).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time

import sympy
import torch
import torch.fx as fx

from sppo_fx.util.disk_cache import cache_root, enabled, private_dir, read_private, source_digest, write_atomically
from sppo_fx.util.log import get_logger, phase
from sppo_fx.passes.cost.data import AllocatedTensor, SavedTensor
from sppo_fx.passes.cost.saved import saved_tensors_by_policy
from sppo_fx.passes.cost.shapes import _input_specs

log = get_logger(__name__)
ENV = "SPPO_FX_MEMORY_MODEL_CACHE"
FORMAT = 3  # 3: and what the graphs allocate; 2: saved tensors alone; 1: pickles (never read)

_memo: dict[str, tuple] = {}  # file path -> result (saved tensors, example, allocated tensors)


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


def _path(key: dict) -> str | None:
    """The file of `key`, None when the cache directory is not private (then no cache)."""
    directory = private_dir("memory_model", "memory model cache")
    if directory is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(directory, f"{key['device']['type']}-{digest}.json")


def _copy(result):
    by_policy, example, allocated = result
    return ({policy: list(saved) for policy, saved in by_policy.items()}, tuple(example),
            {policy: tuple(a) for policy, a in allocated.items()})


class _Unstorable(Exception):
    """A value outside what the file format holds."""


def _expression_classes() -> dict:
    from torch.utils._sympy import functions as tf
    classes = {cls.__name__: cls for cls in (sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min,
                                             sympy.floor, sympy.ceiling, sympy.Mod)}
    for name in ("FloorDiv", "CeilDiv", "CleanDiv", "ModularIndexing", "PythonMod", "Mod", "Max", "Min"):
        cls = getattr(tf, name, None)
        if cls is not None:
            classes[f"torch.{name}"] = cls
    return classes


def _encode(value):
    """A JSON tree of an int or a sympy expression: ints as ints, {"i": n} a sympy Integer,
    {"q": [p, q]} a Rational, {"s": name, "a": assumptions} a Symbol, {"f": function,
    "args": [...]} a known function. Raises _Unstorable for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, sympy.Integer):
        return {"i": int(value)}
    if isinstance(value, sympy.Rational):
        return {"q": [int(value.p), int(value.q)]}
    if isinstance(value, sympy.Symbol) and type(value) is sympy.Symbol:
        return {"s": value.name, "a": {k: v for k, v in value.assumptions0.items() if v is not None}}
    for name, cls in _expression_classes().items():
        if type(value) is cls:
            return {"f": name, "args": [_encode(a) for a in value.args]}
    raise _Unstorable(f"{type(value).__name__} {value!r}")


def _decode(tree):
    """The value `_encode` wrote; ValueError for anything it cannot have written."""
    if isinstance(tree, int) and not isinstance(tree, bool):
        return tree
    if isinstance(tree, dict) and set(tree) == {"i"} and type(tree["i"]) is int:
        return sympy.Integer(tree["i"])
    if isinstance(tree, dict) and set(tree) == {"q"} and isinstance(tree["q"], list) and len(tree["q"]) == 2 \
            and all(type(v) is int for v in tree["q"]) and tree["q"][1] > 0:
        return sympy.Rational(*tree["q"])
    if isinstance(tree, dict) and set(tree) == {"s", "a"} and isinstance(tree["s"], str) and tree["s"] \
            and isinstance(tree["a"], dict):
        from sympy.core.assumptions import _assume_defined
        if not all(k in _assume_defined and isinstance(v, bool) for k, v in tree["a"].items()):
            raise ValueError(f"bad assumptions of symbol {tree['s']!r}: {tree['a']!r}")
        return sympy.Symbol(tree["s"], **tree["a"])
    if isinstance(tree, dict) and set(tree) == {"f", "args"} and isinstance(tree["args"], list):
        cls = _expression_classes().get(tree["f"])
        if cls is None:
            raise ValueError(f"unknown function {tree['f']!r}")
        return cls(*[_decode(a) for a in tree["args"]])
    raise ValueError(f"not an expression: {str(tree)[:80]}")


_KINDS = ("kv", "kv_concat", "mask", "input", "activation")


def _encode_saved(s: SavedTensor) -> dict:
    return {"name": s.name, "shape": [_encode(e) for e in s.shape_expr], "dtype": str(s.dtype).removeprefix("torch."),
            "bytes": _encode(s.bytes_expr), "level": s.level, "kind": s.kind, "aliases": list(s.aliases),
            "exact": s.exact}


def _decode_saved(d) -> SavedTensor:
    if not isinstance(d, dict) or set(d) != {"name", "shape", "dtype", "bytes", "level", "kind", "aliases", "exact"}:
        raise ValueError(f"not a saved tensor: {str(d)[:80]}")
    dtype = getattr(torch, d["dtype"], None) if isinstance(d["dtype"], str) else None
    ok = (isinstance(d["name"], str) and isinstance(d["shape"], list) and isinstance(dtype, torch.dtype)
          and d["level"] in (1, 2) and type(d["level"]) is int and d["kind"] in _KINDS
          and isinstance(d["aliases"], list) and all(isinstance(a, str) for a in d["aliases"])
          and isinstance(d["exact"], bool))
    if not ok:
        raise ValueError(f"bad field in saved tensor {str(d)[:80]}")
    return SavedTensor(d["name"], tuple(_decode(e) for e in d["shape"]), dtype, _decode(d["bytes"]), d["level"],
                       d["kind"], tuple(d["aliases"]), d["exact"])


def _encode_allocated(a: AllocatedTensor) -> dict:
    return {"bytes": _encode(a.bytes_expr), "backward": a.backward, "matmul": a.matmul, "count": a.count}


def _decode_allocated(d) -> AllocatedTensor:
    if not isinstance(d, dict) or set(d) != {"bytes", "backward", "matmul", "count"} \
            or not (isinstance(d["backward"], bool) and isinstance(d["matmul"], bool)
                    and type(d["count"]) is int and d["count"] > 0):
        raise ValueError(f"not an allocated tensor: {str(d)[:80]}")
    return AllocatedTensor(_decode(d["bytes"]), d["backward"], d["matmul"], d["count"])


def _encode_result(key: dict, result) -> bytes:
    """The file's bytes; raises _Unstorable when reading them back would not give `result`
    exactly (same values and types)."""
    by_policy, example, allocated = result
    data = {"key": key, "saved": {policy: [_encode_saved(s) for s in saved] for policy, saved in by_policy.items()},
            "example": [int(example[0]), int(example[1])],
            "allocated": {policy: [_encode_allocated(a) for a in allocs] for policy, allocs in allocated.items()}}
    text = json.dumps(data)
    again = _decode_result(json.loads(text), key)

    def exact(r):
        typed = lambda items: [tuple((type(v), v) for v in dataclasses.astuple(x)) for x in items]  # noqa: E731
        return ({pol: typed(saved) for pol, saved in r[0].items()}, {pol: typed(a) for pol, a in r[2].items()})
    if again is None or exact(again) != exact(result) or again[1] != tuple(example):
        raise _Unstorable("the stored form would read back differently")
    return text.encode()


def _decode_result(data, key: dict):
    """The result held in a file's JSON, None when it is another key's; ValueError for a
    value that no stored result has."""
    if not isinstance(data, dict) or set(data) != {"key", "saved", "example", "allocated"}:
        raise ValueError("not a stored memory model")
    if data["key"] != json.loads(json.dumps(key)):  # as JSON holds it: tuples are lists
        return None
    by_policy, example = data["saved"], data["example"]
    if not isinstance(by_policy, dict) or set(by_policy) != set(key["recomputes"]) \
            or not all(isinstance(v, list) for v in by_policy.values()):
        raise ValueError(f"the recompute policies {sorted(by_policy) if isinstance(by_policy, dict) else by_policy!r} "
                         f"are not {key['recomputes']}")
    if not (isinstance(example, list) and len(example) == 2 and all(type(v) is int and v >= 0 for v in example)
            and example[0] > 0):
        raise ValueError(f"bad example chunk {example!r}")
    allocated = data["allocated"]
    if not isinstance(allocated, dict) or set(allocated) != set(key["recomputes"]) \
            or not all(isinstance(v, list) for v in allocated.values()):
        raise ValueError("the allocated tensors are not stored per recompute policy")
    return ({policy: [_decode_saved(s) for s in saved] for policy, saved in by_policy.items()}, tuple(example),
            {policy: tuple(_decode_allocated(a) for a in allocs) for policy, allocs in allocated.items()})


def _read(path: str, key: dict):
    try:
        data = json.loads(read_private(path))
        return _decode_result(data, key)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a corrupt, foreign or planted file: compute again, never fail
        log.warning("ignoring the stored memory model %s (%s: %s); tracing again", path, type(e).__name__, e)
        return None


def _write(path: str, key: dict, result) -> None:
    try:
        data = _encode_result(key, result)
    except _Unstorable as e:
        log.debug("memory model not stored (%s)", e)
        return
    try:
        write_atomically(path, data)
        log.info("memory model stored in %s", path)
    except OSError as e:
        log.warning("could not store the memory model in %s: %s", path, e)


def stored_saved_tensors_by_policy(program, values, batch: int, *, params: list[torch.Tensor] | None = None,
                                   seq=None, partition: str = "default", example: tuple[int, int] | None = None,
                                   device=None, recomputes=("none",), announce: bool = True
                                   ) -> tuple[dict[str, list[SavedTensor]], tuple[int, int], dict[str, tuple]]:
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
    if path is None:
        return traced()
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
    in a forked child process while this one traces the first (`sppo_fx/util/forked.py`): two
    AOTAutograd traces are Python work that one process can only run one after the other.
    The child stores its result on disk like this process; its result is kept in this
    process's memo too. Same results as calling `stored_saved_tensors_by_policy` twice."""
    import functools
    from sppo_fx.util.forked import ForkedCall, can_fork

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
