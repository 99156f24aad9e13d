"""What one benchmark row runs, and the grid of them.

A row is either an anchor (a peer run on the unmodified model: `eager`, `compile`,
`compile-amb:F` for torch.compile with activation_memory_budget F, `checkpoint` per block)
or a library configuration (`sppo`: `sppo_fx.compile` with the axes below). The grid is
the product of every axis given as a comma list; `--only` / `--skip` prune it.
"""
from __future__ import annotations

import dataclasses
import itertools

from sppo_fx.errors import SppoError
from sppo_fx.util.units import parse_bytes

ANCHOR_KINDS = ("eager", "compile", "compile-amb", "checkpoint")
LIBRARY_KIND = "sppo"

# library axes: (name, default text); the order is the grid's nesting order
LIBRARY_AXES = (("budget", "none"), ("chunks", "auto"), ("partition", "balanced"), ("recompute", "auto"),
                ("skeleton", "auto"), ("offload", "none"), ("stages", "1"), ("microbatches", "1"),
                ("schedule", "1f1b"), ("compile", "off"))
COMMON_AXES = (("dtype", "fp32"), ("device", "cpu"))
AXES = tuple(name for name, _ in LIBRARY_AXES + COMMON_AXES)
CHOICES = {"partition": ("balanced", "even"), "recompute": ("auto", "none", "cheap", "full"),
           "skeleton": ("auto", "keep", "offload"), "offload": ("none", "disk", "host", "device"),
           "schedule": ("1f1b", "gpipe"), "compile": ("on", "off"), "dtype": ("fp32", "bf16"),
           "device": ("cpu", "cuda")}


@dataclasses.dataclass
class BenchConfig:
    """One row of the grid.

    Attributes:
        kind: "eager", "compile", "compile-amb", "checkpoint" (anchors) or "sppo".
        amb: torch._functorch activation_memory_budget of a "compile-amb" anchor.
        model / size / seq_len / batch: the reference model (`sppo_fx.models.build`) and
            its input; steps: timed steps after the warm-up (first) call.
        dtype / device: "fp32" | "bf16"; "cpu" | "cuda".
        budget: the budget as written: "25%" (of the eager anchor's measured peak extra
            memory), "2GiB" (absolute), "min" (the solver's smallest feasible), "min+10%" (10%
            above it) or None.
        budget_bytes: the budget in bytes, resolved by the engine before the row runs.
        chunks: sequence chunks (None: the library's default, or the solver's choice).
        partition / recompute / skeleton / offload / stages / microbatches / schedule /
            compile: the `sppo_fx.compile` arguments of the same names (offload None: none,
            or the library's default tier under a budget).
        offload_dir: directory of the disk tier (not an axis).
    """

    kind: str = LIBRARY_KIND
    amb: float | None = None
    model: str = "llama"
    size: str = "tiny"
    seq_len: int = 256
    batch: int = 1
    steps: int = 2
    dtype: str = "fp32"
    device: str = "cpu"
    budget: str | None = None
    budget_bytes: int | None = None
    chunks: int | None = None
    partition: str = "balanced"
    recompute: str = "auto"
    skeleton: str = "auto"
    offload: str | None = None
    stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    compile: bool = False
    offload_dir: str | None = None

    @property
    def is_anchor(self) -> bool:
        return self.kind != LIBRARY_KIND

    @property
    def label(self) -> str:
        """Short, unique within a grid: the anchor's name, or the library axes that differ
        from their defaults."""
        common = "".join(f" {v}" for v, d in ((self.dtype, "fp32"), (self.device, "cpu")) if v != d)
        if self.kind == "compile-amb":
            return f"compile-amb:{self.amb:g}{common}"
        if self.is_anchor:
            return self.kind + common
        parts = [f"{name}={axis_value(self, name)}" for name, default in LIBRARY_AXES
                 if axis_value(self, name) != default]
        return ("sppo " + " ".join(parts) if parts else "sppo") + common

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def axis_value(cfg: BenchConfig, axis: str) -> str | None:
    """The text of `axis` for this row, as the command line writes it ("kind" and "label"
    included); None where an anchor has no such axis."""
    if axis == "kind":
        return cfg.kind
    if axis == "label":
        return cfg.label
    if axis in ("dtype", "device"):
        return getattr(cfg, axis)
    if cfg.is_anchor:
        return None
    value = getattr(cfg, axis)
    if axis == "compile":
        return "on" if value else "off"
    if value is None:
        return {"budget": "none", "chunks": "auto", "offload": "none"}[axis]
    return str(value)


