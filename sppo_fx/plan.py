"""The Plan: how one sequence is cut into chunks (and, later, where activations live).

A Plan is plain data: it prints as a table and round-trips through JSON.
"""
from __future__ import annotations

import dataclasses
import json

from tabulate import tabulate

from sppo_fx.errors import SppoError


@dataclasses.dataclass
class Plan:
    """Chunk partition of a sequence.

    Attributes:
        seq_len: tokens in the sequence.
        chunk_lengths: tokens per chunk, in order; they sum to `seq_len`.
    """

    seq_len: int
    chunk_lengths: list[int]

    def __post_init__(self):
        self.chunk_lengths = [int(c) for c in self.chunk_lengths]
        if any(c < 1 for c in self.chunk_lengths):
            raise SppoError(f"chunk lengths must be >= 1, got {self.chunk_lengths}")
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

    def bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] per chunk."""
        return [(s, s + c) for s, c in zip(self.starts, self.chunk_lengths)]

    def table(self) -> str:
        rows = [(i, s, e, e - s, s) for i, (s, e) in enumerate(self.bounds())]
        return tabulate(rows, headers=["chunk", "start", "end", "tokens", "K/V prefix"])

    def __str__(self):
        return self.table()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))


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
