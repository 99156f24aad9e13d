"""What sppo_fx keeps on disk between processes: where (`cache_root`, `private_dir`), how a
file is written (`write_atomically`) and read (`read_private`), whether a cache is switched
off (`enabled`), and the digest of sppo_fx's own sources that keys everything derived from
its passes (`source_digest`).

A cache is data another process wrote, so it is read only from a directory that nobody else
can write to: `private_dir` creates missing directories with mode 0700 and refuses (one
warning, then no cache) a directory that belongs to another user or that group or others may
write, as in a shared /tmp where someone else created the directory first. Files are JSON,
never pickles, and every value read is validated by its reader. Inductor's own cache
(`secure_inductor_cache`) is checked the same way: torch creates /tmp/torchinductor_<user>
with the default mode and never checks who owns it, and its FX graph cache entries are
pickles and shared libraries that it loads.

Users: the device profile (`solver/profile_cache.py`, `<root>/profiles/`), the memory
model's saved activations (`passes/cost/saved_cache.py`, `<root>/memory_model/`), and the
Inductor cache keys of the memory partitioner (`codegen/inductor.py`). Imports nothing from
sppo_fx, so every layer may use it.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
import tempfile

log = logging.getLogger("sppo_fx.util.disk_cache")
_warned: set[str] = set()  # directories refused (one warning each)


def cache_root() -> str:
    """`$SPPO_FX_CACHE_DIR`, else `$XDG_CACHE_HOME/sppo_fx`, else `~/.cache/sppo_fx`."""
    return os.environ.get("SPPO_FX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sppo_fx")


def enabled(env_var: str) -> bool:
    """False when `env_var` says off ("off", "0", "false", "no"); on by default."""
    return os.environ.get(env_var, "on").strip().lower() not in ("off", "0", "false", "no")


def _make_private(path: str) -> None:
    """Create `path` and its missing parents, each with mode 0700 (whatever the umask)."""
    missing, p = [], os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # another process made it: checked like any existing directory
        os.chmod(d, 0o700)


def unsafe_reason(path: str) -> str | None:
    """Why the directory `path` may not hold a cache (None: it may): not a directory, owned
    by another user, or writable by group or others (they could plant or replace files)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _refuse(path: str, why: str, what: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("%s: not using %s, which %s; make it yours with mode 0700 (chmod 700), or point "
                    "SPPO_FX_CACHE_DIR at a directory of your own", what, path, why)


def private_dir(sub: str, what: str = "sppo_fx cache") -> str | None:
    """`cache_root()/sub`, created with mode 0700 where missing, when it and the cache root
    belong to this user and no one else may write to them; else None (warned once): use no
    cache, neither read nor write."""
    root = cache_root()
    path = os.path.join(root, sub)
    try:
        _make_private(path)
    except OSError as e:
        _refuse(path, f"cannot be created ({e.strerror})", what)
        return None
    for d in (root, path):
        why = unsafe_reason(d)
        if why is not None:
            _refuse(d, why, what)
            return None
    return path


def read_private(path: str) -> bytes:
    """The bytes of the regular file `path`, not followed through a link, when this user owns
    it. Raises FileNotFoundError when it is absent, OSError when it is not such a file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{path} is not a regular file of this user")
        return f.read()


def secure_inductor_cache() -> str:
    """Make Inductor's cache directory (`$TORCHINDUCTOR_CACHE_DIR`, else torch's default
    /tmp/torchinductor_<user>) one that only this user can write: created with mode 0700
    when missing; one that belongs to someone else or that others may write is replaced,
    with a warning, by a new private temporary directory (no cache across processes).
    Sets `TORCHINDUCTOR_CACHE_DIR` to the directory it returns; checked once per path."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        path = default_cache_dir()
    path = os.path.abspath(path)
    if path in _inductor_checked:
        return path
    try:
        _make_private(path)
        why = unsafe_reason(path)
    except OSError as e:
        why = f"cannot be created ({e.strerror})"
    if why is not None:
        fresh = tempfile.mkdtemp(prefix="sppo_fx_inductor_")
        log.warning("Inductor's cache directory %s %s: compiling into the new private directory %s "
                    "instead (nothing is reused across processes); set TORCHINDUCTOR_CACHE_DIR to a "
                    "directory of your own with mode 0700", path, why, fresh)
        path = fresh
    _inductor_checked.add(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


_inductor_checked: set[str] = set()


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` so that a reader (another process) sees the old file or the
    whole new one, never a part: a temporary file (mode 0600) in the same directory, then a
    rename. Raises OSError (the caller decides whether a cache that cannot be written matters)."""
    directory = os.path.dirname(path)
    _make_private(directory)
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


#: the sppo_fx package directory, whose sources `source_digest` covers (this file lies in
#: its `util/`: the digest once covered `util/` alone, so a change to a pass kept old entries)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_files(root: str | None = None) -> list[str]:
    """Every `.py` file under `root` (the package), as paths relative to it, in a fixed order."""
    root = root or PACKAGE_DIR
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        out.extend(os.path.relpath(os.path.join(dirpath, name), root) for name in sorted(files) if name.endswith(".py"))
    return out


@functools.cache
def source_digest() -> str:
    """sha256 of every sppo_fx source file (path and bytes): anything computed by sppo_fx's
    passes and kept across processes is keyed on it, so a change to any pass (or to anything
    a pass calls) never reads an entry the old code made."""
    digest = hashlib.sha256()
    for rel in source_files():
        digest.update(rel.encode())
        with open(os.path.join(PACKAGE_DIR, rel), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()
