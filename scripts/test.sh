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
# One Inductor compile thread per process: with both cores already busy, Inductor's default
# pool of compile workers (a fresh interpreter started in every process that compiles, ~4
# CPU-s each) adds start-up work and no parallelism.
exec env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}" \
    .venv/bin/python -m pytest -q \
    -n "${SPPO_TEST_WORKERS:-2}" --dist loadgroup "$@"
