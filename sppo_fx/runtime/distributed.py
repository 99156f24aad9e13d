"""Pipeline executor: one stage per rank, driven by a schedule (sppo_fx/schedule/), on a
(pp, dp, sp) mesh (`runtime.mesh`).

Each rank runs its stage's action list:

    F     StageRunner.forward of (micro-batch, chunk); on the last stage, after the last
          chunk of a micro-batch, its epilogue (the loss)
    B     StageRunner.backward (reverse chunk order within a micro-batch)
    SEND_F / RECV_F   activations to / from the neighbouring stage (isend / irecv)
    SEND_B / RECV_B   their gradients
    OFF / PRE / WAIT  the chunk's saved activations go to the activation store while F runs
                      (saved-tensor hooks), PRE starts reading them back, WAIT blocks until
                      they are back (B would wait too)

Data and sequence parallelism: every rank of a stage's replica group (dp × sp) runs the
same action list on its share (its sequences, its tokens of every chunk); the SP ranks'
all-to-alls live inside the chunk programs (`passes.sequence_parallel`). The loss partials
of a micro-batch are SUM-reduced over the replica group before the epilogue, so the loss is
normalised by the global count; after the step's last backward, parameter gradients are
SUM-reduced over it.

Shapes come from the plan (chunk lengths) and the stage programs, so no shape handshake
happens per step. Tags encode (direction, micro-batch, chunk, tensor) so sends and receives
pair up exactly. Every wait has a timeout: a dead or failing rank makes its peers raise
`SppoError` instead of hanging (a failing rank records its error in the rendezvous store,
then closes its connections, so the error propagates along the pipeline).

At start, ranks exchange a fingerprint (the model's graph and stage programs, parameter
names, shapes and dtypes, a checksum of sampled parameter values, plan, schedule, input
shapes) and refuse to run when they disagree, saying what differs.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time

import torch
import torch.distributed as dist

from sppo_fx.errors import SppoError
from sppo_fx.passes.seq_chunk import ChunkedProgram
from sppo_fx.plan import Plan
from sppo_fx.runtime.local import StageRunner
from sppo_fx.runtime.mesh import ParallelMesh
from sppo_fx.schedule import ActionKind, Schedule

DEFAULT_TIMEOUT_S = 60.0
_ERROR_KEY = "sppo_fx/error"
_TAG_SHARED = 1 << 24  # + parameter index: tied-parameter gradients
_TAG_LOSS = 1 << 25
_STORE_WAIT_S = 2.0  # longest wait for the rendezvous store while handling a failure


def check_timeout(timeout_s) -> float:
    """`timeout_s` as seconds; SppoError unless it is a positive finite number."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise SppoError(f"timeout_s={timeout_s!r}: give the seconds a rank waits for a peer, a finite number > 0")
    return float(timeout_s)


def _served_store(timeout_s: float):
    """The rendezvous store rank 0 serves when no torchrun agent does, listening on
    MASTER_ADDR only (`runtime/launch.py`, `listening_store`: torch's own binds every
    interface)."""
    import os
    from sppo_fx.runtime.launch import listening_store
    return listening_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPU).
    Without torchrun's agent (which serves the store otherwise), rank 0 serves it on
    MASTER_ADDR only (`_served_store`).

    Returns:
        (rank, world size).
    """
    import os
    timeout_s = check_timeout(timeout_s)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        env = os.environ
        if backend == "nccl":  # NCCL binds each rank to one GPU: cuda:LOCAL_RANK
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        serves = (env.get("RANK") == "0" and "MASTER_ADDR" in env and "MASTER_PORT" in env
                  and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")
        if serves:
            dist.init_process_group(backend, store=_served_store(timeout_s), rank=0,
                                    world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def collective_device(group=None) -> torch.device:
    """Where tensors handed to this process group's collectives must live: this rank's GPU
    (cuda:LOCAL_RANK, set by `init_from_env`) for NCCL, host memory otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_device() -> torch.device:
    """The device this rank's model should live on: cuda:LOCAL_RANK when CUDA is there,
    else the CPU (what an example or benchmark moves its model and data to)."""
    import os
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


