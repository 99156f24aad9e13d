"""Chunk 0's background compile's `auto` default (sppo_fx/codegen/background.py): on where a
core is free for the child, off on a CPU whose step threads take every core (the 2-core demo)."""
import pytest
import torch

from sppo_fx.codegen import background
from sppo_fx.errors import SppoError


@pytest.mark.parametrize("device, cores, threads, forks, on", [
    ("cpu", 2, 2, True, False),     # the 2-core demo: the step's threads take both cores
    ("cpu", 2, 1, True, True),      # one thread a step: the other core is the child's
    ("cpu", 16, 8, True, True),
    ("cpu", 8, 8, True, False),
    ("cpu", 8, 16, True, False),    # oversubscribed already
    ("cpu", 16, 8, False, False),   # no fork (or no FX graph cache): it would stall a step here
    ("cuda", 2, 2, False, True),    # the step runs on the GPU
    ("cuda:1", 1, 1, False, True),
    ("mps", 16, 1, True, False),
])
def test_auto_decision_from_core_and_thread_counts(device, cores, threads, forks, on):
    chosen, why = background.auto_decision(device, cores, threads, forks)
    assert chosen is on and why


@pytest.mark.parametrize("cores, threads, ranks, on", [(2, 1, 2, False), (4, 1, 2, True), (8, 2, 4, False)])
def test_auto_counts_the_threads_of_every_local_rank(cores, threads, ranks, on):
    """Pipeline ranks on one machine (one thread each, `runtime.launch`) share its cores."""
    assert background.auto_decision("cpu", cores, threads, True, ranks)[0] is on


@pytest.mark.parametrize("env, ranks", [({}, 1), ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, 4),
                                        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 2), ({"WORLD_SIZE": "8"}, 1)])
def test_local_ranks_from_the_launchers_environment(monkeypatch, env, ranks):
    for var in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert background.local_ranks() == ranks


def test_the_setting_defaults_to_auto_and_refuses_other_words(monkeypatch):
    monkeypatch.delenv(background.ENV, raising=False)
    assert background.setting() == "auto"
    for value, word in [("on", "on"), ("1", "on"), ("OFF", "off"), ("no", "off"), ("auto", "auto"), (" ", "auto")]:
        monkeypatch.setenv(background.ENV, value)
        assert background.setting() == word
    monkeypatch.setenv(background.ENV, "sometimes")
    with pytest.raises(SppoError, match="SPPO_FX_BACKGROUND_COMPILE='sometimes'"):
        background.setting()
    from sppo_fx.options import check_environment
    with pytest.raises(SppoError, match="SPPO_FX_BACKGROUND_COMPILE"):
        check_environment()  # refused before any training step


@pytest.mark.parametrize("cores, threads, on", [(2, 2, False), (4, 2, True)])
def test_auto_reads_this_machine(monkeypatch, cores, threads, on):
    """`enabled()` under auto asks the machine: usable cores and the step's intra-op threads."""
    from sppo_fx.util import forked
    monkeypatch.delenv(background.ENV, raising=False)
    monkeypatch.setattr(forked, "usable_cpus", lambda: cores)
    monkeypatch.setattr(forked, "can_fork", lambda: True)
    monkeypatch.setattr(background, "_cache_on", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(background, "local_ranks", lambda: 1)
    assert background.enabled("cpu") is on
    assert background.enabled("cuda")
    monkeypatch.setenv(background.ENV, "off")
    assert not background.enabled("cpu") and not background.enabled("cuda")
    monkeypatch.setenv(background.ENV, "on")
    assert background.enabled("cpu")


def _program(started: list, device="cpu"):
    stats = type("Stats", (), {"exact_eager_calls": 0, "exact_compiled_calls": 0})()
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: (lambda: "compiled"), stats, "test", device)
    prog._start = lambda tensors: started.append(prog.calls)  # no fork: record the start
    return prog


def test_auto_waits_for_a_free_core_before_starting(monkeypatch):
    """Under auto on a CPU, a machine whose cores are taken at chunk 0's second call does not
    start the child then; it starts at a later call that finds a core free."""
    from sppo_fx.util import forked
    monkeypatch.delenv(background.ENV, raising=False)
    free = [False]
    monkeypatch.setattr(forked, "a_core_is_free", lambda: free[0])
    monkeypatch.setattr(background, "RECHECK_S", 0.0)
    started: list = []
    prog = _program(started)
    prog()
    prog()
    prog()
    assert started == []  # busy: no child
    free[0] = True
    prog()
    prog()
    assert started == [4]  # once, at the first call with a free core


def test_on_starts_at_the_second_call_whatever_the_load(monkeypatch):
    from sppo_fx.util import forked
    monkeypatch.setenv(background.ENV, "on")
    monkeypatch.setattr(forked, "a_core_is_free", lambda: False)
    started: list = []
    prog = _program(started)
    prog()
    prog()
    prog()
    assert started == [2]
