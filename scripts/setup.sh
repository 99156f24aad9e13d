#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the pinned CI requirements
# and sppo_fx installed in editable mode. Safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.sppo_fx_installed
if [ ! -f "$stamp" ] || [ requirements-ci.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-ci.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  touch "$stamp"
fi
