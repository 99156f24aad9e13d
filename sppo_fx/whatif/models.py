"""Shapes of GPT-style models for the what-if planner, and sequence lengths such as "4M"
(the assumptions are in the package docstring, `sppo_fx/whatif/__init__.py`)."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from sppo_fx.errors import SppoError
from sppo_fx.solver.partition import ChunkCostModel

#: Bytes per token per layer (bf16): all saved activations, of which K+V; recompute saves the input.
ACT_BYTES_PER_H = 34
KV_BYTES_PER_H = 4
RECOMPUTE_BYTES_PER_H = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT-style decoder (MLP 4·h, tied embedding/head, bf16 training).

    Attributes:
        name: label.
        layers: transformer blocks L.
        hidden: model width h.
        heads: attention heads (Ulysses sequence parallelism needs D | heads).
        vocab: vocabulary size V.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise SppoError(f"ModelSpec.{f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise SppoError(f"hidden={self.hidden} is not divisible by heads={self.heads}")

    @property
    def params_per_layer(self) -> int:
        """12·h² + 13·h (QKV, projection, MLP weights and biases, two norms)."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def params(self) -> int:
        """All parameters (one embedding, tied head)."""
        return self.layers * self.params_per_layer + self.vocab * self.hidden

    @property
    def chunk_cost(self) -> ChunkCostModel:
        """Forward FLOPs of the whole model: a = 24·h²·L + 2·h·V per token, q = 4·h·L per pair."""
        h, L = self.hidden, self.layers
        return ChunkCostModel(24.0 * h * h * L + 2.0 * h * self.vocab, 4.0 * h * L)


#: The paper's Table 2 models.
MODELS = {
    "gpt-7b": ModelSpec("gpt-7b", 32, 4096, 32),
    "gpt-13b": ModelSpec("gpt-13b", 40, 5120, 40),
    "gpt-65b": ModelSpec("gpt-65b", 80, 8192, 64),
}


def get_model(name: Optional[str] = None, layers: Optional[int] = None, hidden: Optional[int] = None,
              heads: Optional[int] = None, vocab: Optional[int] = None) -> ModelSpec:
    """A built-in model, optionally with fields overridden, or a custom one.

    Args:
        name: "gpt-7b", "gpt-13b", "gpt-65b", or None / "custom" (then layers, hidden
            and heads are required).
        layers / hidden / heads / vocab: overrides.

    Returns:
        The ModelSpec.
    """
    if name is None or name == "custom":
        if None in (layers, hidden, heads):
            raise SppoError("a custom model needs --layers, --hidden and --heads")
        return ModelSpec("custom", layers, hidden, heads, vocab or 50257)
    key = name.strip().lower()
    if key not in MODELS:
        raise SppoError(f"unknown model {name!r}; built-in: {', '.join(MODELS)} (or custom with "
                        f"--layers/--hidden/--heads)")
    base = MODELS[key]
    over = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab).items()
            if v is not None}
    if over:
        return dataclasses.replace(base, name=f"{base.name}(custom)", **over)
    return base


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_tokens(text) -> int:
    """``"4M"`` -> 4194304, ``"640K"`` / ``"640k"`` -> 655360, ``"1000"`` -> 1000.

    Suffixes are binary (K = 1024, M = 1024², G = 1024³); a decimal mantissa is allowed
    ("1.5M").
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise SppoError(f"sequence length must be >= 1, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if m is None:
        raise SppoError(f"cannot read the sequence length {text!r}: use an integer with an "
                        f"optional K/M/G suffix, e.g. 4M, 640K, 128k")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise SppoError(f"sequence length must be >= 1, got {text!r}")
    return int(round(value))
