"""The options of `sppo_fx.compile`: the typed configuration (`CompileOptions`), the
checks that refuse option and input values no call could use, and loading a saved plan."""
from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import tempfile
from typing import Callable

import torch

from sppo_fx.errors import SppoError
from sppo_fx.plan import Plan


@dataclasses.dataclass
class CompileOptions:
    """Options of `sppo_fx.compile`.

    Attributes:
        loss_fn: `(output, target) -> loss`; when None the model's output is the loss.
        chunks: number of sequence chunks (default: 4, or fewer for shorter sequences).
        chunk_lengths: explicit chunk lengths (must sum to the sequence length).
        seq_dim: the sequence dim of the inputs.
        budget: peak extra bytes per device for a step (int or "24GiB"); None: no budget.
        log_passes: print each graph after its pass.
        compile: compile the chunk programs with Inductor (False runs the FX graphs eagerly,
            for debugging).
        stages: pipeline stages P (one per rank under torchrun).
        microbatches: micro-batches per step (the batch is split along dim 0).
        schedule: "1f1b" (chunk-level 1F1B) or "gpipe".
        split_points: module names where stages start (default: cost-balanced).
        timeout_s: how long a rank waits for a peer before raising.
        partition: "balanced" (equal FLOPs per chunk: longer early chunks) or "even".
        offload: where every chunk but the last of a sequence offloads its saved activations
            ("disk", "host", "device"), or None. A manual plan until `budget` chooses. With
            a budget, "auto" (the default there) lets the solver choose the tier: the
            fastest predicted plan among the tiers that free device memory ("host" only on
            CUDA, within `host_memory`; "disk"), recorded as `Plan.tier`.
        host_memory: host bytes the host tier may pin (int or "64GiB"); None: half of the
            host's available memory, shared by the processes torchrun starts on the host
            (`solver.rank_budget.host_memory_available`), read when the budget is solved.
        offload_dir: directory for the disk tier's temporary files (default: the system's).
        recompute: recompute policy of the chunk program's memory passes: "none", "cheap"
            (recompute everything but matmuls and attention in backward), "full" (recompute
            the chunk from its inputs), or "auto" (the budget solver chooses; "none"
            without a budget).
        skeleton: where the K/V skeleton (every chunk's K and V, read by all later chunks)
            lives: "keep" (on the device), "offload" (in the `offload` tier, streamed into
            each attention one earlier chunk at a time), or "auto" (with a budget the solver
            offloads it only when no plan with it kept fits; otherwise "keep").
        seq_parallel: sequence-parallel ranks S per stage (Ulysses: each takes 1/S of every
            chunk's tokens; all-to-alls around attention).
        data_parallel: data-parallel replicas D (each takes 1/D of every micro-batch's
            sequences; gradients are summed over dp × sp after the step).
        mesh: a user's DeviceMesh with dims named "pp", "dp", "sp" (instead of stages /
            data_parallel / seq_parallel).
        plan: a saved Plan (`sppo-fx plan --json`, `Plan.from_json`) to run as given.
        verify: at the first call, compare the transformed program with the unmodified
            model on a prefix of the batch and raise at the first differing gradient
            (sppo_fx/verify.py).
        ones_inputs: inputs, by call keyword, that may be treated as a constant of ones when
            they are all ones in the first call and the program with them as data is refused
            (Hugging Face's `attention_mask` of unpadded batches); every later call is then
            checked to pass ones (sppo_fx/passes/ones_inputs.py). () turns this off.
    """

    loss_fn: Callable | None = None
    chunks: int | None = None
    chunk_lengths: list[int] | None = None
    seq_dim: int = 1
    budget: int | str | None = None
    log_passes: bool | None = None
    compile: bool = True
    stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    split_points: list[str] | None = None
    timeout_s: float = 60.0
    partition: str = "balanced"
    offload: str | None = None
    offload_dir: str | None = None
    host_memory: int | None = None
    recompute: str = "auto"
    skeleton: str = "auto"
    seq_parallel: int = 1
    data_parallel: int = 1
    mesh: object = None
    plan: Plan | None = None
    verify: bool = False
    ones_inputs: tuple[str, ...] = ("attention_mask",)

    @property
    def layout(self):
        """The (pp, dp, sp) sizes these options ask for."""
        from sppo_fx.runtime.mesh import Layout
        if self.mesh is not None:
            from sppo_fx.runtime.mesh import ParallelMesh
            return ParallelMesh.layout_of(self.mesh)
        return Layout(self.stages, self.data_parallel, self.seq_parallel)

    def recompute_for(self, plan: Plan) -> str:
        """The recompute policy a chunk program runs under `plan`: the budget plan's choice,
        else the option ("auto" without a budget means "none")."""
        return plan.recompute or ("none" if self.recompute == "auto" else self.recompute)

    def skeleton_for(self, plan: Plan) -> str:
        """Where the K/V skeleton lives under `plan`: the budget plan's choice, else the
        option ("auto" without a budget means "keep")."""
        return plan.skeleton or ("keep" if self.skeleton == "auto" else self.skeleton)

    def tier_for(self, plan: Plan) -> str | None:
        """The offload tier a program runs with under `plan`: the option's, or with
        offload="auto" the plan's (the solver's choice; the store follows it)."""
        return plan.tier if self.offload == "auto" else self.offload


