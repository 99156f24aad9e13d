"""Mask passes and their symbolic helpers: `proof` (a mask as a function of j - i,
proved for every length), `values`, `causal` (SDPA masks), `document` (packed
documents), `explicit_attention` (written-out softmax attention)."""
