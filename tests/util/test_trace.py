"""Chrome/Perfetto traces: simulated steps, their text forms, the `trace` command."""
from __future__ import annotations

import json

import pytest

from sppo_fx.cli import main
from sppo_fx.schedule import build_schedule
from sppo_fx.solver.profiles import DeviceProfile
from sppo_fx.schedule.simulator import ActionCosts, simulate
from sppo_fx.util.chrome_trace import TID_BASE, render_text, simulated_trace, summarize_trace, write_trace

GB = 1e9
REQUIRED_X = {"name": str, "cat": str, "ph": str, "ts": (int, float), "dur": (int, float), "pid": int,
              "tid": int, "args": dict}


def _sim():
    P, N = 3, 5
    sched = build_schedule("1f1b", P, 1, N, offload=[(s, 0, i) for s in range(P) for i in range(N - 1)])
    prof = DeviceProfile("t", 1e12, 1 * GB, 1 * GB, 0.5 * GB, 0.5 * GB, 80 << 30)
    costs = ActionCosts(forward_seconds=0.01, backward_seconds=0.02, activation_bytes=0.02 * GB,
                        kv_bytes=0.001 * GB, send_bytes=0.001 * GB)
    return simulate(sched, costs, prof)


def _check_events(trace):
    """The checks a trace viewer relies on."""
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    xs = [e for e in events if e["ph"] == "X"]
    assert xs
    for e in xs:
        for key, typ in REQUIRED_X.items():
            assert isinstance(e[key], typ), (key, e)
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in names, f"thread of {e} is not named"
    assert {e["ph"] for e in events} <= {"X", "M", "C"}
    return xs, names


def test_simulated_trace_is_valid_chrome_json(tmp_path):
    sim = _sim()
    trace = simulated_trace(sim, title="test")
    path = write_trace(tmp_path / "sub" / "trace.json", trace)
    loaded = json.loads(open(path).read())
    xs, names = _check_events(loaded)
    # one X event per simulated event; resources map to the documented thread ids
    assert len(xs) == len(sim.events)
    assert {names[(0, TID_BASE[r])] for r in ("compute", "d2h", "h2d")} == {"compute", "d2h", "h2d"}
    assert any(n.startswith("link->") for n in names.values())
    procs = {e["pid"]: e["args"]["name"] for e in loaded["traceEvents"] if e.get("name") == "process_name"}
    assert set(procs) == {0, 1, 2} and procs[0].startswith("rank 0")
    # timestamps are microseconds of the simulated seconds
    f = next(e for e in xs if e["name"] == "0F0.0")
    assert f["dur"] == pytest.approx(0.01 * 1e6)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(sim.step_seconds * 1e6)
    counters = [e for e in loaded["traceEvents"] if e["ph"] == "C"]
    assert counters and all(e["args"]["GiB"] >= 0 for e in counters)
    assert loaded["otherData"]["step_seconds"] == pytest.approx(sim.step_seconds)
    assert "prediction" in loaded["otherData"]["source"]


def test_render_text_draws_one_row_per_resource():
    sim = _sim()
    text = render_text(simulated_trace(sim), width=60)
    rows = [ln for ln in text.splitlines() if "|" in ln]
    assert len(rows) == len({(e.rank, e.resource) for e in sim.events if not e.resource.startswith("recv")})
    assert all(len(ln.split("|")[1]) == 60 for ln in rows)
    compute0 = next(ln for ln in rows if ln.startswith("r0 compute")).split("|")[1]
    assert compute0[0] == "F" and compute0.rstrip()[-1] == "B"  # forwards first, backwards last
    assert "F forward" in text.splitlines()[-1]
    summary = summarize_trace(simulated_trace(sim))
    assert "rank 0" in summary and "compute" in summary


def test_trace_command_writes_the_simulated_trace_of_the_plan(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["trace", "--model", "gpt-7b", "--seq", "128K", "--gpus", "16", "--device", "h100",
                 "--out", str(out), "--summary"]) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "prediction" in text and "compute" in text
    trace = json.loads(out.read_text())
    xs, _ = _check_events(trace)
    assert {e["cat"] for e in xs} >= {"forward", "backward"}
