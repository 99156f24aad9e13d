#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest:
#   ./scripts/test.sh -m "not slow"     the development tier (no Inductor compiles, rank
#                                       launches or long runs; docs/testing.md)
#   ./scripts/test.sh tests/passes/test_seqdim.py -x     one file
# Markers (pyproject.toml): slow, distributed (starts rank processes), cuda (needs a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (SPPO_TEST_WORKERS; 0 runs in this process) with one OpenMP thread each:
# most of the suite is single-threaded tracing and compiling, so two workers use both cores,
# while OpenMP threads spinning on an oversubscribed CPU would slow every worker down.
# --dist loadgroup hands out one test at a time, which balanced the long tests better here
# than the default (17.3 vs 19.0 min), and keeps a module marked with an xdist_group on one
# worker (tests/chunk_attention/test_chunk_attention.py, whose Triton subprocesses start once per worker).
# Tests that start rank processes may run beside another test; their peer timeouts allow
# for that.
# torch's fake-tensor dispatch cache off (TORCH_FAKE_TENSOR_DISPATCH_CACHE=1 turns it back on):
# the suite is torch.export of hundreds of tiny models, each a fresh ShapeEnv whose symbolic
# cache misses cost more than they save (the development tier ran in 141 s against 195 s).
# The exported graphs are the same either way (tests/e2e/test_fake_tensor_cache.py); the
# library itself keeps torch's default, which a model that repeats its layers gains from.
exec env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    TORCH_FAKE_TENSOR_DISPATCH_CACHE="${TORCH_FAKE_TENSOR_DISPATCH_CACHE:-0}" .venv/bin/python -m pytest -q \
    -n "${SPPO_TEST_WORKERS:-2}" --dist loadgroup "$@"
