"""The suite's rank starter (tests/helpers/zygote.py): a rank forked from the zygote behaves as
a fresh `python script.py` (argv, environment, working directory, streams, exit status,
traceback, signals), and anything it cannot give a rank goes to a fresh interpreter."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zygote

from sppo_fx.runtime import launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # starts zygotes and rank processes

SCRIPT = """
import json, os, sys
seen_torch = "torch" in sys.modules  # a fresh interpreter has not imported it yet
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "file": __file__,
                  "name": __name__, "env": {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR")},
                  "hash": hash("sppo"), "forked_torch": seen_torch, "ppid": os.getppid(),
                  "threads": len(os.listdir("/proc/self/task"))}))
print("to stderr", file=sys.stderr)
if len(sys.argv) > 1 and sys.argv[1] == "raise":
    def inner():
        raise ValueError("boom from the script")
    inner()
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    sys.stdout.flush()
    import time
    time.sleep(600)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "sub" / "rank_script.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def zygote_on(monkeypatch):
    """The zygote starts the ranks here, whatever SPPO_TEST_FORK_RANKS says for the rest of
    the suite's launches: these tests are about the zygote itself."""
    monkeypatch.setenv(zygote.ENV, "1")
    previous = launch.set_process_starter(zygote.start_process)
    yield
    launch.set_process_starter(previous)


def _start(cmd, env=None, **kw):
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    return zygote.start_process(cmd, env=dict(os.environ, **(env or {})), **kw)


def _run(cmd, env=None, timeout=300, **kw):
    p = _start(cmd, env, **kw)
    out, err = p.communicate(timeout=timeout)
    return p, json.loads(out.splitlines()[0]) if out.strip() else None, err