SCHEDULES = ("1f1b", "gpipe")


def ones_inputs_option(value) -> tuple[str, ...]:
    """`ones_inputs` as a tuple of input names (a single name or an iterable of names)."""
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise SppoError(f"ones_inputs={value!r}: give the call keywords of inputs that may be all ones, "
                        "e.g. ('attention_mask',), or () to turn this off")
    return names


def load_plan(plan) -> Plan:
    """A Plan from a Plan, its JSON text, or a path to a JSON file (`sppo-fx plan --json`)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if not text.lstrip().startswith("{"):
            if not os.path.isfile(text):
                raise SppoError(f"plan={text!r} is neither a Plan's JSON nor an existing file")
            with open(text) as f:
                text = f.read()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SppoError(f"plan= is not valid JSON ({e}): give the output of `sppo-fx plan --json` or "
                            "Plan.to_json()") from None
        if not isinstance(data, dict):
            raise SppoError(f"plan= holds {type(data).__name__} JSON, not a plan (an object with seq_len and "
                            "chunk_lengths)")
        seq_len = data.get("seq_len")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise SppoError(f"plan= has seq_len={seq_len!r}: give the sequence length as a positive integer")
        lengths = data.get("chunk_lengths")
        if not isinstance(lengths, list) or not lengths or any(
                isinstance(c, bool) or not isinstance(c, int) for c in lengths):
            raise SppoError(f"plan= has chunk_lengths={lengths!r}: give a list of whole token counts")
        return Plan.from_json(text)
    raise SppoError(f"plan= takes a Plan, its JSON or a JSON file's path, got {type(plan).__name__}")


SKELETON_OPTIONS = ("auto", "keep", "offload")
AUTO_TIER = "auto"  # offload="auto": the budget solver chooses the tier


def compile_options(*, loss_fn=None, chunks=None, chunk_lengths=None, seq_dim=1, budget=None, log_passes=None,
                    compile=True, stages=1, microbatches=1, schedule="1f1b", split_points=None,  # noqa: A002
                    timeout_s=60.0, partition="balanced", offload=None, offload_dir=None, recompute="auto",
                    skeleton="auto", seq_parallel=1, data_parallel=1, mesh=None, plan=None,
                    verify=False, ones_inputs=("attention_mask",), host_memory=None) -> CompileOptions:
    """The checked `CompileOptions` of `sppo_fx.compile`'s arguments: every option, alone and
    with the others, is checked here, before any capture, solve or compile; an option no
    call could use raises SppoError naming it and what to give."""
    check_options(chunks, chunk_lengths, stages, microbatches, schedule, timeout_s, offload, offload_dir)
    check_call_options(seq_dim=seq_dim, partition=partition, loss_fn=loss_fn, compile=compile, log_passes=log_passes,
                       split_points=split_points, mesh=mesh, verify=verify)
    if chunk_lengths is not None:
        chunk_lengths = [int(c) for c in chunk_lengths]
        if chunks is not None and chunks != len(chunk_lengths):
            raise SppoError(f"chunks={chunks} disagrees with {len(chunk_lengths)} chunk_lengths; give one of them")
    if budget is not None:
        from sppo_fx.solver.budget import parse_budget
        budget = parse_budget(budget)
        if stages == 1 and (chunks is not None or chunk_lengths is not None):
            raise SppoError("give either budget= (the solver chooses the chunks) or chunks=/chunk_lengths=")
        offload = offload or AUTO_TIER  # the fastest tier that frees device memory (solver/rank_budget.py)
    elif offload == AUTO_TIER:
        raise SppoError("offload='auto' lets the budget solver choose the tier: give budget= too, or a tier "
                        "('disk', 'host', 'device')")
    if host_memory is not None:
        from sppo_fx.util.units import parse_bytes
        host_memory = parse_bytes(host_memory, "host_memory")
        if offload not in ("host", AUTO_TIER) or budget is None:
            raise SppoError(f"host_memory={host_memory} bounds the host tier a budget plan pins: give it with "
                            "budget= and offload='auto' or 'host', or leave it out")
    from sppo_fx.passes.offload import RECOMPUTE_POLICIES
    if recompute != "auto" and recompute not in RECOMPUTE_POLICIES:
        raise SppoError(f"recompute={recompute!r}: choose 'auto' or one of {RECOMPUTE_POLICIES}")
    if skeleton not in SKELETON_OPTIONS:
        raise SppoError(f"skeleton={skeleton!r}: choose 'auto', 'keep' or 'offload'")
    if skeleton == "offload" and offload is None:
        raise SppoError("skeleton='offload' moves the K/V skeleton to an offload tier: give offload='disk' "
                        "(or 'host'), or a budget (whose solver chooses the tier)")
    if skeleton == "offload" and int(stages) > 1:
        raise SppoError("skeleton='offload' is not supported with pipeline stages yet (stages > 1): "
                        "use skeleton='keep' or 'auto'")
    from sppo_fx.runtime.mesh import ParallelMesh
    if mesh is not None:
        if (stages, data_parallel, seq_parallel) != (1, 1, 1):
            raise SppoError("give either mesh= or stages / data_parallel / seq_parallel, not both")
        stages = ParallelMesh.layout_of(mesh).pp
    for name, value in (("seq_parallel", seq_parallel), ("data_parallel", data_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SppoError(f"{name}={value!r}: give a positive integer")
    if budget is not None and (seq_parallel > 1 or (mesh is not None and ParallelMesh.layout_of(mesh).sp > 1)):
        raise SppoError("budget= with seq_parallel > 1 is not supported yet (the per-rank solver does not model the "
                        "sharded chunk program's memory): give chunks= and, if needed, offload=")
    if skeleton == "offload" and seq_parallel > 1:
        raise SppoError("skeleton='offload' is not supported with seq_parallel > 1 yet: use skeleton='keep' or 'auto'")
    if plan is not None:
        plan = load_plan(plan)
        if chunks is not None or chunk_lengths is not None or budget is not None:
            raise SppoError("give either plan= or chunks / chunk_lengths / budget (the plan fixes the chunks)")
    return CompileOptions(loss_fn=loss_fn, chunks=chunks, chunk_lengths=chunk_lengths, seq_dim=seq_dim, budget=budget,
                          log_passes=log_passes, compile=compile, stages=int(stages), microbatches=int(microbatches),
                          schedule=schedule, split_points=list(split_points) if split_points else None,
                          timeout_s=float(timeout_s), partition=partition, offload=offload, offload_dir=offload_dir,
                          host_memory=host_memory,
                          recompute=recompute, skeleton=skeleton, seq_parallel=int(seq_parallel),
                          data_parallel=int(data_parallel), mesh=mesh, plan=plan, verify=verify,
                          ones_inputs=ones_inputs_option(ones_inputs))


def check_options(chunks, chunk_lengths, stages, microbatches, schedule, timeout_s, offload, offload_dir):
    """Refuse option values that no call could use, naming the option and what to give."""
    def whole(value) -> int | None:  # ints, numpy / torch integers; not bools or floats
        try:
            return None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            return None

    def positive_int(name, value):
        if whole(value) is None or whole(value) < 1:
            raise SppoError(f"{name}={value!r}: give a positive integer")
    if chunks is not None:
        positive_int("chunks", chunks)
    if chunk_lengths is not None:
        lengths = list(chunk_lengths)
        if not lengths or any(whole(c) is None or whole(c) < 1 for c in lengths):
            raise SppoError(f"chunk_lengths={lengths}: every chunk needs a whole number of tokens >= 1 "
                            "(and together they sum to the sequence length)")
    positive_int("stages", stages)
    positive_int("microbatches", microbatches)
    if schedule not in SCHEDULES:
        raise SppoError(f"schedule={schedule!r}: choose one of {', '.join(map(repr, SCHEDULES))}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise SppoError(f"timeout_s={timeout_s!r}: give the seconds a rank waits for a peer, a finite number > 0")
    if offload is not None and offload != AUTO_TIER:
        from sppo_fx.runtime.store import TIERS
        if offload not in TIERS:
            raise SppoError(f"offload={offload!r}: choose one of {', '.join(map(repr, TIERS))}, 'auto' (with a "
                            "budget) or None")
    if offload_dir is not None:
        _check_offload_dir(offload_dir)
    check_environment()


def _check_offload_dir(offload_dir) -> None:
    if not isinstance(offload_dir, (str, os.PathLike)) or not os.path.isdir(offload_dir):
        raise SppoError(f"offload_dir={offload_dir!r} does not exist (or is not a directory): create it "
                        "or give an existing one")
    try:  # the disk tier writes there at the first step: find out now (a read-only mount, /proc)
        fd, probe = tempfile.mkstemp(prefix=".sppo_fx_probe_", dir=offload_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SppoError(f"offload_dir={offload_dir!r} is not writable ({e.strerror}): give a directory this "
                        "user can write to") from None


_SWITCH_VALUES = ("on", "off", "1", "0", "true", "false", "yes", "no")
_SWITCHES = ("SPPO_FX_MEMORY_MODEL_CACHE", "SPPO_FX_PROFILE_CACHE", "SPPO_FX_FORK", "SPPO_FX_RECALIBRATE")


def check_environment() -> None:
    """Refuse values of the environment variables sppo_fx reads that it would misread, naming
    the variable; make Inductor's cache directory private (`disk_cache.secure_inductor_cache`)."""
    from sppo_fx.util.disk_cache import secure_inductor_cache
    env = os.environ
    for var in _SWITCHES:
        value = env.get(var)
        if value is not None and value.strip().lower() not in _SWITCH_VALUES + ("",):
            raise SppoError(f"environment variable {var}={value!r}: set it to on or off (or 1/0, true/false, "
                            "yes/no), or unset it")
    from sppo_fx.codegen.background import setting as background_setting
    background_setting()  # SPPO_FX_BACKGROUND_COMPILE: auto, on, wait or off
    passes = env.get("SPPO_FX_LOG_PASSES")
    if passes is not None and passes.strip() not in ("", "0", "1"):
        raise SppoError(f"environment variable SPPO_FX_LOG_PASSES={passes!r}: set it to 1 (print each graph after "
                        "its pass) or 0; any other value reads as 1")
    if env.get("SPPO_FX_LOG", "").strip():
        from sppo_fx.util.log import _env_level
        try:
            _env_level()
        except SppoError as e:
            raise SppoError(f"environment variable SPPO_FX_LOG: {e}") from None
    for var in ("SPPO_FX_CACHE_DIR", "XDG_CACHE_HOME"):
        value = env.get(var)
        if value and not os.path.isabs(value):
            raise SppoError(f"environment variable {var}={value!r} is a relative path (it would change with the "
                            "working directory): give an absolute path")
    secure_inductor_cache()


