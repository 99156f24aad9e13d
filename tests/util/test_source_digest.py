"""The source digest that keys what sppo_fx keeps across processes covers the whole package.

It keys the memory model's disk cache and the memory partitioner's part of Inductor's cache
keys (`sppo_fx/util/disk_cache.py`). When it covered `util/` alone, a change to a pass or to
`codegen/` read entries the old code had made: Inductor served a forward graph compiled
without the buffers the runtime holds kept from reuse.
"""
import os

import sppo_fx
from sppo_fx.util import disk_cache


def test_the_digest_covers_every_package_directory():
    files = disk_cache.source_files()
    assert disk_cache.PACKAGE_DIR == os.path.dirname(os.path.abspath(sppo_fx.__file__))
    for rel in ("api.py", "passes/offload.py", "codegen/inductor.py", "codegen/held_buffers.py",
                "util/disk_cache.py", "solver/clock.py"):
        assert rel in files, rel
    assert all(f.endswith(".py") for f in files) and files == sorted(files, key=files.index)


def test_the_digest_changes_with_a_file_outside_util(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "util").mkdir(parents=True)
    (pkg / "passes").mkdir()
    (pkg / "util" / "a.py").write_text("x = 1\n")
    (pkg / "passes" / "b.py").write_text("y = 1\n")
    monkeypatch.setattr(disk_cache, "PACKAGE_DIR", str(pkg))
    disk_cache.source_digest.cache_clear()
    try:
        before = disk_cache.source_digest()
        (pkg / "passes" / "b.py").write_text("y = 2\n")
        disk_cache.source_digest.cache_clear()
        assert disk_cache.source_digest() != before
    finally:
        disk_cache.source_digest.cache_clear()