def test_the_suite_starts_ranks_with_the_zygote(script, tmp_path, monkeypatch):
    # the suite's starter (tests/conftest.py start_rank) hands the rank to the zygote unless
    # SPPO_TEST_FORK_RANKS=0 turns it off; the zygote logs each rank it is handed, and may
    # still start it by Popen for a logged reason (e.g. a zygote with OpenMP threads)
    log = tmp_path / "fork.log"
    monkeypatch.setenv(zygote.LOG_ENV, str(log))
    p = launch._starter([sys.executable, "sub/rank_script.py", "0"], env=dict(os.environ), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rows = [r for r in rows if "how" in r]  # the start, not the exit
    assert len(rows) == (1 if zygote.enabled() else 0)
    assert isinstance(p, zygote.ForkedProcess) == (bool(rows) and rows[0]["how"] == "fork")


@pytest.mark.usefixtures("zygote_on")
def test_a_forked_rank_sees_its_argv_env_cwd_streams_and_exit_code(script, tmp_path):
    p, seen, err = _run([sys.executable, "sub/rank_script.py", "7", "x y"], {"RANK": "5", "MASTER_ADDR": "é-host"},
                        cwd=tmp_path)
    assert isinstance(p, zygote.ForkedProcess)
    assert seen["forked_torch"], "the rank imported torch itself: not forked from the zygote"
    assert p.returncode == 7 and p.poll() == 7 and p.wait(1) == 7
    assert seen["argv"] == ["sub/rank_script.py", "7", "x y"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(script.parent) and seen["file"] == str(script) and seen["name"] == "__main__"
    assert seen["env"] == {"RANK": "5", "MASTER_ADDR": "é-host"}
    assert seen["threads"] == 1
    assert err == "to stderr\n"


@pytest.mark.usefixtures("zygote_on")
def test_without_cwd_a_rank_starts_in_the_callers_directory(script, monkeypatch):
    monkeypatch.chdir(script.parent)
    p, seen, _err = _run([sys.executable, "rank_script.py"])
    assert seen["forked_torch"] and p.returncode == 0
    assert seen["cwd"] == str(script.parent) and seen["file"] == str(script)


@pytest.mark.usefixtures("zygote_on")
def test_stderr_to_stdout_and_devnull(script):
    p = _start([sys.executable, str(script)], stderr=subprocess.STDOUT)
    out, err = p.communicate(timeout=300)
    assert err is None and out.splitlines()[1] == "to stderr" and p.returncode == 0
    p = _start([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert p.communicate(timeout=300) == (None, None) and p.returncode == 0


@pytest.mark.usefixtures("zygote_on")
def test_an_exception_exits_1_with_the_scripts_traceback(script):
    p, seen, err = _run([sys.executable, str(script), "raise"])
    assert seen["forked_torch"] and p.returncode == 1
    assert err.startswith("to stderr\nTraceback (most recent call last):\n"), err
    frames = [line for line in err.splitlines() if line.lstrip().startswith("File ")]
    assert len(frames) == 2 and all(str(script) in f for f in frames), err  # no zygote or runpy frame
    assert err.rstrip().endswith("ValueError: boom from the script")


@pytest.mark.usefixtures("zygote_on")
def test_wait_times_out_and_kill_ends_the_rank(script):
    p = _start([sys.executable, str(script), "sleep"])
    assert json.loads(p.stdout.readline())["forked_torch"]
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.5)
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=0.5)
    assert p.poll() is None
    p.kill()
    out, err = p.communicate(timeout=60)  # the zygote holds no copy of the pipes: EOF comes
    assert p.returncode == -signal.SIGKILL and err == "to stderr\n"
    assert not os.path.exists(f"/proc/{p.pid}") or _state(p.pid) is None  # reaped by the zygote
    p = _start([sys.executable, str(script), "sleep"])
    p.stdout.readline()
    p.terminate()
    assert p.wait(timeout=60) == -signal.SIGTERM


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.usefixtures("zygote_on")
def test_an_import_time_variable_gets_a_fresh_interpreters_value(script):
    """PYTHONHASHSEED is read when the interpreter starts: a rank asked for it gets the hash
    a fresh interpreter with it has, from another zygote (not the one without it)."""
    def fresh_hash(seed):
        out = subprocess.run([sys.executable, "-c", "print(hash('sppo'))"], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed), timeout=60).stdout
        return int(out)

    _p, plain, _err = _run([sys.executable, str(script)])
    _p, zero, _err = _run([sys.executable, str(script)], {"PYTHONHASHSEED": "0"})
    _p, again, _err = _run([sys.executable, str(script)], {"RANK": "9", "MASTER_PORT": "1"})  # read when used
    _p, one, _err = _run([sys.executable, str(script)], {"PYTHONHASHSEED": "1"})
    assert zero["hash"] == fresh_hash("0") and one["hash"] == fresh_hash("1")
    assert all(s["forked_torch"] for s in (plain, zero, again, one))
    assert len({plain["ppid"], zero["ppid"], one["ppid"]}) == 3  # three zygotes
    assert again["ppid"] == plain["ppid"] and again["hash"] == plain["hash"]


def test_commands_other_than_a_script_start_a_fresh_interpreter(script, monkeypatch):
    for name in ("-c", "-u", "sh"):  # files by those names: only the command's form may send it to Popen
        (script.parent / name).write_text("print('ran the file')")
    (script.parent / "sh").chmod(0o755)
    for cmd in ([sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
                [sys.executable, "-u", str(script)], ["env", "A=1", sys.executable, str(script)],
                ["sh", "-c", "exit 0"], [sys.executable, str(script) + ".missing"]):
        p = _start(cmd, cwd=script.parent)
        assert isinstance(p, subprocess.Popen), cmd
        p.communicate(timeout=300)
    monkeypatch.setenv(zygote.ENV, "0")
    p, seen, _err = _run([sys.executable, str(script)])
    assert isinstance(p, subprocess.Popen) and not seen["forked_torch"]


@pytest.mark.usefixtures("zygote_on")
def test_local_ranks_get_the_rendezvous_environment(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(textwrap.dedent("""
        import os, sys
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], "torch" in sys.modules)
    """))
    procs = launch.start_local_ranks([sys.executable, str(path)], 2)
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(isinstance(p, zygote.ForkedProcess) and p.returncode == 0 for p in procs)
    assert outs == [[str(r), "2", str(procs.store.port), "True"] for r in range(2)]


@pytest.mark.usefixtures("zygote_on")
def test_the_zygotes_ranks_die_with_it(script):
    """No rank outlives its zygote (PR_SET_PDEATHSIG), nor the zygote its pytest process."""
    p = _start([sys.executable, str(script), "sleep"], {"ZYGOTE_SCOPE": "killed"})  # a zygote of its own
    seen = json.loads(p.stdout.readline())
    assert seen["forked_torch"]
    with open(f"/proc/{seen['ppid']}/status") as f:
        assert f"PPid:\t{os.getpid()}" in f.read()  # the zygote is this process's child
    os.kill(seen["ppid"], signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _state(p.pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(p.pid) in (None, "Z"), "the rank outlived its zygote"
    p.communicate(timeout=60)
    p2, again, _err = _run([sys.executable, str(script)], {"ZYGOTE_SCOPE": "killed"})  # a new zygote
    assert again["forked_torch"] and again["ppid"] != seen["ppid"] and p2.returncode == 0
