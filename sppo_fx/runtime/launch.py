"""Start the ranks of a pipeline on this machine, set up as torchrun would (for tests and
benchmarks that need each rank's output; real jobs use torchrun)."""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import time
from typing import Any, Protocol

LOOPBACK = "127.0.0.1"


class ProcessStarter(Protocol):
    """How `start_local_ranks` starts one rank: called as `starter(cmd, env=env, **popen_kwargs)`
    and returning a `subprocess.Popen` or an object with its interface (pid, poll, wait,
    communicate, kill, terminate, send_signal, returncode, stdout, stderr)."""

    def __call__(self, cmd: list[str], *, env: dict[str, str], **popen_kwargs: Any) -> Any: ...


_starter: ProcessStarter = subprocess.Popen


def set_process_starter(starter: ProcessStarter | None) -> ProcessStarter:
    """Replace how `start_local_ranks` starts each rank process (None: `subprocess.Popen`,
    the default) and return the previous starter. For test suites that start many short
    launches: tests/helpers/zygote.py forks ranks from a process that has already imported
    torch. A starter must give each rank what a fresh `cmd` process with `env` would see."""
    global _starter
    previous, _starter = _starter, (subprocess.Popen if starter is None else starter)
    return previous


def listening_store(addr: str, port: int, timeout_s: float):
    """A rendezvous store (`TCPStore`, served by this process) that listens on `addr` only,
    on `port` (0: one the OS picks while it binds).

    `TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says
    (torch 2.13, both its libuv and its classic backend bind the wildcard address; `host` is
    only where clients connect), and it has no authentication: anyone on the network could
    read and write the ranks' keys. So this process binds the socket itself and hands the
    listening socket to the store (`master_listen_fd`), which then owns it (closes it when
    the store goes)."""
    import torch.distributed as dist
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(addr, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def loopback_store(timeout_s: float = 300.0):
    """A rendezvous store served by this process on 127.0.0.1 only (`listening_store`)."""
    return listening_store(LOOPBACK, 0, timeout_s)


class LocalRanks(list):
    """The rank processes (`subprocess.Popen`), rank 0 first, and `store`: the rendezvous
    store they join, served by this process. Keep this object while the ranks run."""
    store = None


def start_local_ranks(cmd: list[str], world: int, capture: bool = True, **popen_kwargs) -> LocalRanks:
    """Start `world` processes of `cmd` with torchrun's rendezvous environment.

    As torchrun's agent does, this process serves the rendezvous store (on a port the OS
    picks while it binds, on loopback only: `loopback_store`) and the ranks join it as clients. A port found free and bound by
    rank 0 seconds later, once it has imported torch, could be taken meanwhile by another
    job on the machine (a test suite's other worker starts ranks too).

    Args:
        cmd: the command every rank runs.
        world: number of ranks.
        capture: capture stdout/stderr as text.
        **popen_kwargs: passed to subprocess.Popen (e.g. cwd).

    Returns:
        The processes, rank 0 first, with the store. Each has one OpenMP thread, as under
        torchrun. Each is started by `subprocess.Popen` unless `set_process_starter` chose
        another starter.
    """
    procs = LocalRanks()
    procs.store = loopback_store()
    if capture:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR=LOOPBACK, MASTER_PORT=str(procs.store.port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   TORCHELASTIC_USE_AGENT_STORE="True")  # join this process's store, as under torchrun
        procs.append(_starter(cmd, env=env, **popen_kwargs))
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
