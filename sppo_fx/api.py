"""`sppo_fx.compile`: function and decorator forms.

    compiled = sppo_fx.compile(model, chunks=4)               # model returns the loss
    loss = compiled(tokens, targets)
    loss.backward()                                           # fills model's .grad

    compiled = sppo_fx.compile(model, loss_fn=F.cross_entropy_on_logits, chunks=4)
    loss = compiled(tokens, target=targets)

    @sppo_fx.compile(chunks=4)
    def step(model, tokens, targets):
        return model(tokens, targets)
    loss = step(model, tokens, targets)

Capture happens on the first call (it needs example inputs); later calls with another
sequence length re-plan the chunks without re-tracing while the traced range allows it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx

from sppo_fx.capture import flatten_call
from sppo_fx.codegen import CompiledProgram
from sppo_fx.errors import SppoError
from sppo_fx.util.log import get_logger, phase
from sppo_fx.options import CompileOptions, check_inputs, compile_options, seq_len_of
from sppo_fx.orchestrate import Entry, chunk_plan, plan_call, prepare, stage_product
from sppo_fx.passes.masks.values import check_ones_inputs
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan
from sppo_fx.runtime.local import chunked_loss
from sppo_fx.solver.partition import ChunkCostModel

log = get_logger(__name__)


class SppoCompiled:
    """The callable `sppo_fx.compile` returns.

    Attributes:
        plan: the chunk plan of the last call (None before the first call).
    """

    def __init__(self, model: torch.nn.Module | None, fn: Callable | None, options: CompileOptions):
        self._model, self._fn, self.options = model, fn, options
        self._cache: dict = {}
        self._last: Entry | None = None
        self.plan: Plan | None = None
        self.pipeline = None
        self._last_chunk_fn = None  # what ran the chunks in the last call
        self._stores: dict = {}  # tier -> ActivationStore, made when a product first runs on it
        self.profile = None  # solver.profiles.DeviceProfile used by the budget solver
        self._mesh = None  # runtime.mesh.ParallelMesh, on the first distributed step

    # ---- planning -------------------------------------------------------------------
    def plan_for(self, seq_len: int, cost: ChunkCostModel | None = None) -> Plan:
        """The chunk plan for a sequence of `seq_len` tokens.

        Args:
            seq_len: tokens in the sequence.
            cost: the model's chunk cost; with partition="balanced" the chunks get equal
                FLOPs (without it, or with partition="even", equal lengths).
        """
        return chunk_plan(self.options, seq_len, cost)

    # ---- calling --------------------------------------------------------------------
    def __call__(self, *args, target=None, **kwargs):
        if self.options.layout.distributed:
            raise SppoError(f"a model compiled for {self.options.layout} runs on several ranks: call "
                            "compiled.step(...) on every rank (it does forward and backward)")
        if self._fn is not None:
            if not args or not isinstance(args[0], torch.nn.Module):
                raise SppoError("a function compiled with @sppo_fx.compile is called as "
                                "fn(model, *inputs); its first argument must be the nn.Module")
            model, args = args[0], args[1:]
        else:
            model = self._model
        leaves, spec, slots = flatten_call(args, kwargs, target)
        tensors = [leaves[i] for i in slots]
        check_inputs(model, tensors, self.options.seq_dim)
        entry = self._entry(model, args, kwargs, target, leaves, spec, slots, tensors)
        cap = entry.captured
        lengths = [t.shape[d] for t, d in zip(tensors, cap.input_seq_dims) if d is not None]
        seq_len = lengths[0]
        if any(n != seq_len for n in lengths):
            raise SppoError(f"inputs disagree on the sequence length: {lengths}")
        plan, self.profile = plan_call(entry, self.options, seq_len, tensors, self.profile)
        if self.options.verify and not entry.verified:
            self._verify(model, entry, (args, kwargs, target), plan)
            entry.verified = True
        self.plan = plan
        return self._run(entry, tensors, plan)

    def _run(self, entry: Entry, tensors: list[torch.Tensor], plan: Plan) -> torch.Tensor:
        """The chunked loss of one call under `plan` (its backward fills the model's .grad)."""
        p = stage_product(entry, self.options, plan)
        self._last_chunk_fn = p.chunk_fn
        return chunked_loss(p.program, p.params, tensors, p.plan, p.chunk_fn, self._store_for(p.tier), p.offload,
                            skeleton=p.skeleton)

    def _verify(self, model, entry: Entry, call: tuple, plan: Plan) -> None:
        """verify=True on one stage: the plan's first chunks of this batch through the chunk
        program and through the model; raises SppoError at the first difference."""
        from sppo_fx.verify import SavedGrads, compare, fail, prefix_call, prefix_plan, reference
        short = prefix_plan(plan)
        with phase(f"verify: {short.seq_len} tokens in {short.num_chunks} chunks against the model", log):
            prefix = prefix_call(call, self.options.seq_dim, plan.seq_len, short.seq_len)
            leaves, _spec, slots = flatten_call(*prefix)
            with SavedGrads(model) as saved:
                loss = self._run(entry, [leaves[i] for i in slots], short)
                loss.backward()
                got = saved.take()
                ref_loss, ref = reference(model, self._fn, self.options.loss_fn, [prefix])
            fail(compare(list(model.named_parameters()), got, ref, loss.item(), ref_loss),
                 f"the first {short.seq_len} tokens of this batch")

    @property
    def store(self):
        """The ActivationStore the last plan's offloaded activations go to (None without
        `offload`): the tier of `options.tier_for(plan)`, the solver's choice with
        offload="auto" (None before the first call then)."""
        return self._store_for(self.options.tier_for(self.plan) if self.plan is not None else
                               self.options.offload if self.options.offload != "auto" else None)

    def _store_for(self, tier: str | None):
        """The ActivationStore of `tier` (made on first use, one per tier), None for none."""
        if tier is None:
            return None
        store = self._stores.get(tier)
        if store is None:
            from sppo_fx.runtime.store import TIERS, ActivationStore
            if tier not in TIERS:
                raise SppoError(f"offload tier {tier!r}: choose one of {TIERS}")
            store = self._stores[tier] = ActivationStore(tier, dir=self.options.offload_dir, reuse_files=True)
        return store

    def step(self, *args, target=None, **kwargs) -> torch.Tensor:
        """Forward and backward of one training step; returns the loss (detached).

        With stages == 1 this is `loss = compiled(...); loss.backward()` (per micro-batch,
        each scaled by 1/microbatches). With stages > 1 it runs this rank's pipeline stage
        under the schedule; every rank returns the loss, and each parameter's gradient is
        accumulated into `.grad` on the ranks whose stage uses it.
        """
        from sppo_fx.orchestrate import build_rank
        from sppo_fx.runtime.pipeline import data_shares, pipeline_step, split_microbatches, start
        o = self.options
        model = self._model
        if self._fn is not None:
            model, args = args[0], args[1:]
        mbs = split_microbatches(args, kwargs, target, o.microbatches)
        if not o.layout.distributed:
            total = 0.0
            for a, k, t in mbs:
                call_args = (model, *a) if self._fn is not None else a
                loss = self(*call_args, target=t, **k)
                check_ones_inputs(self._last.graph, (args, kwargs, target))  # all micro-batches, before a backward
                (loss / o.microbatches).backward()
                total = total + loss.detach()
            return total / o.microbatches
        mesh = self._parallel_mesh()
        mbs = data_shares(mbs, mesh)
        leaves, _spec, slots = flatten_call(*mbs[0])
        tensors = [leaves[i] for i in slots]
        check_inputs(model, tensors, o.seq_dim)
        seq_len = seq_len_of(tensors, o.seq_dim)
        self.plan_for(seq_len)  # fail before tracing
        key = ("pipeline", id(model), tuple((tuple(t.shape), t.dtype) for t in tensors))
        state = self._cache.get(key)
        if state is None:
            first = not any(isinstance(k, tuple) and k[0] == "pipeline" for k in self._cache)
            state = build_rank(model, self._fn, o, mbs, mesh, check_values=first)
            state.executor = start(state.product, mesh, self._store_for(state.product.tier), o.timeout_s)
            check_ones_inputs(state.graph, (args, kwargs, target))  # before verify's step
            if o.verify:
                self._verify_pipeline(model, (args, kwargs, target), mesh, state)
            self._cache[key] = state
        check_ones_inputs(state.graph, (args, kwargs, target))  # every step: inputs assumed all ones
        self.plan = state.plan
        self.pipeline = state
        return pipeline_step(state.executor, mbs)

    def _verify_pipeline(self, model, call: tuple, mesh, state) -> None:
        """verify=True on several ranks: the plan's first chunks of this batch through a
        pipeline built for them (same layout, schedule and chunk lengths) and through the
        model on every rank; every rank raises the same SppoError at the first difference
        found on any rank. Collective."""
        from sppo_fx.orchestrate import build_rank
        from sppo_fx.runtime.pipeline import data_shares, pipeline_step, split_microbatches, start
        from sppo_fx.verify import SavedGrads, agree, compare, fail, prefix_call, prefix_plan, reference
        o = self.options
        short = prefix_plan(state.plan)
        with phase(f"verify: {short.seq_len} tokens in {short.num_chunks} chunks against the model", log):
            prefix = prefix_call(call, o.seq_dim, state.plan.seq_len, short.seq_len)
            every = split_microbatches(*prefix, o.microbatches)
            options = dataclasses.replace(o, plan=short, budget=None, chunks=None, chunk_lengths=None)
            with SavedGrads(model) as saved:
                prefix_state = build_rank(model, self._fn, options, data_shares(every, mesh), mesh, check_values=False)
                executor = start(prefix_state.product, mesh, self._store_for(prefix_state.product.tier), o.timeout_s)
                loss = pipeline_step(executor, data_shares(every, mesh))
                got = saved.take()
                ref_loss, ref = reference(model, self._fn, o.loss_fn, every)
            cap = prefix_state.captured
            mine = {cap.param_fqns[n][1].removeprefix("model.") for n in prefix_state.program.params
                    if cap.param_fqns[n][0] == "parameter"}
            named = list(model.named_parameters())
            verdict = compare(named, {n: g for n, g in got.items() if n in mine}, ref, float(loss), ref_loss)
            device = next((p.device for _n, p in named), torch.device("cpu"))
            fail(agree(verdict, named, device), f"the first {short.seq_len} tokens of this batch")

    def _parallel_mesh(self):
        """The ParallelMesh of this process (made, with its process groups, on first use)."""
        from sppo_fx.runtime.mesh import ParallelMesh, require_world
        if self._mesh is None:
            o = self.options
            if o.mesh is not None:
                require_world(o.layout)
                mesh = ParallelMesh.from_device_mesh(o.mesh, o.timeout_s)
            else:
                mesh = ParallelMesh(o.layout, require_world(o.layout), timeout_s=o.timeout_s)
            mesh.create_groups()
            self._mesh = mesh
        return self._mesh

    def _entry(self, model, args, kwargs, target, leaves, spec, slots, tensors) -> Entry:
        seq_dim = self.options.seq_dim
        key_shapes = tuple((tuple(s if i != seq_dim else -1 for i, s in enumerate(t.shape)), t.dtype,
                            t.device.type) for t in tensors)
        others = tuple(repr(leaves[i]) for i in range(len(leaves)) if i not in set(slots))
        key = (id(model), str(spec), key_shapes, others)
        entry = self._cache.get(key)
        if entry is not None:
            seq_len = next((t.shape[d] for t, d in zip(tensors, entry.captured.input_seq_dims)
                            if d is not None), None)
            lo, hi = entry.captured.seq_range
            if seq_len is not None and lo <= seq_len <= hi:
                self._last = entry
                return entry
        self.plan_for(seq_len_of(tensors, seq_dim))  # fail before tracing
        entry = prepare(model, self._fn, self.options, (args, kwargs, target), tensors)
        self._cache[key] = entry
        self._last = entry
        return entry

    # ---- inspection -----------------------------------------------------------------
    def _require_entry(self) -> Entry:
        if self._last is None:
            raise SppoError("nothing compiled yet: call the compiled model once with example inputs")
        return self._last

    @property
    def graphs(self) -> dict[str, fx.GraphModule]:
        """The transformed graphs by name: captured (analysed), prologue, chunk, epilogue;
        with offload or recompute, also the chunk program's AOT forward and backward graphs
        after the memory passes ("chunk.forward.K" / "chunk.backward.K" for its K-th
        compile: the offload/wait nodes are there)."""
        if self._last is None and self.pipeline is not None:  # this rank's stage program
            p = self.pipeline
            return {"captured": p.graph, "prologue": p.program.prologue, "chunk": p.program.chunk,
                    "epilogue": p.program.epilogue}
        e = self._require_entry()
        out = {"captured": e.graph, "prologue": e.program.prologue, "chunk": e.program.chunk,
               "epilogue": e.program.epilogue}
        if isinstance(self._last_chunk_fn, CompiledProgram):
            out.update({f"chunk.{k}": g for k, g in self._last_chunk_fn.graphs().items()})
        return out

    @property
    def program(self) -> ChunkedProgram:
        """The ChunkedProgram of the last call."""
        return self._require_entry().program

    def predicted(self) -> tuple[int, float]:
        """(predicted peak extra bytes, predicted step seconds) of the last call's plan, from
        the budget solver's memory and time models, also for plans the solver did not
        choose (fixed chunks, a manual `offload` tier). Builds the memory model of the
        plan's recompute policy if no budget did (AOTAutograd traces: seconds)."""
        from sppo_fx.orchestrate.stage import device_profile, memory_models
        from sppo_fx.solver.predict import predict_plan
        e, o = self._require_entry(), self.options
        if self.plan.peak_bytes is not None and self.plan.step_seconds is not None:
            return self.plan.peak_bytes, self.plan.step_seconds
        (memory,) = memory_models(e, (o.recompute_for(self.plan),))
        self.profile = device_profile(e, o, self.profile)
        return predict_plan(e.cost, memory, self.plan, offload=o.tier_for(self.plan),
                            skeleton=o.skeleton_for(self.plan), profile=self.profile, device=e.device(),
                            compiled=o.compile)

    @property
    def mesh(self):
        """This rank's `runtime.mesh.ParallelMesh` (peers and process groups), after the first
        distributed step; None before it or without one."""
        return self._mesh

    def pipeline_prediction(self):
        """(chosen PipelinePrediction, all considered) for the last pipeline step, or None."""
        return None if self.pipeline is None else self.pipeline.prediction

    @property
    def codegen(self) -> CompiledProgram | None:
        """The Inductor-compiled chunk program of the last call (None with compile=False)."""
        self._require_entry()
        return self._last_chunk_fn if self.options.compile else None

    def explain(self) -> str:
        """A readable summary: chunk plan, attention sites, each program's inputs and outputs,
        and where Inductor's generated code is."""
        from sppo_fx.explain import explain
        e = self._require_entry()
        return explain(e.captured, e.program, self.plan, self.codegen)


def compile(model=None, *, loss_fn=None, chunks=None, chunk_lengths=None, seq_dim=1, budget=None,
            log_passes=None, compile=True, stages=1, microbatches=1, schedule="1f1b",  # noqa: A002
            split_points=None, timeout_s=60.0, partition="balanced", offload=None, offload_dir=None,
            recompute="auto", skeleton="auto", seq_parallel=1, data_parallel=1, mesh=None, plan=None,
            verify=False, ones_inputs=("attention_mask",), host_memory=None):
    """Compile a causal LM (or a `(model, *inputs) -> loss` function) for chunked training.

    Args:
        model: an nn.Module whose output is the loss (or logits with `loss_fn`), or a function
            `(model, *inputs) -> loss`; omit it to use `@sppo_fx.compile(...)` as a decorator.
        loss_fn: `(output, target) -> loss`; the compiled callable's `target=` goes to it.
        chunks: number of sequence chunks (default 4, fewer for shorter sequences).
        chunk_lengths: explicit chunk lengths, summing to the sequence length.
        seq_dim: the sequence dim of the inputs.
        budget: peak bytes a training step may add on the device (int or "12GiB"): the solver
            chooses the chunks and which chunks' activations go to the `offload` tier
            (default "auto": the faster predicted of host memory, on CUDA, and disk); a
            budget below the minimum raises InfeasibleBudget on the first call, before any
            step, naming the minimum. With stages > 1 the chunk lengths are
            shared and every rank solves its own offload ratios for its stage.
        log_passes: print each graph after its pass.
        compile: compile the chunk program with Inductor (C++ on CPU, Triton on GPU);
            False runs the FX graphs op by op, for debugging.
        stages: pipeline stages, one per rank (launch with torchrun; use `.step(...)`).
        microbatches: micro-batches per `.step` (the batch is split along dim 0).
        schedule: "1f1b" (chunk-level 1F1B) or "gpipe".
        split_points: module names where stages start, e.g. ["layers.4"] (default:
            cost-balanced, or the model's `sppo_fx.split_point` markers).
        timeout_s: seconds a rank waits for a peer before raising SppoError.
        partition: "balanced" chunk lengths with equal FLOPs (earlier chunks longer) or
            "even" lengths. With stages > 1 and neither chunks nor chunk_lengths given,
            the pipeline solver chooses the chunk count and lengths.
        offload: "disk" | "host" | "device": every chunk but the last of each sequence
            offloads its saved activations to that tier during forward and reads them back
            before its backward (prefetched one chunk ahead). Gradients are bitwise those of
            the same chunking without offload (compile=False).
            With a budget, "auto" (the default there) lets the solver choose the tier
            (`plan.tier`): host memory only on CUDA and within `host_memory`, else disk.
        offload_dir: where the disk tier writes (default: the system's temp dir).
        host_memory: host bytes (int or "64GiB") the host tier may pin under a budget;
            default: half of the host's available memory, split between the processes
            torchrun starts on the host.
        recompute: "auto" (with a budget the solver picks "none", "cheap" or "full" per
            sequence length; otherwise "none"), or one of those: recompute everything but
            matmuls and attention ("cheap") or the whole chunk ("full") in backward
            instead of saving it.
        skeleton: "auto", "keep" or "offload": where the K/V skeleton lives (see
            `CompileOptions`); "offload" needs an `offload` tier (a budget implies "disk")
            and stages=1.
        seq_parallel: sequence-parallel ranks S per stage: each holds 1/S of every chunk's
            tokens, and all-to-alls around attention give it all tokens of 1/S of the heads
            (the query heads, and the K/V heads or S, must divide by S).
        data_parallel: data-parallel replicas D: each takes 1/D of every micro-batch's
            sequences. World size = stages · data_parallel · seq_parallel (torchrun); every
            rank passes the same full batch to `.step`, and after it every rank holding a
            parameter holds its full gradient.
        mesh: a `torch.distributed.device_mesh.DeviceMesh` with dims named "pp", "dp" and
            "sp" (any subset), instead of stages / data_parallel / seq_parallel.
        plan: a `Plan` (or its JSON, or a path to a `.json` file from `sppo-fx plan --json`)
            to run as given: chunk lengths and, with seq_parallel, each chunk's split.
        verify: at the first call, run the plan's first chunks of the batch (at most 3,
            never the last of a longer plan) through the transformed program and through
            the unmodified model, and raise SppoError naming the first parameter whose
            gradient differs, and by how much (also across pipeline and sequence-parallel
            ranks, which agree on the verdict). Costs one eager and one chunked step over
            that prefix (sppo_fx/verify.py).
        ones_inputs: call keywords of inputs (default `attention_mask`) that, all ones in the
            first call of a model refused with them as data, become constant ones, checked
            at every call (a padded one raises SppoError); () turns this off.

    Returns:
        An `SppoCompiled` callable: `compiled(*args, target=None, **kwargs) -> loss`, or a
        decorator when `model` is omitted.
    """
    options = compile_options(loss_fn=loss_fn, chunks=chunks, chunk_lengths=chunk_lengths, seq_dim=seq_dim,
                              budget=budget, log_passes=log_passes, compile=compile, stages=stages,
                              microbatches=microbatches, schedule=schedule, split_points=split_points,
                              timeout_s=timeout_s, partition=partition, offload=offload, offload_dir=offload_dir,
                              recompute=recompute, skeleton=skeleton, seq_parallel=seq_parallel,
                              data_parallel=data_parallel, mesh=mesh, plan=plan, verify=verify,
                              ones_inputs=ones_inputs, host_memory=host_memory)
    if model is None:
        return lambda fn: _wrap(fn, options)
    return _wrap(model, options)


def _wrap(obj, options: CompileOptions) -> SppoCompiled:
    if isinstance(obj, torch.nn.Module):
        return SppoCompiled(obj, None, options)
    if callable(obj):
        return SppoCompiled(None, obj, options)
    raise SppoError(f"sppo_fx.compile needs an nn.Module or a function, got {type(obj).__name__}")
