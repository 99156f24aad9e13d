"""Shared helpers: eager reference gradients and a builder for hand-made FX graphs."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
import torch.utils._python_dispatch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from sppo_fx.runtime.launch import set_process_starter
from sppo_fx.util.compat import symbolic_dispatch

RTOL, ATOL = 1e-4, 1e-5

# Chunk 0's background Inductor compile (sppo_fx/codegen/background.py, opt-in) forks a child that
# compiles for minutes and is not what most tests check; off for the suite (and the rank
# processes it starts) unless a test turns it on (tests/codegen/test_first_step.py).
os.environ.setdefault("SPPO_FX_BACKGROUND_COMPILE", "off")

# Modules the tests import and the rank scripts they start live in tests/helpers/ once the
# tests sit in folders (docs/testing.md); before that they sit beside this file.
_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if os.path.isdir(_HELPERS) and _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)

# Rank launches (`start_local_ranks`) fork their ranks from a process that has already
# imported torch, sppo_fx and transformers (tests/helpers/zygote.py) rather than start fresh
# interpreters that import them again; SPPO_TEST_FORK_RANKS=0 turns it off (docs/testing.md).
import zygote  # noqa: E402

# The suite's rank processes run torch's fake-tensor dispatch cache off (unless the test's
# env sets TORCH_FAKE_TENSOR_DISPATCH_CACHE): a rank exports a tiny model once, in a fresh
# process, so nearly every op misses the cache, and a miss costs more than it saves (as in
# tests/fuzz/runner.py). The pytest workers keep torch's default: they export the same models
# test after test and hit it. Measured in docs/testing.md; the product keeps torch's default.
RANK_ENV_DEFAULTS = {"TORCH_FAKE_TENSOR_DISPATCH_CACHE": "0"}


def start_rank(cmd, *, env=None, **kwargs):
    """`start_local_ranks`'s starter in the suite: `RANK_ENV_DEFAULTS` under the rank's env,
    forked from a zygote (SPPO_TEST_FORK_RANKS, read at each launch) or started by Popen."""
    env = {**RANK_ENV_DEFAULTS, **(os.environ if env is None else env)}
    start = zygote.start_process if zygote.enabled() else subprocess.Popen
    return start(cmd, env=env, **kwargs)


set_process_starter(start_rank)


# the tiny models widened so that their saved activations pass the 64 KiB offload threshold
WIDE = {"gpt": {"n_embd": 128}, "llama": {"dim": 128, "ffn_dim": 256}}


def tiny_model(kind, layers=1):
    """A fresh widened tiny `kind` model (seed 0), `layers` blocks deep: a test whose checks
    do not depend on depth traces one block's chunk programs (Dynamo and AOTAutograd, or
    Inductor's kernels) instead of `tiny_program`'s two."""
    from sppo_fx.models import build
    torch.manual_seed(0)
    return build(kind, "tiny", **WIDE[kind], **{"n_layer" if kind == "gpt" else "n_layers": layers})


def tiny_hf_llama():
    """A 2-layer Hugging Face `LlamaForCausalLM` (vocab 128, hidden 64, 4 heads, 2 K/V
    heads). transformers is a pinned test dependency (requirements-ci.txt): a missing one
    fails the test rather than skipping it."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg)


def held_and_reused(code: str) -> tuple[set, list]:
    """In Inductor's generated wrapper `code`: the buffers handed to `sppo.offload`/`sppo.kv_out`
    (directly or through `reinterpret_tensor`), and the buffers it reuses for a new one."""
    import re
    held = set(re.findall(r"torch\.ops\.sppo\.(?:offload|kv_out)\.default\((?:reinterpret_tensor\()?(\w+)", code))
    reused = [old for _, old in re.findall(r"(\w+) = (?:reinterpret_tensor\()?(\w+)[^\n]*; del \w+\s+# reuse", code)]
    return held, reused


