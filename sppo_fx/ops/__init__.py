"""Custom operators used by sppo_fx (chunk attention with Triton kernels)."""
from sppo_fx.ops.chunk_attention import (
    chunk_attention,
    chunk_attention_with_lse,
    segmented_chunk_attention,
)

__all__ = ["chunk_attention", "chunk_attention_with_lse", "segmented_chunk_attention"]