_SAMPLE = 1024  # values per parameter in the value checksum


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def values_checksum(named: list[tuple[str, torch.Tensor]]) -> str:
    """A digest of the exact bytes of up to `_SAMPLE` evenly spaced values of each tensor
    (all of them for small ones): equal for equal tensors on any device; different when a
    rank initialised or loaded its weights differently. Meta tensors count by shape only."""
    h = hashlib.sha1()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE]
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def fingerprint(graphs: list, params: list[tuple[str, torch.Tensor]], plan: Plan, schedule: Schedule,
                microbatch_shapes: list, shared: list[str] = (), check_values: bool = True) -> dict[str, str]:
    """What every rank must agree on, as short digests.

    Args:
        graphs: the analysed model graph and every stage's programs (their generated code).
        params: (name, tensor) of every model parameter.
        plan / schedule / microbatch_shapes: this step's chunking, schedule, input shapes.
        shared: names of the parameters several stages use (tied embeddings): their values
            must agree at every build, since each rank computes with its own copy.
        check_values: also compare every parameter's values (the ranks' starting point:
            after steps, each rank has updated only its own stage's parameters).
    """
    # memory actions are each rank's own business (its budget plan); the rest must match
    comm = [[str(a) for a in acts if not a.kind.is_memory] for _r, acts in sorted(schedule.actions.items())]
    out = {
        "model graph": _digest([g.code for g in graphs]),
        "parameter names, shapes and dtypes": _digest(sorted((k, list(v.shape), str(v.dtype)) for k, v in params)),
        "plan (chunk lengths)": _digest(plan.chunk_lengths),
        "schedule": _digest(comm),
        "micro-batch input shapes": _digest(microbatch_shapes),
        "values of parameters several stages share": values_checksum([(k, v) for k, v in params if k in set(shared)]),
    }
    if check_values:
        out["parameter values (sampled)"] = values_checksum(params)
    return out


def _gather_json(local: dict[str, str], world: int, timeout_s: float) -> list[dict[str, str]]:
    """Every rank's `local` (a dict of strings), sent as JSON bytes in uint8 tensors: never a
    pickle, which would run whatever a peer sent. Waits at most `timeout_s` per exchange."""
    device = collective_device()
    data = torch.frombuffer(bytearray(json.dumps(local, sort_keys=True).encode()), dtype=torch.uint8).to(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), async_op=True).wait(timeout)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, padded, async_op=True).wait(timeout)
    out = []
    for r, (buf, n) in enumerate(zip(bufs, sizes)):
        got = json.loads(bytes(buf[:int(n.item())].cpu().tolist()).decode())
        if not isinstance(got, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in got.items()):
            raise SppoError(f"rank {r} sent a fingerprint that is not a dict of strings")
        out.append(got)
    return out


