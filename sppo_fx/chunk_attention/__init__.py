"""Chunk attention in one place: `functions` (the attention functions the chunk
programs call), `op` (the registered chunk-attention ops), `kernels` (reference,
CPU flash and Triton implementations)."""
