"""Chunk 0's compile's `auto` default (sppo_fx/codegen/background.py): beside the steps where
a core is free for the child; where the step threads take every core (the 2-core demo) or no
child can fork, at chunk 0's second call, which waits for it."""
import os

import pytest
import torch

from sppo_fx.codegen import background
from sppo_fx.codegen.inductor import CodegenStats
from sppo_fx.errors import SppoError


@pytest.mark.parametrize("device, cores, threads, forks, mode", [
    ("cpu", 2, 2, True, "wait"),    # the 2-core demo: the step's threads take both cores
    ("cpu", 2, 1, True, "on"),      # one thread a step: the other core is the child's
    ("cpu", 16, 8, True, "on"),
    ("cpu", 8, 8, True, "wait"),
    ("cpu", 8, 16, True, "wait"),   # oversubscribed already
    ("cpu", 16, 8, False, "wait"),  # no fork (or no FX graph cache): compiled here, one step pays it
    ("cuda", 2, 2, False, "on"),    # the step runs on the GPU
    ("cuda:1", 1, 1, False, "on"),
    ("mps", 16, 1, True, "off"),
])
def test_auto_decision_from_core_and_thread_counts(device, cores, threads, forks, mode):
    chosen, why = background.auto_decision(device, cores, threads, forks)
    assert chosen == mode and why


@pytest.mark.parametrize("cores, threads, ranks, mode", [(2, 1, 2, "off"), (4, 1, 2, "on"), (8, 2, 4, "off")])
def test_auto_counts_the_threads_of_every_local_rank(cores, threads, ranks, mode):
    """Pipeline ranks on one machine (one thread each, `runtime.launch`) share its cores; a
    rank never waits for the compile in a step (its peers would wait past their timeout)."""
    assert background.auto_decision("cpu", cores, threads, True, ranks, world=ranks)[0] == mode


@pytest.mark.parametrize("device, forks, cores, mode", [("cpu", True, 2, "off"), ("cpu", False, 16, "off"),
                                                        ("cpu", True, 16, "on"), ("cuda", False, 16, "off")])
def test_auto_never_makes_a_rank_of_a_group_wait(device, forks, cores, mode):
    """Data or sequence parallel ranks on other machines (one local rank): no step of theirs
    compiles chunk 0, on a CPU or (where no child can fork once CUDA is up) a GPU."""
    assert background.auto_decision(device, cores, 2, forks, 1, world=4)[0] == mode


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
    for value, word in [("on", "on"), ("1", "on"), ("OFF", "off"), ("no", "off"), ("auto", "auto"), (" ", "auto"),
                        ("Wait", "wait")]:
        monkeypatch.setenv(background.ENV, value)
        assert background.setting() == word
    monkeypatch.setenv(background.ENV, "sometimes")
    with pytest.raises(SppoError, match="SPPO_FX_BACKGROUND_COMPILE='sometimes'"):
        background.setting()
    from sppo_fx.options import check_environment
    with pytest.raises(SppoError, match="SPPO_FX_BACKGROUND_COMPILE"):
        check_environment()  # refused before any training step


