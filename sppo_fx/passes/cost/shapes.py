"""Symbolic shape propagation of a chunk program: every value's shape as sympy
expressions of the chunk length c, the prefix length p and the batch b."""
from __future__ import annotations


import sympy
import torch
import torch.fx as fx

from sppo_fx.errors import SppoError, describe_node
from sppo_fx.passes.cost.data import c, p
from sppo_fx.passes.cost.flops import shape_exprs

aten = torch.ops.aten


# ------------------------------------------------------------- symbolic propagation


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _prefix_shapes(program) -> dict[str, tuple[tuple, torch.dtype]]:
    out = {}
    for site in program.attention:
        out[f"{site.name}_k_prefix"] = (tuple(site.k_shape), site.dtype)
        out[f"{site.name}_v_prefix"] = (tuple(site.v_shape), site.dtype)
    return out


def _chunk_dim(program, node: fx.Node, seq) -> int | None:
    """The sequence dim of a chunk-input placeholder (from the program's boundaries)."""
    for spec in program.boundaries:
        if f"chunk_{spec.name}" == node.name:
            return spec.seq_dim
    val = node.meta.get("val")
    if seq is not None and isinstance(val, torch.Tensor):
        for i, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and sympy.simplify(s.node.expr - seq) == 0:
                return i
    return None


def _input_specs(program, seq=None) -> list[tuple[str, str, object]]:
    """(name, role, spec) per chunk-program placeholder, in order.

    role: "param" (spec = (shape, dtype)), "input" (spec = (shape with None at the seq dim,
    dtype)), "prefix" (shape with None at dim -2, dtype), "start", "len".
    """
    prefixes = _prefix_shapes(program)
    params = set(program.params)
    specs = []
    for n in _placeholders(program.chunk):
        if n.name == "chunk_start":
            specs.append((n.name, "start", None))
        elif n.name == "chunk_len":
            specs.append((n.name, "len", None))
        elif n.name in prefixes:
            shape, dtype = prefixes[n.name]
            shape = list(shape)
            shape[-2] = None
            specs.append((n.name, "prefix", (tuple(shape), dtype)))
        else:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise SppoError(f"chunk-program input {n.name!r} has no recorded shape (meta['val'])")
            dim = None if n.name in params else _chunk_dim(program, n, seq)
            shape = []
            for i, s in enumerate(val.shape):
                if i == dim:
                    shape.append(None)
                elif isinstance(s, torch.SymInt):
                    raise SppoError(f"chunk-program input {n.name!r} has a symbolic dim {i} ({s}) "
                                    "that is not its sequence dim")
                else:
                    shape.append(int(s))
            specs.append((n.name, "param" if n.name in params else "input", (tuple(shape), val.dtype)))
    return specs


def traced_batch(program, seq=None) -> int:
    """The static batch B of the chunk program: the leading dim of a sequence-dim input."""
    for _, role, spec in _input_specs(program, seq):
        if role == "input" and spec[0] and spec[0][0] is not None and None in spec[0]:
            return int(spec[0][0])
    for _, role, spec in _input_specs(program, seq):
        if role == "prefix" and spec[0]:
            return int(spec[0][0])
    return 1


def symbolic_values(program, seq=None, hints: tuple[int, int] = (7, 11)) -> dict[fx.Node, object]:
    """Run the chunk program on fake tensors with a symbolic chunk length and prefix.

    Args:
        program: a `ChunkedProgram`.
        seq: the captured sequence symbol (locates the sequence dim of chunk inputs whose
            boundary spec is missing).
        hints: example (c, p) the shape environment uses to decide guards (>= 2 each, so
            neither symbol is specialised to 0/1).

    Returns:
        node -> fake value (tensors with SymInt shapes, SymInts). The shapes are in the
        shape environment's own symbols; the returned dict's `rename` attribute maps them to
        the module symbols `c` and `p` (`expr.xreplace(values.rename)`).
    """
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sppo_fx.util.compat import symbolic_dispatch

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    c_sym = env.create_symbol(hints[0], ConstantSource("sppo_c"))
    p_sym = env.create_symbol(hints[1], ConstantSource("sppo_p"))
    c_int = env.create_symintnode(c_sym, hint=hints[0])
    p_int = env.create_symintnode(p_sym, hint=hints[1])
    # the program's own constants (get_attr buffers, e.g. RoPE's inv_freq) are real tensors:
    # its fake inputs go on their device
    metas = [n.meta.get("val") for n in program.chunk.graph.nodes if n.op == "placeholder"]
    device = next((t.device for t in (*metas, *program.chunk.buffers()) if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    args = []
    with mode:
        for name, role, spec in _input_specs(program, seq):
            if role == "start":
                args.append(p_int)
            elif role == "len":
                args.append(c_int)
            else:
                shape, dtype = spec
                fill = p_int if role == "prefix" else c_int
                args.append(torch.empty([fill if s is None else s for s in shape], dtype=dtype, device=device))
        values: dict[fx.Node, object] = {}

        current = []

        class _Recorder(fx.Interpreter):
            def run_node(self, n):
                current[:] = [n]
                r = super().run_node(n)
                values[n] = r
                return r

        try:
            with symbolic_dispatch():
                _Recorder(program.chunk).run(*args)
        except SppoError:
            raise
        except Exception as e:  # noqa: BLE001 - report which node failed
            where = describe_node(current[0]) if current else "the chunk program"
            raise SppoError(f"cost model: symbolic shape propagation failed at {where}: "
                            f"{type(e).__name__}: {e}") from e
    rename = {c_sym: c, p_sym: p}
    return _RenamedValues(values, rename)


class _RenamedValues(dict):
    """node -> value with SymInt expressions renamed to the module's c / p symbols."""

    def __init__(self, values, rename):
        super().__init__(values)
        self.rename = rename


def _renamed_shape(t: torch.Tensor, rename: dict) -> tuple:
    return tuple(e.xreplace(rename) for e in shape_exprs(t))
