"""The Plan: how one sequence is cut into chunks, what each chunk offloads and to which
tier, the recompute policy, where the K/V skeleton lives, and the solver's predicted peak
and step time.

A Plan is plain data: it prints as a table and round-trips through JSON.
"""
from __future__ import annotations

import dataclasses
import json

from tabulate import tabulate

from sppo_fx.errors import SppoError


# the predicted step's terms (`solver/clock.py`, `Plan.step_terms`) in the order printed
_STEP_TERM_LABELS = (("compute", "compute"), ("elementwise", "element-wise"), ("attention", "attention"),
                     ("allocation", "allocation"), ("exposed_copy", "exposed copy"), ("overhead", "overheads"))


@dataclasses.dataclass
class Plan:
    """Chunk partition of a sequence.

    Attributes:
        seq_len: tokens in the sequence.
        chunk_lengths: tokens per chunk, in order; they sum to `seq_len`.
        offload_ratios: per chunk, the fraction of its chunk-private saved activations
            (level 2) that leaves the device; None: nothing is offloaded.
        tier: where offloaded activations go ("disk", "host", "device"); with
            `offload="auto"` the solver's choice, which the runtime's store follows.
        budget_bytes: the memory budget the plan was solved for.
        peak_bytes: predicted peak device bytes of a step.
        step_seconds: predicted step time.
        recompute: the recompute policy of the chunk program ("none", "cheap", "full"),
            None: not chosen by the solver.
        skeleton: where the K/V skeleton lives ("keep": device, "offload": the tier,
            streamed back per prefix chunk); None: not chosen by the solver.
        copy_window_bytes: offload copies allowed in flight, each way (writes not yet
            done, reads not yet consumed; `runtime.memory.CopyWindow`); None: unbounded
            (every read of a chunk starts when its backward is about to run).
        sp_splits: with sequence parallelism, per chunk the tokens each SP rank takes, in
            rank order (multiplexed partitioning gives chunks their own splits); None:
            every chunk splits as evenly as possible (`sp_split`).
        step_terms: the predicted step's terms in seconds (`solver.clock.StepTerms`:
            compute, elementwise, attention, allocation, exposed_copy, overhead); None: not
            predicted by terms.
        tier_steps: with `offload="auto"`, the predicted step seconds of the best plan on
            each candidate tier (None for a tier whose plan did not fit: the host memory it
            may pin); None: the tier was given, not chosen.
    """

    seq_len: int
    chunk_lengths: list[int]
    offload_ratios: list[float] | None = None
    tier: str | None = None
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    step_seconds: float | None = None
    recompute: str | None = None
    skeleton: str | None = None
    copy_window_bytes: int | None = None
    sp_splits: list[list[int]] | None = None
    step_terms: dict | None = None
    tier_steps: dict | None = None

    def __post_init__(self):
        self.chunk_lengths = [int(c) for c in self.chunk_lengths]
        if self.offload_ratios is not None:
            self.offload_ratios = [float(a) for a in self.offload_ratios]
            if len(self.offload_ratios) != len(self.chunk_lengths) or any(not 0 <= a <= 1 for a in self.offload_ratios):
                raise SppoError(f"offload_ratios {self.offload_ratios} must give one value in [0, 1] per chunk")
        if any(c < 1 for c in self.chunk_lengths):
            raise SppoError(f"chunk lengths must be >= 1, got {self.chunk_lengths}")
        if self.sp_splits is not None:
            self.sp_splits = [[int(n) for n in split] for split in self.sp_splits]
            bad = [i for i, (split, c) in enumerate(zip(self.sp_splits, self.chunk_lengths))
                   if sum(split) != c or min(split) < 1]
            if len(self.sp_splits) != len(self.chunk_lengths) or bad or len({len(s) for s in self.sp_splits}) > 1:
                raise SppoError(f"sp_splits {self.sp_splits} must give, for every chunk of {self.chunk_lengths}, "
                                "the same number of shares, each >= 1 token, summing to the chunk's length")
        if sum(self.chunk_lengths) != self.seq_len:
            raise SppoError(f"chunk_lengths {self.chunk_lengths} sum to {sum(self.chunk_lengths)}, "
                            f"but the sequence has {self.seq_len} tokens; make them sum to {self.seq_len}")

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_lengths)

    @property
    def starts(self) -> list[int]:
        out, acc = [], 0
        for c in self.chunk_lengths:
            out.append(acc)
            acc += c
        return out

    def sp_split(self, i: int, parts: int) -> list[int]:
        """Tokens of chunk i per sequence-parallel rank (earlier ranks take the remainder)."""
        if self.sp_splits is not None:
            if len(self.sp_splits[i]) != parts:
                raise SppoError(f"the plan splits chunks over {len(self.sp_splits[i])} sequence-parallel ranks, "
                                f"the layout has seq_parallel={parts}")
            return list(self.sp_splits[i])
        c = self.chunk_lengths[i]
        if c < parts:
            raise SppoError(f"chunk {i} has {c} tokens, fewer than seq_parallel={parts}: every sequence-parallel "
                            f"rank needs at least one token of every chunk; use chunks of >= {parts} tokens")
        base, extra = divmod(c, parts)
        return [base + (r < extra) for r in range(parts)]

    def bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] per chunk."""
        return [(s, s + c) for s, c in zip(self.starts, self.chunk_lengths)]

    def table(self) -> str:
        headers = ["chunk", "start", "end", "tokens", "K/V prefix"]
        rows = [[i, s, e, e - s, s] for i, (s, e) in enumerate(self.bounds())]
        if self.offload_ratios is not None:
            headers.append(f"offloaded ({self.tier})")
            for row, a in zip(rows, self.offload_ratios):
                row.append(f"{a:.0%}")
        text = tabulate(rows, headers=headers)
        extra = []
        if self.budget_bytes is not None:
            extra.append(f"budget {self.budget_bytes / 2**20:.1f} MiB")
        if self.peak_bytes is not None:
            extra.append(f"predicted peak {self.peak_bytes / 2**20:.1f} MiB")
        if self.step_seconds is not None:
            terms = self.step_terms
            extra.append(f"predicted step {self.step_seconds:.3g} s" + (
                " (" + ", ".join(f"{label} {terms[key]:.3g} s" for key, label in _STEP_TERM_LABELS
                                 if key in terms) + ")" if terms else ""))
        if self.tier_steps:
            others = [f"{t} {'not within host memory' if s is None else f'{s:.3g} s'}"
                      for t, s in self.tier_steps.items() if t != self.tier]
            extra.append(f"tier {self.tier} chosen by offload='auto'" + (f" (over {', '.join(others)})" if others else
                                                                           " (the only tier that frees device memory)"))
        if self.recompute is not None:
            extra.append(f"recompute {self.recompute}")
        if self.copy_window_bytes is not None:
            extra.append(f"copy window {self.copy_window_bytes / 2**20:.1f} MiB")
        if self.skeleton is not None:
            extra.append(f"K/V skeleton {'kept on the device' if self.skeleton == 'keep' else 'offloaded, streamed'}")
        return text + ("\n" + ", ".join(extra) if extra else "")

    def __str__(self):
        return self.table()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))


def load_layout_plan(source) -> tuple[dict, Plan]:
    """The parallel layout and Plan of a saved plan, one format for the planner and the
    runtime: `sppo-fx plan ... --json` output (its "layout" and "plan" entries), or a
    Plan's own JSON (`Plan.to_json`, optionally with a "layout" entry).

    Args:
        source: a path to a JSON file, or the JSON text.

    Returns:
        ({"pp": P, "dp": D, "sp": S}, Plan).
    """
    text = str(source)
    if not text.lstrip().startswith("{"):
        try:
            with open(text) as f:
                text = f.read()
        except OSError as e:
            raise SppoError(f"cannot read the plan {source!r}: {e}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SppoError(f"the plan {str(source)[:80]!r} is not JSON: {e}") from e
    layout = {"pp": 1, "dp": 1, "sp": 1, **data.get("layout", {})}
    fields = {f.name for f in dataclasses.fields(Plan)}
    body = data["plan"] if "plan" in data else {k: v for k, v in data.items() if k in fields}
    if "seq_len" not in body or "chunk_lengths" not in body:
        raise SppoError(f"the plan {str(source)[:80]!r} has no seq_len / chunk_lengths: give `sppo-fx plan ... "
                        "--json` output or a Plan's JSON")
    return layout, Plan(**{k: v for k, v in body.items() if k in fields})


def even_plan(seq_len: int, chunks: int) -> Plan:
    """`chunks` chunks as equal as possible (earlier chunks take the remainder).

    Raises SppoError when the sequence has fewer tokens than chunks.
    """
    if chunks < 1:
        raise SppoError(f"chunks must be >= 1, got {chunks}")
    if seq_len < chunks:
        raise SppoError(f"the sequence has {seq_len} tokens, fewer than chunks={chunks}: "
                        f"use chunks <= {seq_len}")
    base, extra = divmod(seq_len, chunks)
    return Plan(seq_len, [base + (1 if i < extra else 0) for i in range(chunks)])