def check_call_options(*, seq_dim, partition, loss_fn, compile, log_passes, split_points, mesh,
                       verify=False) -> None:
    """Refuse the other option values of `sppo_fx.compile` that no call could use."""
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        try:
            seq_dim = operator.index(seq_dim)
        except TypeError:
            raise SppoError(f"seq_dim={seq_dim!r}: give the inputs' sequence dim as an integer "
                            "(1 for [batch, seq])") from None
    if seq_dim < 0:
        raise SppoError(f"seq_dim={seq_dim}: give the sequence dim counted from the front (>= 0; 1 for "
                        "[batch, seq])")
    if partition not in ("balanced", "even"):
        raise SppoError(f"partition={partition!r}: use 'balanced' or 'even'")
    if loss_fn is not None and not callable(loss_fn):
        raise SppoError(f"loss_fn={loss_fn!r} is not callable: give a function (output, target) -> loss, or None")
    if not isinstance(compile, bool):
        raise SppoError(f"compile={compile!r}: give True (Inductor) or False (eager)")
    if not isinstance(verify, bool):
        raise SppoError(f"verify={verify!r}: give True (check the first call against the model) or False")
    if log_passes is not None and not isinstance(log_passes, bool):
        raise SppoError(f"log_passes={log_passes!r}: give True, False or None")
    if split_points is not None and (isinstance(split_points, str) or not all(
            isinstance(name, str) and name for name in split_points)):
        raise SppoError(f"split_points={split_points!r}: give a list of module names, e.g. ['layers.4']")
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh
        if not isinstance(mesh, DeviceMesh):
            raise SppoError(f"mesh={mesh!r}: give a torch.distributed.device_mesh.DeviceMesh with dims named "
                            "'pp', 'dp', 'sp' (or use stages / data_parallel / seq_parallel)")


