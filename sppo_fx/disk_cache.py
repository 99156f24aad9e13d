"""What sppo_fx keeps on disk between processes: where (`cache_root`), how a file is written
(`write_atomically`), whether a cache is switched off (`enabled`), and the digest of
sppo_fx's own sources that keys everything derived from its passes (`source_digest`).

Users: the device profile (`solver/profile_cache.py`, `<root>/profiles/`), the memory
model's saved activations (`passes/cost/saved_cache.py`, `<root>/memory_model/`), and the
Inductor cache keys of the memory partitioner (`codegen/inductor.py`). Imports nothing from
sppo_fx, so every layer may use it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile


def cache_root() -> str:
    """`$SPPO_FX_CACHE_DIR`, else `$XDG_CACHE_HOME/sppo_fx`, else `~/.cache/sppo_fx`."""
    return os.environ.get("SPPO_FX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sppo_fx")


def enabled(env_var: str) -> bool:
    """False when `env_var` says off ("off", "0", "false", "no"); on by default."""
    return os.environ.get(env_var, "on").strip().lower() not in ("off", "0", "false", "no")


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` so that a reader (another process) sees the old file or the
    whole new one, never a part: a temporary file in the same directory, then a rename.
    Raises OSError (the caller decides whether a cache that cannot be written matters)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@functools.cache
def source_digest() -> str:
    """sha256 of every sppo_fx source file (path and bytes): anything computed by sppo_fx's
    passes and kept across processes is keyed on it, so a change to any pass (or to anything
    a pass calls) never reads an entry the old code made."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()
