"""The cost model's data: the symbols c, p, b, per-node costs, saved tensors and
`ChunkCost`, the sympy cost of one chunk program (docs/architecture.md)."""
from __future__ import annotations

import dataclasses

import sympy
import torch
from tabulate import tabulate

from sppo_fx.errors import SppoError

aten = torch.ops.aten


aten = torch.ops.aten

#: Chunk length, prefix length (tokens before the chunk) and batch.
c, p, b = sympy.symbols("c p b", integer=True, nonnegative=True)


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class NodeCost:
    """Cost of one node of the chunk program.

    Attributes:
        name: the FX node's name.
        target: printable op name (e.g. "aten.linear.default", "chunk_causal_attention").
        kind: "matmul" | "attention" | "norm" | "pointwise" | "reduction" | "movement" |
            "view" | "size".
        fwd_flops: forward FLOPs (sympy, in c, p, b).
        bwd_flops: backward FLOPs (sympy; 0 when the node is not differentiated).
        bytes_written: bytes of freshly allocated outputs (0 for views).
        elementwise_bytes: bytes a memory-bound node (not a matmul, attention, view or
            factory) reads and writes in its forward (`flops.elementwise_bytes`); the
            clock's element-wise term.
    """

    name: str
    target: str
    kind: str
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    bytes_written: sympy.Expr
    elementwise_bytes: sympy.Expr = sympy.Integer(0)


@dataclasses.dataclass
class SavedTensor:
    """A tensor (storage) a chunk keeps between its forward and its backward.

    Attributes:
        name: node name in the AOT forward graph (level 2) or in the chunk program (level 1).
        shape_expr: shape as sympy expressions of c, p, b (of the whole storage).
        dtype: element type.
        bytes_expr: size in bytes (sympy).
        level: 1 = K/V skeleton (read by later chunks), 2 = chunk-private.
        kind: "kv" (skeleton K or V), "kv_concat" (the cat of prefix and chunk K/V the
            attention saves), "mask" (a [c, p + c] attention mask), "input" (a chunk
            input, e.g. token ids), "activation" (everything else).
        aliases: the saved values that are views of this storage (AOT node names).
        exact: False when a dim of the example could not be matched to an expression of
            c, p, b and was kept as the example's number.
    """

    name: str
    shape_expr: tuple
    dtype: torch.dtype
    bytes_expr: sympy.Expr
    level: int
    kind: str = "activation"
    aliases: tuple = ()
    exact: bool = True


@dataclasses.dataclass(frozen=True)
class AllocatedTensor:
    """A fresh tensor an op of a chunk's AOTAutograd graphs allocates (its output, not a
    view of an input, not written in place), as the graphs run op by op.

    Attributes:
        bytes_expr: its size in bytes (sympy in c, p, b).
        backward: made by the backward graph (which also holds a recompute's forward ops).
        matmul: made by a matmul, which a compiled program calls as its own kernel and so
            allocates too (Inductor fuses the other ops' outputs into fewer buffers).
        count: how many such tensors the graphs make.
    """

    bytes_expr: sympy.Expr
    backward: bool
    matmul: bool
    count: int = 1


