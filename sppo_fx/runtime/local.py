"""Executors of chunk programs: per-chunk forward/backward (`StageRunner`) and the
single-process run of a whole model (`chunked_loss`).

    forward   prologue(full inputs)
              for i in 0..N-1:  chunk_i(params, slices_i, recv_i, K/V prefix = K/V of chunks < i)
                                -> partials_i, sends_i, K_i/V_i
              epilogue(sum of partials over chunks)          -> loss          (last stage)
    backward  epilogue'                                      -> d partials
              for i in N-1..0:  chunk_i'(d partials, d sends_i, dK_i, dV_i accumulated from
                                chunks > i) -> d params (summed), d recv_i,
                                d prefix (split and added to dK_j, dV_j, j < i)

Each chunk keeps its own autograd graph; its K/V prefix and received activations enter it
as detached leaves, so chunk j's backward runs only after every later chunk has
contributed to dK_j, dV_j. (With skeleton="offload" the prefix is an empty handle and the
K/V data and gradients flow through `runtime.skeleton.KVSkeleton`: `sppo_fx.ops.skeleton`.) A `StageRunner` does this for one pipeline stage and any
number of micro-batches; the distributed executor drives one per rank, and
`chunked_loss` drives one for the whole model inside an autograd.Function so that
`loss.backward()` fills the parameters' `.grad` as eager would.
"""
from __future__ import annotations

import contextlib

import torch

from sppo_fx.codegen import CompiledProgram
from sppo_fx.errors import SppoError
from sppo_fx.ops.offload import MatmulGrad, active_memory
from sppo_fx.ops.seq_parallel import active_split
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan
from sppo_fx.runtime.kv_window import skeleton_bytes, window_prefix
from sppo_fx.util.skeleton_rows import keeps_no_buffer, window_first
from sppo_fx.runtime.memory import ChunkMemory, CopyWindow, ProductBuffer, adopted_grad
import sppo_fx.ops.skeleton  # noqa: F401  (registers the sppo.kv_out / prefix_attention ops)


SKELETON_MODES = ("keep", "offload")


def _streams_skeleton(chunk_fn) -> bool:
    import torch.fx as fx
    gm = getattr(chunk_fn, "gm", chunk_fn)
    return isinstance(gm, fx.GraphModule) and any(
        n.target is torch.ops.sppo.kv_out.default for n in gm.graph.nodes if n.op == "call_function")


class _ChunkState:
    __slots__ = ("partials", "sends", "kv", "prefix", "recvs", "memory")

    def __init__(self, partials, sends, kv, prefix, recvs, memory=None):
        self.partials, self.sends, self.kv, self.prefix, self.recvs = partials, sends, kv, prefix, recvs
        self.memory = memory  # ChunkMemory: this chunk's saved activations (offload graphs)


class _MicroBatch:
    def __init__(self, boundary):
        self.boundary = boundary
        # per site: K then V, [b, h_kv, T, d]; None for a bounded window/document site (runtime/kv_window.py)
        self.kv_buffers: list[torch.Tensor | None] = []
        self.skeleton = None  # KVSkeleton (skeleton="offload")
        self.states: dict[int, _ChunkState] = {}
        self.kv_grads: dict[int, list] = {}
        self.totals = None
        self.loss = None
        self.total_grads = None
        self.doc_starts: dict[str, list[int]] = {}  # packed documents: boundary -> first visible position


