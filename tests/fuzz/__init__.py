"""Differential PROGRAM fuzzer: random small causal-LM-ish programs generated as Python
source (grammar.py), each run in eager and through `sppo_fx.compile` at several chunkings
(runner.py). Every program must be exact or refused with an SppoError before any step.

    .venv/bin/python -m tests.fuzz.runner --count 10000 --seed 0 --jobs 1
"""