@dataclasses.dataclass
class ChunkCost:
    """Costs of one chunk as sympy expressions of c (chunk length), p (prefix), b (batch).

    Attributes:
        fwd_flops: forward FLOPs of the chunk program.
        bwd_flops: backward FLOPs (see the module docstring for the rule).
        saved: saved tensors, level 1 (K/V skeleton) first.
        level1_bytes: total bytes of level 1 (the chunk's K and V, every attention site).
        level2_bytes: total bytes of level 2 (chunk-private saved activations).
        nodes: per-node costs, in graph order.
        batch: the traced (static) batch B; `evaluate` substitutes b = B by default.
        example: the (c0, p0) the saved tensors were measured at.
        partition: the AOTAutograd partitioner used ("default" or "min_cut").
        saved_first: the saved tensors of a chunk without prefix (p = 0), traced separately
            because attention may save different things there; when they differ from
            `saved` at p = 0, `level2_bytes` is a `Piecewise` (first chunk, otherwise).
        allocated: the fresh tensors the partition's forward and backward graphs allocate
            (`AllocatedTensor`): the clock's allocation term (`solver.clock`).
    """

    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    saved: list[SavedTensor]
    level1_bytes: sympy.Expr
    level2_bytes: sympy.Expr
    nodes: list[NodeCost]
    batch: int
    example: tuple[int, int]
    partition: str = "default"
    saved_first: list[SavedTensor] | None = None
    allocated: tuple = ()

    @property
    def saved_bytes(self) -> sympy.Expr:
        """level1_bytes + level2_bytes."""
        return self.level1_bytes + self.level2_bytes

    @property
    def bytes_written(self) -> sympy.Expr:
        """Bytes written by the forward (sum over nodes)."""
        return sympy.Add(*[n.bytes_written for n in self.nodes])

    @property
    def elementwise_bytes(self) -> sympy.Expr:
        """Bytes the forward's memory-bound (element-wise) nodes read and write, summed:
        linear in c for the token-local ones, the clock's element-wise term per token."""
        return sympy.Add(*[n.elementwise_bytes for n in self.nodes])

    def _subs(self, c_val, p_val, b_val) -> dict:
        return {c: int(c_val), p: int(p_val), b: int(self.batch if b_val is None else b_val)}

    def evaluate(self, c: int, p: int = 0, b: int | None = None) -> dict[str, float]:
        """Numbers for one chunk.

        Args:
            c: chunk length (tokens).
            p: prefix length (tokens before the chunk).
            b: batch (default: the traced batch).

        Returns:
            {"fwd_flops", "bwd_flops", "level1_bytes", "level2_bytes", "saved_bytes",
            "bytes_written", "elementwise_bytes"} as ints.
        """
        subs = self._subs(c, p, b)
        exprs = {"fwd_flops": self.fwd_flops, "bwd_flops": self.bwd_flops,
                 "level1_bytes": self.level1_bytes, "level2_bytes": self.level2_bytes,
                 "saved_bytes": self.saved_bytes, "bytes_written": self.bytes_written,
                 "elementwise_bytes": self.elementwise_bytes}
        return {k: _to_int(e.subs(subs)) for k, e in exprs.items()}

    def table(self, c: int | None = None, p: int = 0, b: int | None = None, nodes: bool = False) -> str:
        """Printable summary: totals and the saved tensors (and per-node costs if asked).

        Args:
            c, p, b: also print numbers at this point (c=None: expressions only).
            nodes: include the per-node table.

        Returns:
            A multi-line string (tabulate).
        """
        subs = self._subs(c, p, b) if c is not None else None

        def num(e):
            return _to_int(e.subs(subs)) if subs else ""

        rows = [(k, _pretty(e), num(e)) for k, e in
                (("forward FLOPs", self.fwd_flops), ("backward FLOPs", self.bwd_flops),
                 ("level 1 bytes (K/V skeleton)", self.level1_bytes),
                 ("level 2 bytes (chunk-private)", self.level2_bytes))]
        head = ["", "expression (c, p, b)", f"at c={c}, p={p}" if subs else ""]
        out = [f"chunk cost (traced batch B={self.batch}; saved tensors from the "
               f"{self.partition} partition at c={self.example[0]}, p={self.example[1]})",
               tabulate(rows, headers=head)]
        saved_rows = [(s.level, s.kind, s.name, _shape_str(s.shape_expr), str(s.dtype).replace("torch.", ""),
                       str(s.bytes_expr), num(s.bytes_expr)) for s in self.saved]
        out += ["", tabulate(saved_rows, headers=["level", "kind", "name", "shape", "dtype", "bytes", ""])]
        if nodes:
            node_rows = [(n.name, n.target, n.kind, str(n.fwd_flops), str(n.bwd_flops), str(n.bytes_written))
                         for n in self.nodes if n.kind != "size"]
            out += ["", tabulate(node_rows, headers=["node", "op", "kind", "fwd FLOPs", "bwd FLOPs", "bytes"])]
        return "\n".join(out)

    def __str__(self):
        return self.table()


def _to_int(e) -> int:
    e = sympy.sympify(e)
    if not e.is_number:
        raise SppoError(f"cost expression {e} still depends on {sorted(map(str, e.free_symbols))}")
    return int(sympy.ceiling(e))


def _pretty(e) -> str:
    if isinstance(e, sympy.Piecewise):
        return "; ".join(f"{_pretty(v)} if {cond}" if cond is not sympy.true else f"{_pretty(v)} otherwise"
                         for v, cond in e.args)
    return str(sympy.factor(e))


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"