def one_site_chunk_program(**attention_kwargs) -> fx.GraphModule:
    """A hand-built chunk program of one attention site, `prefix_causal_attention(q, kp, k,
    vp, v, **attention_kwargs)`, returning (relu(out), k, v)."""
    from sppo_fx.chunk_attention.functions import prefix_causal_attention
    g = fx.Graph()
    q, kp, k, vp, v = (g.placeholder(n) for n in ("q", "s_k_prefix", "k", "s_v_prefix", "v"))
    out = g.call_function(prefix_causal_attention, (q, kp, k, vp, v), attention_kwargs)
    g.output((g.call_function(torch.relu, (out,)), k, v))
    return fx.GraphModule(torch.nn.Module(), g)


def tiny_program(kind):
    """(model, Captured, ChunkedProgram) of the tiny `kind` model widened so that its saved
    activations pass the offload threshold; built once per session and shared between
    tests, so its gradients are cleared on every call."""
    model, cap, program = _tiny_program(kind)
    model.zero_grad(set_to_none=True)
    return model, cap, program


_OFFLOAD_PROGRAMS: dict = {}

# Tests that run `offload_program`'s compiled programs run on one xdist worker (--dist
# loadgroup), so that each (tiny program, skeleton mode) is captured and compiled once.
SHARES_OFFLOAD_PROGRAMS = pytest.mark.xdist_group("offload_programs")


def offload_program(program, skeleton="keep"):
    """`program`'s chunk program with offload nodes run eagerly (with skeleton="offload":
    streamed from the skeleton), as the orchestrator compiles it for a store; built once
    per program and mode (the key holds the chunk graph, so its id is not reused)."""
    from sppo_fx.orchestrate import compile_chunk
    key = (id(program.chunk), skeleton)
    if key not in _OFFLOAD_PROGRAMS:
        _OFFLOAD_PROGRAMS[key] = (program.chunk, compile_chunk(program, skeleton=skeleton))
    return _OFFLOAD_PROGRAMS[key][1]


@functools.lru_cache(maxsize=None)
def _tiny_program(kind):
    from sppo_fx.capture import capture
    from sppo_fx.models import build
    from sppo_fx.passes import transform
    model = build(kind, "tiny", **WIDE[kind])
    x = torch.randint(0, 97, (2, 64))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    return model, cap, transform(cap)[1]


def eager_loss_and_grads(model, call):
    """(loss, {name: grad}) of `call(model)` run eagerly on the full sequence."""
    model.zero_grad(set_to_none=True)
    loss = call(model)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def record_skeleton_traffic(monkeypatch):
    """Patch the executor to record, for each chunk forward, the bytes it read back from the
    K/V skeleton (skeleton="offload"), and for each micro-batch the skeleton's peak stored
    bytes. Returns the (reads, peaks) lists the steps fill."""
    from sppo_fx.runtime.local import StageRunner
    reads, peaks = [], []
    forward, finish = StageRunner.forward, StageRunner.finish_forward

    def recording_forward(self, mb, i, recvs=()):
        m = self.microbatches[mb]
        before = m.skeleton.bytes_read if m.skeleton is not None else 0
        sends = forward(self, mb, i, recvs)
        reads.append(m.skeleton.bytes_read - before)
        return sends

    def recording_finish(self, mb):
        peaks.append(self.microbatches[mb].skeleton.peak_bytes_held)
        return finish(self, mb)

    monkeypatch.setattr(StageRunner, "forward", recording_forward)
    monkeypatch.setattr(StageRunner, "finish_forward", recording_finish)
    return reads, peaks


def assert_matches_eager(model, eager_call, compiled_call, rtol=RTOL, atol=ATOL):
    """Loss and every parameter gradient of `compiled_call` equal the eager ones."""
    ref_loss, ref_grads = eager_loss_and_grads(model, eager_call)
    loss = compiled_call()
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=rtol, atol=atol)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert ref_grads, "the eager reference produced no gradients"
    for name, p in model.named_parameters():
        if name in ref_grads:
            assert p.grad is not None, f"no gradient for {name}"
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert len(ref_grads) == len(set(names) & set(ref_grads))
    model.zero_grad(set_to_none=True)
    return loss