def seq_len_of(tensors: list[torch.Tensor], seq_dim: int) -> int:
    """The length of the first input with a dim `seq_dim`."""
    for t in tensors:
        if t.dim() > seq_dim:
            return t.shape[seq_dim]
    raise SppoError(f"no input tensor has a dim {seq_dim} (seq_dim={seq_dim}; input shapes "
                    f"{[tuple(t.shape) for t in tensors]}): pass token ids shaped [batch, seq] or set seq_dim "
                    "to the inputs' sequence dim")


MIN_SEQ_LEN = 2  # torch.export specialises a dim of size 1: no sequence length to chunk


def check_inputs(model, tensors: list[torch.Tensor], seq_dim: int) -> None:
    """Refuse inputs on several devices (or on another device than the model), empty or
    sparse inputs, a sequence shorter than `MIN_SEQ_LEN`, and token inputs (integer
    tensors shaped like the first) of different lengths along seq_dim."""
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise SppoError(f"input {i} is a {t.layout} tensor: give dense tensors (t.to_dense())")
        if t.numel() == 0:
            raise SppoError(f"input {i} is empty (shape {tuple(t.shape)}): give at least one sequence of at least "
                            f"{MIN_SEQ_LEN} tokens")
    seq_len = seq_len_of(tensors, seq_dim)
    if seq_len < MIN_SEQ_LEN:
        raise SppoError(f"the sequence is too short: {seq_len} token(s) along seq_dim={seq_dim}; sppo_fx chunks "
                        f"sequences of at least {MIN_SEQ_LEN} tokens (run a shorter one without sppo_fx)")
    devices = {t.device for t in tensors}
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    if params and params[0].device not in devices:
        devices.add(params[0].device)
    if len(devices) > 1:
        where = ", ".join(sorted(str(d) for d in devices))
        raise SppoError(f"the inputs and the model are on several devices ({where}): move the model and every "
                        "input to one device")
    tokens = [t for t in tensors if not t.is_floating_point() and t.dim() > seq_dim]
    if tokens:
        lengths = [t.shape[seq_dim] for t in tokens if t.dim() == tokens[0].dim()]
        if len(set(lengths)) > 1:
            raise SppoError(f"the integer inputs (token ids, targets) disagree on the sequence length along "
                            f"seq_dim={seq_dim}: {lengths}; give every one the same length")
