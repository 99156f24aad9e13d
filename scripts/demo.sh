#!/usr/bin/env bash
# Set up (if needed) and run the demo: eager's peak memory on a long byte sequence, then a
# few optimizer steps of the same Llama-style model under a budget of a fraction of it,
# trained through sppo_fx's chunk programs (plan, progress, measured peak, loss).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# glibc returns large freed blocks to the OS, so the process's RSS follows live tensors and
# the measured peaks compare (as in bench/memory.py)
export MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072
exec .venv/bin/python -m sppo_fx demo "$@"