class HandGraph:
    """Build an FX graph by hand with symbolic-shape metadata like torch.export's.

    `T` is the SymInt sequence length; `input`/`param` add placeholders, `call` adds an op
    whose meta["val"] is computed on fake tensors.
    """

    def __init__(self, example_len: int = 16):
        self.mode = FakeTensorMode(shape_env=ShapeEnv())
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
        self._seq_source = self.mode.from_tensor(torch.zeros(example_len), symbolic_context=ctx)
        self.T = self._seq_source.shape[0]
        self.seq = self.T.node.expr
        self.graph = fx.Graph()
        self.params: list[str] = []
        self.inputs: list[str] = []

    def _placeholder(self, name, shape, dtype):
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def input(self, name, shape, dtype=torch.float32):
        self.inputs.append(name)
        return self._placeholder(name, shape, dtype)

    def param(self, name, shape, dtype=torch.float32):
        self.params.append(name)
        return self._placeholder(name, shape, dtype)

    def call(self, target, *args, **kwargs):
        node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode, symbolic_dispatch():
            node.meta["val"] = target(*vals[0], **vals[1])
        node.meta["stack_trace"] = f'File "hand_built.py", line {len(self.graph.nodes)}, in forward\n    {node.name} = ...'
        return node

    def size(self, node, dim):
        return self.call(torch.ops.aten.sym_size.int, node, dim)

    def output(self, node) -> fx.GraphModule:
        self.graph.output((node,))
        return fx.GraphModule(torch.nn.Module(), self.graph)


# Single cases of parametrized tests that take over ~10 s on 2 cores while the test's other
# cases are quick (whole tests carry @pytest.mark.slow themselves). Keyed by file name and
# test id, so the table holds wherever the file sits under tests/.
SLOW_CASES = {
    "test_bad_inputs.py::test_bad_input_is_refused_before_any_gradient[budget-below-minimum]",
    "test_fuzz.py::test_almost_causal_masks_are_exact_or_refused[window-3]",
}

# Cells of cross products (family x attention implementation, family x option) that only the
# full suite runs. The development tier keeps every family and every variant at least once
# (the cells not listed here); what it leaves out is a combination whose family and variant
# it covers in other cells. Each cell is a tiny model's torch.export (1-3 s on 2 cores),
# which is what the development tier's 3-minute budget is made of.
FULL_TIER_CELLS = {
    # every family keeps its default attention; written-out attention stays for llama,
    # gemma2, gpt2 and falcon (four different recogniser paths)
    *(f"test_hf_families.py::test_family_trains_exactly_in_chunks[{family}-eager]"
      for family in ("mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt_neox", "olmo2", "gptj", "cohere")),
    "test_moe.py::test_moe_family_trains_exactly_in_chunks[mixtral-False]",
    "test_moe.py::test_moe_family_trains_exactly_in_chunks[qwen3_moe-True]",
    "test_ones_inputs.py::test_all_ones_mask_trains_exactly_and_a_padded_call_is_refused_before_any_step[gpt2]",
    "test_ones_inputs.py::test_all_ones_mask_trains_exactly_and_a_padded_call_is_refused_before_any_step[falcon]",
    "test_sliding_window.py::test_every_windowed_family_matches_eager[eager-mistral]",
    "test_sliding_window.py::test_every_windowed_family_matches_eager[sdpa-qwen2]",
    "test_sliding_window.py::test_every_windowed_family_matches_eager[sdpa-gemma2]",
    "test_sliding_window.py::test_every_windowed_family_matches_eager[eager-gemma3]",
    "test_gpt_oss.py::test_gpt_oss_trains_exactly_in_chunks[True-None]",
    "test_gpt_oss.py::test_gpt_oss_trains_exactly_in_chunks[False-eager]",
    # [batch-chunks-kind]: each kind keeps every chunk count once and both batch sizes
    *(f"test_exactness.py::test_reference_models_match_eager[{cell}]"
      for cell in ("1-1-gpt", "1-3-gpt", "3-2-gpt", "3-7-gpt", "1-2-llama", "1-7-llama", "3-1-llama", "3-3-llama")),
}


