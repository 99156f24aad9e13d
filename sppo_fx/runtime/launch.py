"""Start the ranks of a pipeline on this machine, set up as torchrun would (for tests and
benchmarks that need each rank's output; real jobs use torchrun)."""
from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ranks(cmd: list[str], world: int, capture: bool = True, **popen_kwargs) -> list[subprocess.Popen]:
    """Start `world` processes of `cmd` with torchrun's rendezvous environment.

    Args:
        cmd: the command every rank runs.
        world: number of ranks.
        capture: capture stdout/stderr as text.
        **popen_kwargs: passed to subprocess.Popen (e.g. cwd).

    Returns:
        The processes, rank 0 first. Each has one OpenMP thread, as under torchrun.
    """
    port = free_port()
    if capture:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, **popen_kwargs))
    return procs


def run_local_ranks(cmd: list[str], world: int, timeout: float, **popen_kwargs) -> list[tuple[int, str, str, float]]:
    """Start `world` ranks of `cmd` (`start_local_ranks`) and wait for all of them.

    Returns:
        [(return code, stdout, stderr, seconds from the start until it ended)] per rank;
        all ranks are killed, and TimeoutExpired raised, when they take longer than `timeout`.
    """
    procs = start_local_ranks(cmd, world, **popen_kwargs)
    results, start = [], time.monotonic()
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err, time.monotonic() - start))
    return results
