"""Utilities every layer may use: forked children, cache directories, units, logging,
version shims, K/V skeleton row arithmetic, Chrome traces. Nothing here imports
another sppo_fx package."""