def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        key = f"{item.path.name}::{item.name}"
        if key in SLOW_CASES or key in FULL_TIER_CELLS:
            item.add_marker(pytest.mark.slow)
            seen.add(key)
    files = {item.path.name for item in items}
    stale = sorted(k for k in (SLOW_CASES | FULL_TIER_CELLS) - seen if k.split("::")[0] in files and "[" in k
                   and any(item.path.name == k.split("::")[0] and item.originalname == k.split("::")[1].split("[")[0]
                           for item in items))
    for key in stale:  # the case was renamed: say so rather than let it run in the quick tier
        item = next(i for i in items if i.path.name == key.split("::")[0])
        item.warn(pytest.PytestWarning(f"conftest.SLOW_CASES or FULL_TIER_CELLS names {key}, which no longer exists"))
    # Files with slow tests first, each file's tests in their order: xdist hands the long
    # tests out early, rather than one worker finishing a long test alone at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    _group_for_xdist(config, items)


def _group_for_xdist(config, items):
    """Give each test marked `xdist_group(name)` the node id suffix "@name" that
    `--dist loadgroup` sends a group to one worker by. pytest-xdist (3.8) appends it to
    `item._nodeid`, which pytest 9.2 no longer reads (the id lives in `item._id`): every
    group was silently ignored, and a grouped module's expensive module fixture (Triton
    subprocesses, a rank launch, captured programs) was built on both workers."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix):  # none, or xdist's own suffix took effect
            continue
        node_id = getattr(item, "_id", None)
        if node_id is None or isinstance(node_id, str) or not hasattr(type(node_id), "parse"):
            continue  # an older pytest, where xdist's `_nodeid` suffix works
        item._id = type(node_id).parse(item.nodeid + suffix)


@pytest.fixture
def hand():
    return HandGraph()


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """sppo_fx's disk caches (device profile, memory model: `sppo_fx/util/disk_cache.py`) in one
    directory per test session: the suite never reads or writes ~/.cache, and its tests
    (and the subprocesses they start, which inherit the variable) share one cache. A test
    that needs a cold cache sets its own SPPO_FX_CACHE_DIR. The xdist workers of one run share
    it (their base temp dirs sit in the run's): each profile and memory model is measured by
    one worker, not by each; the caches write atomically, for concurrent processes."""
    previous = os.environ.get("SPPO_FX_CACHE_DIR")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "sppo_fx_cache"
        path.mkdir(mode=0o700, exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("sppo_fx_cache")
    os.environ["SPPO_FX_CACHE_DIR"] = str(path)
    yield
    if previous is None:
        os.environ.pop("SPPO_FX_CACHE_DIR", None)
    else:
        os.environ["SPPO_FX_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_forked_backward_compile(monkeypatch):
    """Compiles in the suite's processes keep the backward graph here: whether a compile
    forks would otherwise depend on the other worker's load at that instant
    (`split_compile.a_core_is_free`). tests/codegen/test_split_compile.py turns it back on."""
    from sppo_fx.codegen import split_compile
    monkeypatch.setattr(split_compile, "a_core_is_free", lambda: False)


class StoreTraffic:
    """Counts what goes through an ActivationStore: bytes handed to `offload` and bytes
    `wait` returned, wrapping the instance's methods (the store's own counters say what is
    in the tier now and at most; these say what moved in total)."""

    def __init__(self, store):
        self.store = store
        self.offloaded_bytes = self.read_bytes = self.offloads = 0
        offload, wait = store.offload, store.wait
        seen = set()

        def counted_offload(tensor, *args, **kwargs):
            self.offloads += 1
            self.offloaded_bytes += tensor.numel() * tensor.element_size()
            return offload(tensor, *args, **kwargs)

        def counted_wait(handle):
            t = wait(handle)
            if id(handle) not in seen:  # repeated waits on one handle return the same tensor
                seen.add(id(handle))
                self.read_bytes += t.numel() * t.element_size()
            return t

        store.offload, store.wait = counted_offload, counted_wait


def _can_fork():
    from sppo_fx.util.forked import can_fork
    return can_fork()


# tests of sppo_fx/util/forked.py's fork path (it computes in this process where it cannot fork)
needs_fork = pytest.mark.skipif(not _can_fork(), reason="needs Linux with more than one CPU (os.fork, "
                                                        "os.sched_getaffinity) and SPPO_FX_FORK not off")


class RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher (`names`), e.g.
    "aten.mm" or "sppo_fx.chunk_attention_fwd"."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
