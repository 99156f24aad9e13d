"""Errors raised by sppo_fx.

Every error is raised before any training step runs and says what to change.
"""
from __future__ import annotations


class SppoError(RuntimeError):
    """A model, input or configuration that sppo_fx cannot transform exactly."""


class InfeasibleBudget(SppoError):
    """The memory budget is below the minimum any plan needs.

    Attributes:
        minimum_bytes: the smallest budget for which a plan exists.
    """

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = int(minimum_bytes)


def source_line(node) -> str:
    """The user's source line recorded by torch.export for an FX node (last frame)."""
    trace = (getattr(node, "meta", {}) or {}).get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    # The stack trace ends with 'File "...", line N, in fn' followed by the code line.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}".strip()
    return "<no source line recorded>"


def describe_node(node) -> str:
    """`aten.cumsum.default (node 'cumsum_1') at File "model.py", line 12, in forward: ...`."""
    target = getattr(node.target, "__name__", None) or str(node.target)
    if hasattr(node.target, "_overloadpacket"):
        target = str(node.target)
    return f"{target} (node '{node.name}') at {source_line(node)}"
