"""Chunk attention by job: `common` (validation, Triton availability), `reference` (plain
PyTorch), `cpu` (ATen flash kernels merged by log-sum-exp), `triton_kernels` and
`triton_launch` (GPU). The ops and public functions are in `sppo_fx/chunk_attention/op.py`."""