def check_agreement(local: dict[str, str], rank: int, world: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """All-gather fingerprints (JSON, `_gather_json`), waiting at most `timeout_s`; raise
    SppoError naming what differs between ranks, or which wait timed out."""
    timeout_s = check_timeout(timeout_s)
    try:
        gathered = _gather_json(local, world, timeout_s)
    except SppoError:
        raise
    except Exception as e:  # noqa: BLE001 - a peer that never came or failed
        raise SppoError(f"rank {rank}: the start-up fingerprint exchange with the other {world - 1} rank(s) failed or "
                        f"timed out after {timeout_s:g} s (timeout_s) ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from e
    diffs = [k for k in local if len({g.get(k) for g in gathered}) > 1]
    if diffs:
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}={g.get(k)}" for r, g in enumerate(gathered)) for k in diffs)
        raise SppoError(f"ranks disagree on {', '.join(diffs)} ({detail}). Every rank must build the same "
                        "model (same code, parameters and starting values), input shapes, plan and schedule")


class PipelineExecutor:
    """Runs one rank's stage of a pipeline schedule.

    Args:
        program: this rank's stage program.
        params: tensors for the program's parameter placeholders (the user's parameters).
        plan: chunk partition of every micro-batch.
        schedule: the per-stage action lists.
        mesh: this rank's place in the (pp, dp, sp) layout, its peers and groups.
        chunk_fn: what runs the chunk program (eager GraphModule or Inductor-compiled).
        timeout_s: the longest wait for a peer before raising.
        shared: for parameters used by several stages (tied embeddings),
            {local param index: (global id, [ranks using it])}.
        store: the ActivationStore for the schedule's OFFLOAD/PREFETCH/WAIT actions.
        offload_quota: {(micro-batch, chunk): bytes} this rank's budget plan offloads (None:
            everything the offloaded chunks save).
    """

    def __init__(self, program: ChunkedProgram, params: list[torch.Tensor], plan: Plan, schedule: Schedule,
                 mesh: ParallelMesh, chunk_fn=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 shared: dict[int, tuple[int, list[int]]] | None = None, store=None, offload_quota=None):
        self.program, self.params, self.plan, self.schedule = program, params, plan, schedule
        self.mesh, self.chunk_fn, self.timeout_s = mesh, chunk_fn, timeout_s
        self.rank, self.stage = mesh.rank, mesh.pp_rank
        self.shared = shared or {}
        self.store = store
        self.offload = {(a.microbatch, a.chunk) for a in schedule.actions[self.stage] if a.kind is ActionKind.OFFLOAD}
        if offload_quota is not None:
            self.offload = {key: offload_quota[key] for key in self.offload}
        self.M, self.N = schedule.num_microbatches, schedule.num_chunks
        self.is_first, self.is_last = mesh.is_first_stage, mesh.is_last_stage
        self._sends: list = []
        # (action string, start, end) in seconds from the step's start, for every action; the
        # time F/B spent waiting for a peer's tensor is a separate "wait:<action>" entry
        self.timeline: list[tuple[str, float, float]] = []
        self._compute_start = None
        self._store_stuck = False  # a store call timed out (see _store_call)

    # ---- point-to-point with timeouts --------------------------------------------------
    def _tag(self, direction: int, mb: int, chunk: int, index: int) -> int:
        return ((direction * self.M + mb) * self.N + chunk) * 64 + index

    def _isend(self, tensors, peer, direction, mb, chunk):
        for k, t in enumerate(tensors):
            t = t.contiguous()
            self._sends.append((dist.isend(t, peer, tag=self._tag(direction, mb, chunk, k)), t, peer))

    def _local_len(self, chunk: int) -> int:
        """Tokens of `chunk` on this rank (its sequence-parallel share)."""
        S = self.program.seq_parallel
        return self.plan.chunk_lengths[chunk] if S == 1 else self.plan.sp_split(chunk, S)[self.mesh.sp_rank]

    def _irecv(self, specs, peer, direction, mb, chunk):
        c = self._local_len(chunk)
        device = self.params[0].device if self.params else torch.device("cpu")
        bufs = [torch.empty(a.concrete_shape(c), dtype=a.dtype, device=device) for a in specs]
        works = [dist.irecv(b, peer, tag=self._tag(direction, mb, chunk, k)) for k, b in enumerate(bufs)]
        return bufs, works, peer

    def _wait(self, work, peer: int, what: str):
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - turned into a clear error below
            raise SppoError(f"rank {self.rank}: {what} from rank {peer} failed or timed out after "
                            f"{self.timeout_s:.0f} s ({self._peer_error() or type(e).__name__ + ': ' + str(e).splitlines()[0]})") from e

    def _peer_error(self) -> str | None:
        def read():
            store = dist.distributed_c10d._get_default_store()
            return store.get(_ERROR_KEY).decode() if store.check([_ERROR_KEY]) else None
        return self._store_call(read)

    def _store_call(self, fn):
        """fn()'s result, or None if it raises or takes longer than `_STORE_WAIT_S`: the
        rendezvous store may be served by rank 0 (launched without torchrun's agent, which
        serves it otherwise), and rank 0 may be the rank that hangs (a stopped
        process keeps its sockets open, so a store call would block for the store's own
        timeout). After one call times out the store is not used again."""
        if self._store_stuck:
            return None
        result: list = []
        worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
        worker.start()
        worker.join(min(_STORE_WAIT_S, self.timeout_s))
        if worker.is_alive():
            self._store_stuck = True
            return None
        return result[0] if result else None

    def _received(self, pending, what):
        bufs, works, peer = pending
        for w in works:
            self._wait(w, peer, what)
        return bufs

    # ---- one step ------------------------------------------------------------------------
    def step(self, microbatch_inputs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of all micro-batches; accumulates gradients into the user's
        parameters' `.grad` and returns the loss (mean over micro-batches) on every rank."""
        try:
            return self._step(microbatch_inputs)
        except BaseException as e:
            # a peer's recorded failure (read before this rank records its own) names the
            # rank that failed first, which a broken collective cannot tell
            first = self._peer_error() if isinstance(e, Exception) else None
            self._fail(e)
            if first and first not in str(e):
                raise SppoError(f"rank {self.rank}: {e} (first failure: {first})") from e
            raise

    def _fail(self, error: BaseException):
        def record():
            store = dist.distributed_c10d._get_default_store()
            if not store.check([_ERROR_KEY]):
                store.set(_ERROR_KEY, f"rank {self.rank} raised {type(error).__name__}: {error}".splitlines()[0])
        self._store_call(record)
        try:  # closing our connections makes peers blocked on us fail now, not at their timeout
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    def _step(self, microbatch_inputs):
        if self.offload and self.store is None:
            raise SppoError("the schedule offloads activations but no activation store was given")
        runner = StageRunner(self.program, self.params, self.plan, self.chunk_fn, needs_grad=True,
                             store=self.store if self.offload else None, offload=self.offload,
                             sp_rank=self.mesh.sp_rank,
                             reduce_totals=self._reduce_totals if self.mesh.replica_group is not None else None,
                             epilogue_grads=self.mesh.replica_index == 0)
        for m, inputs in enumerate(microbatch_inputs):
            runner.start(m, inputs)
        recv_f, recv_b, out_f, out_b, losses = {}, {}, {}, {}, {}
        # on the device once per step, not copied host-to-device at every backward chunk
        loss_grad = torch.tensor(1.0 / self.M, device=self._device())
        self.timeline = []
        t0 = time.perf_counter()
        for a in self.schedule.actions[self.stage]:
            started = time.perf_counter()
            self._compute_start = None
            self._run_action(a, runner, recv_f, recv_b, out_f, out_b, losses, loss_grad)
            if self._compute_start is not None and self._compute_start > started:  # waited for a peer first
                self.timeline.append((f"wait:{a}", started - t0, self._compute_start - t0))
                started = self._compute_start
            self.timeline.append((str(a), started - t0, time.perf_counter() - t0))
        for work, _t, peer in self._sends:
            self._wait(work, peer, "send")
        self._sends.clear()
        grads = runner.param_grads
        self._reduce_shared(runner, grads)
        self._reduce_replicas(runner, grads)
        for k, idx in enumerate(runner.grad_index):
            p, g = self.params[idx], grads[k]
            if g is None:
                continue
            p.grad = g.to(p.dtype) if p.grad is None else p.grad + g
        loss = torch.stack(list(losses.values())).mean() if self.is_last else torch.empty((), dtype=torch.float32)
        return self._broadcast_loss(loss)

    def _run_action(self, a, runner, recv_f, recv_b, out_f, out_b, losses, loss_grad):
        """Run one action of this rank's list (F, B, sends and receives)."""
        key = (a.microbatch, a.chunk)
        m, i = key
        if a.kind is ActionKind.F:
            recvs = self._received(recv_f.pop(key), f"activation of micro-batch {m} chunk {i}") \
                if not self.is_first else []
            self._compute_start = time.perf_counter()
            out_f[key] = runner.forward(m, i, recvs)
            if self.is_last and i == self.N - 1:
                losses[m] = runner.finish_forward(m)
        elif a.kind is ActionKind.SEND_F:
            self._isend(out_f.pop(key), self.mesh.stage_rank(self.stage + 1), 0, m, i)
        elif a.kind is ActionKind.RECV_F:
            recv_f[key] = self._irecv(self.program.recvs, self.mesh.stage_rank(self.stage - 1), 0, m, i)
        elif a.kind is ActionKind.B:
            grads = self._received(recv_b.pop(key), f"gradient of micro-batch {m} chunk {i}") \
                if not self.is_last else []
            self._compute_start = time.perf_counter()
            rg = runner.backward(m, i, grads, loss_grad=loss_grad)
            out_b[key] = [g if g is not None else torch.zeros(
                a_.concrete_shape(self._local_len(i)), dtype=a_.dtype, device=self._device())
                for g, a_ in zip(rg, self.program.recvs)]
        elif a.kind is ActionKind.SEND_B:
            self._isend(out_b.pop(key), self.mesh.stage_rank(self.stage - 1), 1, m, i)
        elif a.kind is ActionKind.RECV_B:
            recv_b[key] = self._irecv(self.program.sends, self.mesh.stage_rank(self.stage + 1), 1, m, i)
        elif a.kind is ActionKind.OFFLOAD:
            pass  # the chunk's saved activations were handed to the store as F produced them
        elif a.kind is ActionKind.PREFETCH:
            runner.prefetch(m, i)
        elif a.kind is ActionKind.WAIT:
            runner.wait(m, i)
        else:
            raise SppoError(f"action {a} is not supported by this executor")

    def _device(self):
        return self.params[0].device if self.params else torch.device("cpu")

    def _reduce_shared(self, runner, grads):
        """Sum the gradients of parameters that several stages use (e.g. tied embeddings).

        `shared` maps a local parameter index to (global id, stages using it); the exchange
        is with those stages' peers of this rank's (dp, sp) coordinate; every exchange is
        posted before any wait, so ranks need not agree on an order.
        """
        pending = []
        for idx, (gid, ranks) in sorted(self.shared.items(), key=lambda kv: kv[1][0]):
            k = runner.grad_index.index(idx) if idx in runner.grad_index else None
            if k is None:
                continue
            mine = grads[k] if grads[k] is not None else torch.zeros_like(self.params[idx])
            mine = mine.contiguous()
            for stage in ranks:
                peer = self.mesh.stage_rank(stage)
                if peer != self.rank:
                    self._sends.append((dist.isend(mine, peer, tag=_TAG_SHARED + gid), mine, peer))
                    buf = torch.empty_like(mine)
                    pending.append((k, dist.irecv(buf, peer, tag=_TAG_SHARED + gid), buf, peer))
            grads[k] = mine.clone()
        for k, work, buf, peer in pending:
            self._wait(work, peer, "tied-parameter gradient")
            grads[k] += buf
        for work, _t, peer in self._sends:
            self._wait(work, peer, "send")
        self._sends.clear()

    def _collective(self, fn, what: str):
        """Run a collective of the replica group, turning a peer's failure into SppoError."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - turned into a clear error below
            members = [r for row in self.mesh.ranks[self.stage] for r in row]
            raise SppoError(f"rank {self.rank}: {what} over the stage's data/sequence-parallel ranks {members} failed "
                            f"({self._peer_error() or type(e).__name__ + ': ' + str(e).splitlines()[0]})") from e

    def _reduce_totals(self, totals: list[torch.Tensor]) -> None:
        """SUM the micro-batch's loss partials over the replica group (in place in the list):
        the epilogue then sees the partials of the whole micro-batch, every sequence and
        token, so a mean divides by the global count."""
        group = self.mesh.replica_group
        for k, t in enumerate(totals):
            t = t.detach().clone()
            self._collective(lambda: dist.all_reduce(t, dist.ReduceOp.SUM, group=group), "the loss partials' sum")
            totals[k] = t

    def _reduce_replicas(self, runner, grads) -> None:
        """SUM this step's parameter gradients over the replica group (dp × sp): each rank
        holds the gradient of its sequences and tokens. SUM, not AVG (gloo has summed for
        AVG in some paths); the loss is already normalised globally."""
        group = self.mesh.replica_group
        if group is None:
            return
        for k, idx in enumerate(runner.grad_index):
            g = grads[k] if grads[k] is not None else torch.zeros_like(self.params[idx])
            g = g.contiguous()
            self._collective(lambda: dist.all_reduce(g, dist.ReduceOp.SUM, group=group), "the gradient sum")
            grads[k] = g

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        P = self.mesh.layout.pp
        last = self.mesh.stage_rank(P - 1)
        device = collective_device()  # NCCL sends device tensors only
        loss = loss.detach().reshape(()).to(device, torch.float32) if self.is_last else torch.empty((), device=device)
        if self.is_last:
            peers = [self.mesh.stage_rank(s) for s in range(P - 1)]
            works = [(dist.isend(loss, r, tag=_TAG_LOSS), r) for r in peers]
            for w, r in works:
                self._wait(w, r, "loss send")
            return loss
        w = dist.irecv(loss, last, tag=_TAG_LOSS)
        self._wait(w, last, "loss")
        return loss