class StageRunner:
    """Runs one stage's chunk program, chunk by chunk, for several micro-batches.

    Args:
        program: the stage's ChunkedProgram.
        params: tensors for the program's parameter placeholders, in order.
        plan: the chunk partition of every micro-batch.
        chunk_fn: what runs the chunk program (the GraphModule, or a
            `codegen.CompiledProgram`). With a store it must be a CompiledProgram built with
            offload=True (its graphs carry the offload/wait nodes:
            `sppo_fx.orchestrate.compile_chunk(program)`).
        needs_grad: build autograd graphs (False for evaluation).
        store: the ActivationStore that offloaded chunks' saved activations go to.
        offload: which (micro-batch, chunk) pairs offload their saved activations (level 2:
            everything the chunk saves for its own backward except parameters, inputs and
            its K/V): a set (all of them), or a dict {(micro-batch, chunk): byte quota}
            (tensors are offloaded in the order the forward produces them while they fit
            the quota); None with a store means every chunk but the last of each
            micro-batch (it is the first to run backward).
        min_offload_bytes: saved tensors smaller than this stay on the device.
        skeleton: where the K/V skeleton lives: "keep" (device buffers, passed to the chunk
            program as its prefix inputs) or "offload" (the store's tier, streamed into the
            attention one prefix chunk at a time; needs `store` and a chunk program from
            `passes.skeleton.stream_kv_skeleton`:
            `sppo_fx.orchestrate.compile_chunk(program, skeleton="offload")`).
        copy_window_bytes: bound on offload copies in flight (`runtime.memory.CopyWindow`);
            default: the plan's `copy_window_bytes` (None there: unbounded).
        sp_rank: with a sequence-parallel program (`program.seq_parallel` = S > 1), this
            rank's index among the S ranks; it runs its share of every chunk
            (`Plan.sp_split`).
        reduce_totals: sums the loss partials over the other ranks that hold parts of the
            same micro-batch (data and sequence parallelism), in place, before the epilogue.
        epilogue_grads: add the epilogue's parameter gradients (False on all but one rank of
            a replica group: every rank computes the same ones, and gradients are summed
            over the group).
    """

    def __init__(self, program: ChunkedProgram, params: list[torch.Tensor], plan: Plan, chunk_fn=None,
                 needs_grad: bool = True, store=None, offload=None, min_offload_bytes: int = 1 << 16,
                 skeleton: str = "keep", copy_window_bytes: int | None = None, sp_rank: int = 0,
                 reduce_totals=None, epilogue_grads: bool = True):
        self.program, self.plan = program, plan
        self.sp_rank, self.reduce_totals, self.epilogue_grads = sp_rank, reduce_totals, epilogue_grads
        if program.seq_parallel > 1 and skeleton != "keep":
            raise SppoError("skeleton='offload' is not supported with seq_parallel > 1 yet: use skeleton='keep'")
        self.store, self.min_offload_bytes = store, min_offload_bytes
        window = copy_window_bytes if copy_window_bytes is not None else plan.copy_window_bytes
        self.window = CopyWindow(store, window) if store is not None and window is not None else None
        if self.window is not None and getattr(store, "tier", None) == "disk":
            # the reads in flight fit the window: recycle that much read-back memory
            store.recycle_read_buffers(window)
        self.offload = offload
        if skeleton not in SKELETON_MODES:
            raise SppoError(f"skeleton={skeleton!r}: choose one of {SKELETON_MODES}")
        self.skeleton = skeleton
        if skeleton == "offload":
            if store is None:
                raise SppoError("skeleton='offload' needs an ActivationStore (store=...) to offload the K/V to")
            if not (isinstance(chunk_fn, CompiledProgram) and chunk_fn.offload and _streams_skeleton(chunk_fn)):
                # offload=True also keeps Inductor from reusing the buffers sppo.kv_out hands over
                raise SppoError("skeleton='offload' needs a chunk program compiled with offload=True from "
                                "the streamed chunk: sppo_fx.orchestrate.compile_chunk(program, skeleton='offload')")
        elif store is not None and needs_grad and not (isinstance(chunk_fn, CompiledProgram) and chunk_fn.offload):
            raise SppoError("offloading needs a chunk program compiled with offload=True "
                            "(sppo_fx.orchestrate.compile_chunk(program, offload=True))")
        self.chunk_fn = chunk_fn if chunk_fn is not None else program.chunk
        # CompiledPrograms' graphs call sppo.* ops that need a ChunkMemory per chunk
        self.memory_graphs = isinstance(self.chunk_fn, CompiledProgram)
        # AOTAutograd's graphs run op by op: no buffer of theirs is reused after the call
        self._op_by_op = self.memory_graphs and self.chunk_fn.backend == "eager"
        self._adopted: dict[int, int] = {}  # storage address -> parameter whose gradient took it over
        self._products = ProductBuffer()  # op by op: weight-gradient products before their add
        self.needs_grad = needs_grad
        self.grad_index = [i for i, p in enumerate(params) if p.requires_grad and needs_grad]
        self.params = [p.detach().requires_grad_() if i in self.grad_index else p.detach()
                       for i, p in enumerate(params)]
        self.microbatches: dict[int, _MicroBatch] = {}
        index = {name: k for k, name in enumerate(program.params)}
        self._epilogue_params = [self.params[index[name]] for name in program.epilogue_params]

    @property
    def grad_leaves(self) -> list[torch.Tensor]:
        return [self.params[i] for i in self.grad_index]

    @property
    def param_grads(self) -> list[torch.Tensor | None]:
        """Gradients accumulated so far, one per parameter that requires grad."""
        return [leaf.grad for leaf in self.grad_leaves]

    def take_param_grads(self) -> list[torch.Tensor | None]:
        """The accumulated gradients, released by the runner (so that autograd can hand
        them to the user's parameters without a copy)."""
        grads = self.param_grads
        for leaf in self.grad_leaves:
            leaf.grad = None
        return grads

    # ---- forward ----------------------------------------------------------------------
    def start(self, mb: int, inputs: list[torch.Tensor]):
        """Run the prologue of micro-batch `mb` on its full-sequence inputs."""
        with torch.no_grad():
            boundary = self.program.prologue(self.plan.seq_len, *inputs)
        self.microbatches[mb] = _MicroBatch(boundary)

    def _prefix(self, mb: _MicroBatch, i: int) -> list[torch.Tensor]:
        """Chunk i's K/V prefix: views of the micro-batch's K/V buffers (no copies); for a
        windowed site, of the earlier chunks' own K/V outputs (`kv_window.window_prefix`).

        `.data` gives each view its own version counter, so writing later chunks' K/V into
        the buffer (beyond the view) does not trip autograd's in-place check.
        With skeleton="offload": empty handles [b, h_kv, p, d, 0] (the data is in the skeleton).
        """
        device = self.params[0].device if self.params else None
        if self.skeleton == "offload":
            if mb.skeleton is None:
                from sppo_fx.runtime.skeleton import KVSkeleton
                # packed documents: each chunk reads from its first token's document on
                firsts = [self._prefix_starts(s, mb) for s, _ in self.plan.bounds()]
                mb.skeleton = KVSkeleton(self.store, offload=self.needs_grad, num_chunks=self.plan.num_chunks,
                                         bounds=self.plan.bounds(), backward=self.needs_grad,
                                         windows=[site.window for site in self.program.attention],
                                         first_read=[[f[2 * n] for f in firsts] if site.documents else None
                                                     for n, site in enumerate(self.program.attention)])
            out = []
            for site in self.program.attention:
                for shape in (site.k_shape, site.v_shape):
                    full = list(shape)
                    full[-2] = self.plan.starts[i]
                    out.append(torch.empty((*full, 0), dtype=site.dtype, device=device)
                               .requires_grad_(self.needs_grad))
            return out
        sites = [(site, shape) for site in self.program.attention for shape in (site.k_shape, site.v_shape)]
        if not mb.kv_buffers:
            firsts = [self._prefix_starts(s, mb) for s, _ in self.plan.bounds()]  # per chunk, per buffer
            for k, (site, shape) in enumerate(sites):
                full = list(shape)
                full[-2] = self.plan.seq_len
                # no full-sequence buffer for a window or packed documents, unless their
                # copies are larger (runtime/kv_window.py); causal sites keep theirs
                bounded = (site.window is not None or bool(site.documents)) and \
                    keeps_no_buffer(self.plan.bounds(), [f[k] for f in firsts])
                mb.kv_buffers.append(None if bounded else torch.empty(full, dtype=site.dtype, device=device))
        start = self.plan.starts[i]
        out = []
        for k, ((site, shape), buf, lo) in enumerate(zip(sites, mb.kv_buffers, self._prefix_starts(start, mb))):
            if buf is None:
                view = window_prefix(lambda c: mb.states[c].kv, self.plan.bounds()[:i], k, lo, start,
                                     (*shape[:-2], 0, shape[-1]), site.dtype, device)
            else:
                view = buf[..., lo:start, :].data
            out.append(view.requires_grad_(self.needs_grad))
        return out

    def skeleton_bytes(self, mb: int) -> int:
        """Bytes of K/V skeleton storage micro-batch `mb` holds now (`kv_window.skeleton_bytes`)."""
        m = self.microbatches[mb]
        return skeleton_bytes(m.states, m.kv_buffers)

    def _prefix_starts(self, start: int, mb: _MicroBatch) -> list[int]:
        """Per K/V buffer (K then V per site): the first position a chunk starting at
        `start` reads. A sliding window of W reads only the last W-1 positions, so its
        prefix, and the gradient split over earlier chunks, stay bounded by W. Inside
        packed documents it starts at the document of the chunk's first token (the
        earliest over the batch rows): earlier documents are neither read nor sent
        gradients."""
        return [max(window_first(start, site.window),
                    self._document_start(mb, site.documents, start) if site.documents else 0)
                for site in self.program.attention for _ in range(2)]

    def _document_start(self, mb: _MicroBatch, name: str, start: int) -> int:
        if name not in mb.doc_starts:  # once per micro-batch: doc_pos is a prologue output
            doc_pos = mb.boundary[[b.name for b in self.program.boundaries].index(name)]
            first = torch.arange(doc_pos.shape[-1], device=doc_pos.device) - doc_pos
            mb.doc_starts[name] = first.amin(0).tolist()
        return mb.doc_starts[name][start] if start < len(mb.doc_starts[name]) else start

    def forward(self, mb: int, i: int, recvs: list[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Forward of chunk `i` of micro-batch `mb`; returns the activations to send (detached)."""
        prog, m = self.program, self.microbatches[mb]
        start, end = self.plan.bounds()[i]
        local_start, local_len = self.local_bounds(i)
        slices = [b if spec.seq_dim is None else b.narrow(spec.seq_dim, local_start, local_len)
                  for spec, b in zip(prog.boundaries, m.boundary)]
        recv_leaves = [r.detach().requires_grad_(self.needs_grad and r.is_floating_point()) for r in recvs]
        prefix = self._prefix(m, i)
        n_part, n_send = prog.num_partials, len(prog.sends)
        memory = None
        if self.memory_graphs:
            quota = self.offload.get((mb, i), 0) if isinstance(self.offload, dict) else float("inf")
            memory = ChunkMemory(self.store if self.offloads(mb, i) else None, quota, self.min_offload_bytes,
                                 self._accumulate_grad, m.skeleton, i, self.window)
        whole = (end - start,) if prog.seq_parallel > 1 else ()  # sp_chunk_len
        with torch.set_grad_enabled(self.needs_grad), active_memory(memory), self._split(i):
            outs = self.chunk_fn(*self.params, *slices, *recv_leaves, *prefix, local_start, local_len, *whole)
        if memory is not None and memory.error is not None:
            memory.release()
            raise memory.error  # a failed offload write (the caller aborts the micro-batch)
        outs = list(outs)
        m.states[i] = _ChunkState(outs[:n_part], outs[n_part:n_part + n_send], outs[n_part + n_send:],
                                  prefix, recv_leaves, memory)
        if self.skeleton == "offload":
            if m.skeleton is not None:
                m.skeleton.end_forward(i)
            return [t.detach() for t in m.states[i].sends]  # the K/V went to the skeleton (sppo.kv_out)
        with torch.no_grad():
            for buf, t in zip(m.kv_buffers, m.states[i].kv):
                if buf is not None:
                    buf[..., start:end, :].copy_(t)
        return [t.detach() for t in m.states[i].sends]

    def local_bounds(self, i: int) -> tuple[int, int]:
        """(first position, tokens) of this rank's share of chunk i (the whole chunk
        without sequence parallelism)."""
        start = self.plan.starts[i]
        if self.program.seq_parallel == 1:
            return start, self.plan.chunk_lengths[i]
        split = self.plan.sp_split(i, self.program.seq_parallel)
        return start + sum(split[:self.sp_rank]), split[self.sp_rank]

    def _split(self, i: int):
        """The running chunk's split over the SP ranks, for the all-to-alls in its graphs."""
        if self.program.seq_parallel == 1:
            return contextlib.nullcontext()
        return active_split(self.plan.sp_split(i, self.program.seq_parallel))

    def abort(self, mb: int) -> None:
        """A step failed: drop micro-batch `mb`'s saved state and offloaded copies (their
        files are removed), and the store's pooled files (the disk may be full). Parameter
        gradients are untouched: the forward never writes them."""
        m = self.microbatches.pop(mb, None)
        if m is not None:
            for st in m.states.values():
                if st.memory is not None:
                    st.memory.release()
            if m.skeleton is not None:
                for i in range(self.plan.num_chunks):
                    m.skeleton.release(i)
            m.states.clear()
        if self.store is not None:
            self.store.settle()  # copies still running: their files go now, their errors with them
            self.store.trim_read_buffers()
            self.store.drop_pooled_files()

    def offloads(self, mb: int, i: int) -> bool:
        """Whether chunk `i` of micro-batch `mb` offloads its saved activations."""
        if self.store is None or not self.needs_grad:
            return False
        if self.offload is None:
            return i < self.plan.num_chunks - 1
        return (mb, i) in self.offload and (not isinstance(self.offload, dict) or self.offload[(mb, i)] > 0)

    def prefetch(self, mb: int, i: int):
        """Start bringing chunk i's offloaded activations back (no-op if none)."""
        st = self.microbatches.get(mb) and self.microbatches[mb].states.get(i)
        if st is not None and st.memory is not None:
            st.memory.prefetch()

    def wait(self, mb: int, i: int):
        """Block until chunk i's offloaded activations are back (backward also waits)."""
        st = self.microbatches.get(mb) and self.microbatches[mb].states.get(i)
        if st is not None and st.memory is not None:
            st.memory.wait()

    def finish_forward(self, mb: int) -> torch.Tensor:
        """After every chunk of `mb` ran forward on the last stage: the epilogue -> loss."""
        m = self.microbatches[mb]
        totals = []
        with torch.set_grad_enabled(self.needs_grad):
            for k in range(self.program.num_partials):
                acc = m.states[0].partials[k].detach()
                for i in range(1, len(m.states)):
                    acc = acc + m.states[i].partials[k].detach()
                totals.append(acc)
            if self.reduce_totals is not None:
                self.reduce_totals(totals)
            totals = [t.requires_grad_(self.needs_grad and t.is_floating_point()) for t in totals]
            (m.loss,) = self.program.epilogue(self.plan.seq_len, *self._epilogue_params, *totals)
        m.totals = totals
        return m.loss.detach()

    # ---- backward ---------------------------------------------------------------------
    def backward(self, mb: int, i: int, send_grads: list[torch.Tensor] = (), loss_grad=None
                 ) -> list[torch.Tensor | None]:
        """Backward of chunk `i` of micro-batch `mb` (after chunks > i); returns the
        gradients of the received activations, to send to the previous stage.

        Args:
            send_grads: gradients of this chunk's sent activations (from the next stage).
            loss_grad: the loss gradient (last stage; used at the first backward of `mb`).
        """
        m = self.microbatches[mb]
        leaves = self.grad_leaves
        if m.loss is not None and m.total_grads is None:
            totals = [t for t in m.totals if t.requires_grad]
            grad = torch.ones_like(m.loss) if loss_grad is None else loss_grad
            gs = torch.autograd.grad(m.loss, totals + self._epilogue_grad_leaves(), grad, allow_unused=True)
            m.total_grads = dict(zip(map(id, totals), gs[:len(totals)]))
            if self.epilogue_grads:
                self._add_param_grads_for(self._epilogue_grad_index(), gs[len(totals):])
            m.loss = None
        st = m.states[i]
        outs, grads = [], []
        for t, p in zip(m.totals or [], st.partials):
            g = (m.total_grads or {}).get(id(t))
            if g is not None and p.requires_grad:
                outs.append(p)
                grads.append(g)
        for t, g in zip(st.sends, send_grads):
            if g is not None and t.requires_grad:
                outs.append(t)
                grads.append(g)
        for t, g in zip(st.kv, m.kv_grads.pop(i, [None] * len(st.kv))):
            if g is not None and t.requires_grad:
                outs.append(t)
                grads.append(g)
        prefix = st.prefix if i > 0 and self.skeleton == "keep" else []
        recvs = [r for r in st.recvs if r.requires_grad]
        recv_grads: list[torch.Tensor | None] = [None] * len(st.recvs)
        if outs:
            if st.memory is not None:
                # every read of the chunk requested before its backward graph runs (the graph
                # only waits); a no-op for reads a PREFETCH action already asked for
                st.memory.prefetch()
            # backward(inputs=...) accumulates each parameter's gradient into its leaf as soon
            # as it is computed: one copy of the gradients, as eager autograd keeps
            with active_memory(st.memory), self._split(i):
                torch.autograd.backward(outs, grads, inputs=leaves + prefix + recvs)
            bounds = self.plan.bounds()[:i]
            for j, (t, lo) in enumerate(zip(prefix, self._prefix_starts(bounds[-1][1] if bounds else 0, m))):
                gp, t.grad = t.grad, None
                if gp is None:
                    continue
                for c, (s, e) in enumerate(bounds):  # the prefix covers positions lo..start-1
                    if e <= lo:
                        continue
                    part = gp[..., max(s, lo) - lo:e - lo, :]
                    if s < lo:  # the window starts inside chunk c: its earlier rows get nothing
                        part = torch.nn.functional.pad(part, (0, 0, lo - s, 0))
                    acc = m.kv_grads.setdefault(c, [None] * len(st.kv))
                    acc[j] = part if acc[j] is None else acc[j] + part
            recv_grads = [r.grad if r.requires_grad else None for r in st.recvs]
        if st.memory is not None:
            st.memory.release()
        if m.skeleton is not None:
            m.skeleton.release(i)
        del m.states[i]
        if not m.states:
            del self.microbatches[mb]
            if self.store is not None:
                self.store.trim_read_buffers()  # nothing is read until the next forward
            self._products.release()
        return recv_grads

    def _accumulate_grad(self, index: int, grad) -> None:
        """Add a parameter gradient from a backward graph (`sppo.accumulate_grad`, or
        `sppo.accumulate_grad_mm` with a `MatmulGrad`) to the parameter's leaf, as
        autograd's AccumulateGrad would."""
        leaf = self.params[index]
        if isinstance(grad, MatmulGrad):
            if leaf.grad is not None:
                if self._op_by_op:  # autograd's sum: the product, then add_ (S1)
                    leaf.grad.add_(self._products.mm(grad.a, grad.b))
                else:
                    leaf.grad.addmm_(grad.a, grad.b)
                return
            grad = grad.materialize()
            if grad.stride() == leaf.stride():
                leaf.grad = grad  # a fresh tensor of the graph's: no copy needed
                return
        if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True))
            # as autograd's AccumulateGrad: a copy of the first, then sums out of place
            leaf.grad = grad.clone() if leaf.grad is None else leaf.grad + grad
            return
        if leaf.grad is None:
            # op by op, a graph's tensor is its own: the first gradient is taken over without a
            # copy, as autograd's AccumulateGrad takes it (Inductor may reuse its buffers later)
            taken = None
            if self._op_by_op:
                earlier = self._adopted.get(grad.untyped_storage().data_ptr())  # the same tensor, taken before
                taken = adopted_grad(grad, leaf, [] if earlier is None else [self.params[earlier].grad])
            if taken is not None:
                leaf.grad = taken
                self._adopted[taken.untyped_storage().data_ptr()] = index
                return
            # a copy in the parameter's layout: `grad` may be a view into a graph buffer
            leaf.grad = torch.empty_like(leaf).copy_(grad)
        else:
            leaf.grad.add_(grad)

    def _epilogue_grad_index(self) -> list[int]:
        names = set(self.program.epilogue_params)
        return [k for k, i in enumerate(self.grad_index) if self.program.params[i] in names]

    def _epilogue_grad_leaves(self) -> list[torch.Tensor]:
        return [self.grad_leaves[k] for k in self._epilogue_grad_index()]

    def _add_param_grads_for(self, ks, grads):
        for k, g in zip(ks, grads):
            if g is not None:
                leaf = self.grad_leaves[k]
                leaf.grad = g if leaf.grad is None else leaf.grad.add_(g)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, n_chunks, *grad_params):
        ctx.runner, ctx.n_chunks = runner, n_chunks
        try:
            for i in range(n_chunks):
                runner.forward(0, i)
            if runner.store is not None:
                # a write that failed in the background fails the step here, before the
                # backward has added anything to a parameter's .grad
                runner.store.synchronize()
            return runner.finish_forward(0)
        except BaseException:
            runner.abort(0)
            raise

    @staticmethod
    def backward(ctx, grad):
        runner = ctx.runner
        ctx.runner = None
        for i in range(ctx.n_chunks - 1, -1, -1):
            runner.prefetch(0, i)
            if i > 0:  # the previous chunk's read-back overlaps this chunk's backward
                runner.prefetch(0, i - 1)
            runner.backward(0, i, loss_grad=grad)
        return (None, None, *runner.take_param_grads())