@pytest.mark.parametrize("cores, threads, mode", [(2, 2, "wait"), (4, 2, "on")])
def test_auto_reads_this_machine(monkeypatch, cores, threads, mode):
    """`enabled()` under auto asks the machine: usable cores and the step's intra-op threads."""
    from sppo_fx.util import forked
    monkeypatch.delenv(background.ENV, raising=False)
    monkeypatch.setattr(forked, "usable_cpus", lambda: cores)
    monkeypatch.setattr(forked, "can_fork", lambda: True)
    monkeypatch.setattr(background, "_cache_on", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(background, "local_ranks", lambda: 1)
    assert background.mode("cpu") == mode and background.enabled("cpu")
    assert background.mode("cuda") == "on"
    monkeypatch.setenv(background.ENV, "off")
    assert not background.enabled("cpu") and not background.enabled("cuda")
    monkeypatch.setenv(background.ENV, "on")
    assert background.mode("cpu") == "on"
    monkeypatch.setenv(background.ENV, "wait")
    assert background.mode("cpu") == "wait"


def _program(started: list, device="cpu"):
    stats = CodegenStats()
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


def test_wait_compiles_at_the_second_call_and_runs_the_compiled_code_there(monkeypatch):
    """Mode "wait" (auto where the step threads take every core): chunk 0's second call
    starts the compile, waits for it, and already runs Inductor's code; a busy machine does
    not put it off (the steps would otherwise run op by op for good)."""
    from sppo_fx.util import forked
    monkeypatch.delenv(background.ENV, raising=False)
    monkeypatch.setattr(forked, "a_core_is_free", lambda: False)
    monkeypatch.setattr(forked, "can_fork", lambda: False)  # no child: the compile runs here
    stats = CodegenStats()
    compiles: list = []

    def compile_(tensors):
        compiles.append(tensors)
        return lambda: (lambda *t: "compiled")
    prog = background.ExactProgram(lambda *t: "eager", compile_, stats, "test", "cpu", wait=True)
    assert [prog(1), prog(2), prog(3)] == ["eager", "compiled", "compiled"]
    assert compiles == [(2,)] and stats.background_compiles == 1
    assert (stats.exact_eager_calls, stats.exact_compiled_calls) == (1, 2)


def test_wait_compiles_here_when_the_child_runs_past_the_limit(monkeypatch):
    """Mode "wait" with a child that never finishes: after `WAIT_LIMIT_S` the child is left
    to end on its own and the call compiles in this process, then runs the compiled code."""
    monkeypatch.setattr(background, "WAIT_LIMIT_S", 0.01)
    stats = CodegenStats()
    detached: list = []
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: (lambda: (lambda *t: "compiled")),
                                   stats, "test", "cpu", wait=True)
    child = type("Child", (), {"detach": lambda self: detached.append(True)})()

    def start(tensors):
        prog.job, prog.child = prog.compile(tensors), child
    monkeypatch.setattr(prog, "_start", start)
    monkeypatch.setattr(prog, "_child_running", lambda: prog.child is not None)  # stuck until detached
    assert [prog(1), prog(2), prog(3)] == ["eager", "compiled", "compiled"]
    assert detached == [True] and stats.background_compiles == 1


def test_running_says_whether_a_child_compiles_and_takes_nothing():
    """`running()` (what the demo asks before timing an eager step between the library's)
    is true while a forked child compiles; with no child it is false and leaves a pending
    compile pending, where `wait(0)` compiles it here."""
    import subprocess
    stats = CodegenStats()
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: (lambda: "compiled"), stats, "test", "cpu")
    prog.job = lambda: "compiled"
    assert not prog.running() and prog.job is not None and stats.background_compiles == 0
    sleeper = subprocess.Popen(["sleep", "30"])
    prog.child = type("Child", (), {"pid": sleeper.pid, "_close": lambda self: None})()
    try:
        assert prog.running() and prog.job is not None
    finally:
        sleeper.kill()
        sleeper.wait()
    prog.child = None  # (Popen reaped the sleeper)
    assert not prog.running() and prog.job is not None
    assert prog.wait(0) and prog.job is None and stats.background_compiles == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="needs Linux's /proc/self/status, which this system lacks")
def test_the_compile_here_records_what_it_kept_in_the_process(monkeypatch):
    """What this process's RSS grew by while it took chunk 0's compiled program is recorded
    (`background_compile_rss_bytes`): the demo takes it off the peak of the step that took
    it. A compile that keeps 64 MiB records about that; one whose 64 MiB were scratch, freed
    before it returned, much less; a failed one nothing."""
    kept: list = []

    def compiled_program():
        kept.append(torch.ones(16 << 20))  # 64 MiB the program keeps, as Inductor's module would
        return lambda *t: "compiled"
    stats = CodegenStats()
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: compiled_program, stats, "test", "cpu")
    prog.job = compiled_program
    assert prog.wait(0) and prog() == "compiled"
    assert stats.background_compiles == 1 and stats.background_compile_rss_bytes >= 60 << 20  # slack: RSS

    def scratch_only():
        torch.ones(16 << 20).sum()  # 64 MiB of scratch, freed before the compile returns
        return lambda *t: "compiled"
    stats = CodegenStats()
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: scratch_only, stats, "test", "cpu")
    prog.job = scratch_only
    assert prog.wait(0) and prog() == "compiled"
    assert stats.background_compiles == 1 and stats.background_compile_rss_bytes < 32 << 20

    def failing():
        kept.append(torch.ones(16 << 20))
        raise RuntimeError("no compile")
    stats = CodegenStats()
    prog = background.ExactProgram(lambda *t: "eager", lambda tensors: failing, stats, "test", "cpu")
    prog.job = failing
    assert prog.wait(0) and prog() == "eager"
    assert (stats.background_failures, stats.background_compiles, stats.background_compile_rss_bytes) == (1, 0, 0)
