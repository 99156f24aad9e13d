"""The suite's `xdist_group` marks take effect: a grouped module runs on one worker, so its
module fixture (Triton subprocesses, a rank launch, captured programs) is built once."""
from __future__ import annotations

import types

import pytest

pytest_plugins = ["pytester"]

GROUPED = """
import pytest
pytestmark = pytest.mark.xdist_group("g")

@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    pass
"""
PLAIN = """
def test_plain():
    pass
"""


def _config(loadgroup):
    return types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=loadgroup))


def test_a_grouped_test_gets_the_group_suffix_loadgroup_schedules_by(pytester):
    from conftest import _group_for_xdist
    from xdist.scheduler.loadgroup import LoadGroupScheduling
    pytester.makepyfile(test_grouped=GROUPED, test_plain=PLAIN)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    before = [item.nodeid for item in items]
    _group_for_xdist(_config(False), items)  # no xdist, or another --dist: ids stay
    assert [item.nodeid for item in items] == before and not any("@" in i for i in before)
    _group_for_xdist(_config(True), items)
    ids = {item.name: item.nodeid for item in items}
    assert all(ids[f"test_grouped[{i}]"] == f"test_grouped.py::test_grouped[{i}]@g" for i in range(3)), ids
    assert ids["test_plain"] == "test_plain.py::test_plain"
    # the scheduler's work units: one for the group, one per other test
    scope = LoadGroupScheduling._split_scope
    assert {scope(None, ids[f"test_grouped[{i}]"]) for i in range(3)} == {"g"}
    assert scope(None, ids["test_plain"]) == ids["test_plain"]
    _group_for_xdist(_config(True), items)  # a second pass adds nothing
    assert {item.name: item.nodeid for item in items} == ids


@pytest.mark.xdist_group("xdist_groups")
def test_this_session_groups_its_marked_tests(request):
    """Wired into the suite's collection hook: under `--dist loadgroup` (scripts/test.sh)
    this test's own id carries its group; without xdist nothing changes."""
    loadgroup = bool(getattr(request.config.option, "loadgroup", False))
    assert request.node.nodeid.endswith("@xdist_groups") == loadgroup, request.node.nodeid