def split_list(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def parse_anchor(text: str) -> tuple[str, float | None]:
    """("compile-amb", 0.25) from "compile-amb:0.25"; ("eager", None) from "eager"."""
    name, _, arg = text.partition(":")
    if name not in ANCHOR_KINDS:
        raise SppoError(f"anchor {text!r}: choose from eager, compile, compile-amb:F, checkpoint")
    if name == "compile-amb":
        try:
            amb = float(arg) if arg else 0.5
        except ValueError:
            amb = -1.0
        if not 0 < amb <= 1:
            raise SppoError(f"anchor {text!r}: write compile-amb:F with 0 < F <= 1, e.g. compile-amb:0.25")
        return name, amb
    if arg:
        raise SppoError(f"anchor {text!r}: only compile-amb takes a value (compile-amb:F)")
    return name, None


def min_headroom(text: str | None) -> float | None:
    """The headroom of a "min" budget: 0.0 for "min", 0.1 for "min+10%"; None for any other
    budget. The worker asks the solver for its smallest feasible budget and adds this much:
    the minimum itself is often a plan of many tiny chunks whose step is far slower than a
    plan a few percent above it (the solver then picks the fastest plan that fits)."""
    if text == "min":
        return 0.0
    if text is None or not text.startswith("min+"):
        return None
    try:
        pct = float(text[4:-1]) if text.endswith("%") else -1.0
    except ValueError:
        pct = -1.0
    if not pct > 0:
        raise SppoError(f"budget {text!r}: headroom over the solver's minimum is written like 'min+10%'")
    return pct / 100


def check_budget(text: str) -> str:
    """Validate a budget axis value ("25%", "2GiB", "min", "min+10%"); returns it."""
    if min_headroom(text) is not None:
        return text
    if text.endswith("%"):
        try:
            frac = float(text[:-1])
        except ValueError:
            frac = -1.0
        if not 0 < frac:
            raise SppoError(f"budget {text!r}: a fraction of eager's peak is written like '25%'")
        return text
    parse_bytes(text, "budget")
    return text


def resolve_budget(text: str | None, eager_peak_bytes: int | None) -> int | None:
    """Bytes of a budget: "25%" of `eager_peak_bytes` (eager's measured peak extra memory),
    "2GiB" as written; None for no budget and for "min"/"min+P%" (the worker asks the solver).

    Raises SppoError when a fraction is asked without a measured eager peak."""
    if text is None or min_headroom(text) is not None:
        return None
    if text.endswith("%"):
        if not eager_peak_bytes:
            raise SppoError(f"budget {text} is a fraction of eager's measured peak extra memory, but eager "
                            f"measured {eager_peak_bytes or 0} bytes: add the eager anchor, run a longer "
                            f"sequence or give an absolute budget such as '2GiB'")
        return max(1, int(eager_peak_bytes * float(text[:-1]) / 100))
    return parse_bytes(text, "budget")


def _parse_axis(name: str, text: str) -> list:
    values = split_list(text)
    if not values:
        raise SppoError(f"--{name} is empty: give one value or a comma list")
    out = []
    for v in values:
        if name in CHOICES and v not in CHOICES[name]:
            raise SppoError(f"--{name} {v!r}: choose from {', '.join(CHOICES[name])}")
        if name in ("stages", "microbatches") or (name == "chunks" and v != "auto"):
            try:
                n = int(v)
            except ValueError:
                n = -1
            if n < (0 if name == "chunks" else 1):
                raise SppoError(f"--{name} {v!r}: give a positive integer" + (" or auto" if name == "chunks" else ""))
            out.append(n)
        elif name == "chunks":
            out.append(None)
        elif name == "budget":
            out.append(None if v == "none" else check_budget(v))
        elif name == "offload":
            out.append(None if v == "none" else v)
        elif name == "compile":
            out.append(v == "on")
        else:
            out.append(v)
    return out


def parse_filter(text: str) -> list[tuple[str, set[str]]]:
    """`--only` / `--skip` term "axis=v1|v2,axis2=v": every pair must match."""
    terms = []
    for part in split_list(text):
        axis, eq, values = part.partition("=")
        if not eq or axis not in AXES + ("kind", "label"):
            raise SppoError(f"filter {part!r}: write axis=value[|value], axis one of {', '.join(AXES + ('kind',))}")
        terms.append((axis, set(values.split("|"))))
    return terms


def matches(cfg: BenchConfig, terms: list[tuple[str, set[str]]]) -> bool:
    return all(axis_value(cfg, axis) in values for axis, values in terms)


def build_grid(base: BenchConfig, anchors: list[str], axes: dict[str, str], library: bool = True,
               only: list[str] = (), skip: list[str] = ()) -> list[BenchConfig]:
    """The rows: anchors (per dtype × device), then the product of the library axes.

    Args:
        base: model, sequence, steps, offload_dir shared by every row.
        anchors: anchor names ("eager", "compile-amb:0.25", ...).
        axes: axis name -> comma list (missing axes take their defaults).
        library: include library rows.
        only: keep rows matching any of these filters (none given: keep all).
        skip: drop rows matching any of these filters.

    Rows that mean the same run appear once: `chunks 0` is the eager anchor, and under a
    budget the solver chooses the chunks, so the chunk axis collapses there.
    """
    defaults = dict(LIBRARY_AXES + COMMON_AXES)
    values = {name: _parse_axis(name, axes.get(name) or defaults[name]) for name in AXES}
    unknown = set(axes) - set(AXES)
    if unknown:
        raise SppoError(f"unknown axes {sorted(unknown)}: use {', '.join(AXES)}")
    rows: list[BenchConfig] = []
    for dtype, device in itertools.product(values["dtype"], values["device"]):
        common = dataclasses.replace(base, dtype=dtype, device=device)
        for text in anchors:
            kind, amb = parse_anchor(text)
            rows.append(dataclasses.replace(common, kind=kind, amb=amb))
        if not library:
            continue
        names = [n for n, _ in LIBRARY_AXES]
        for combo in itertools.product(*(values[n] for n in names)):
            fields = dict(zip(names, combo))
            if fields["chunks"] == 0:
                rows.append(dataclasses.replace(common, kind="eager"))  # the former `--chunks 0`
                continue
            if fields["budget"] is not None:
                fields["chunks"] = None
            rows.append(dataclasses.replace(common, kind=LIBRARY_KIND, **fields))
    keep_terms = [parse_filter(t) for t in only]
    skip_terms = [parse_filter(t) for t in skip]
    out, seen = [], set()
    for cfg in rows:
        if keep_terms and not any(matches(cfg, t) for t in keep_terms):
            continue
        if any(matches(cfg, t) for t in skip_terms):
            continue
        if cfg.label not in seen:
            seen.add(cfg.label)
            out.append(cfg)
    if not out:
        raise SppoError("the grid is empty after --only/--skip: loosen the filters")
    return out