def chunked_loss(program: ChunkedProgram, params: list[torch.Tensor], inputs: list[torch.Tensor],
                 plan: Plan, chunk_fn=None, store=None, offload=None, min_offload_bytes: int = 1 << 16,
                 skeleton: str = "keep", copy_window_bytes: int | None = None) -> torch.Tensor:
    """Run the chunk programs over `plan`; the result backpropagates into `params`.

    Args:
        program: the prologue/chunk/epilogue graphs (a whole model: no pipeline stages).
        params: tensors for the program's parameter placeholders, in order.
        inputs: the flat user input tensors (full sequence).
        plan: the chunk partition.
        chunk_fn: what runs the chunk program (default: the GraphModule itself, eagerly;
            `codegen.CompiledProgram` for Inductor).
        store / offload / min_offload_bytes: where and which chunks' saved activations are
            offloaded (see StageRunner); offloading changes where tensors live, never the
            arithmetic.
        skeleton: "keep" or "offload": where the K/V skeleton lives (see StageRunner).
        copy_window_bytes: bound on offload copies in flight (default: the plan's).

    Returns:
        The scalar loss (equal to the eager model's on the full sequence).
    """
    grad_params = [p for p in params if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and bool(grad_params)
    runner = StageRunner(program, params, plan, chunk_fn, needs_grad, store, offload, min_offload_bytes, skeleton,
                         copy_window_bytes)
    runner.start(0, inputs)
    if not needs_grad:
        try:
            for i in range(plan.num_chunks):
                runner.forward(0, i)
            return runner.finish_forward(0)
        except BaseException:
            runner.abort(0)
            raise
    return _ChunkedLoss.apply(runner, plan.num_chunks, *grad_params)
