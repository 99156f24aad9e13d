#!/usr/bin/env bash
# Set up (if needed) and run the demo: a few optimizer steps of the Llama-style model
# on long byte-level sequences, trained through sppo_fx's chunk programs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sppo_fx demo "$@"
