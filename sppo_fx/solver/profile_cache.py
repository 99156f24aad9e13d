"""The device profile of this machine, calibrated once and kept on disk.

`device_profile(device, dir)` is what a budgeted `sppo_fx.compile` asks for on its first
call. It returns the profile stored for this machine, device and offload directory, or runs
`calibration.calibrate` once and stores what it measured, so that later processes skip the
measurement (about a second, more on a busy machine).

Where: `$SPPO_FX_CACHE_DIR/profiles/` (default `$XDG_CACHE_HOME/sppo_fx`, else
`~/.cache/sppo_fx`; `sppo_fx/util/disk_cache.py`), one JSON file per key. The key names what the
figures depend on: the device (CPU model and core count, or the GPU's name), torch's thread
count, and the filesystem of the offload directory (the disk tier's bandwidth).

A CPU profile calibrated while other processes competed for the cores (`busy`) is stored
as provisional: the figures are what a shared CPU did then (attention measured 10^4 times
slower than idle was seen), and a plan chosen on them can run at 2-3x the step of one
chosen on idle figures. The first later call that finds the machine idle calibrates again
and replaces it; while the machine stays busy the provisional profile is used (and a
warning says so once per process).

Refresh (after a hardware change, or when the calibration ran on a busy machine):
`SPPO_FX_RECALIBRATE=1` measures again and overwrites the file; `device_profile(...,
refresh=True)` does the same from Python; deleting the directory forgets every profile.
`SPPO_FX_PROFILE_CACHE=off` neither reads nor writes the cache; neither does a cache
directory that another user owns or may write (`disk_cache.private_dir`, warned once). A
stored profile whose values the solver cannot use (`DeviceProfile.check`: a rate of 0, inf,
a negative size) is ignored with a warning naming the file, and measured again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile

from sppo_fx.util.disk_cache import cache_root, enabled, private_dir, read_private, write_atomically
from sppo_fx.util.forked import others_runnable
from sppo_fx.util.log import get_logger, phase
from sppo_fx.solver.calibration import calibrate
from sppo_fx.solver.profiles import DeviceProfile

log = get_logger(__name__)
CALIBRATE_SECONDS = 1.0
BUSY_LOAD_PER_CORE = 0.5  # a load average above half the cores: others compete for them


def cache_dir() -> str:
    """The directory that holds the stored profiles."""
    return os.path.join(cache_root(), "profiles")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(device: str, dir: str | None = None) -> dict:
    """What a stored profile must match to be used (as a dict, stored with the profile)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        hardware = torch.cuda.get_device_name(index)
    else:
        hardware = f"{_cpu_model()} x{os.cpu_count()}"
    # the disk figures belong to the offload directory's filesystem, not to the directory:
    # two directories on one filesystem share a profile (a directory that cannot be read yet
    # is keyed by its path)
    target = os.path.realpath(dir or tempfile.gettempdir())
    try:
        disk = f"filesystem {os.stat(target).st_dev}"
    except OSError:
        disk = target
    # the version only goes up (13: allocation prices from many blocks at once, not one that
    # a heap's free block could serve; 12: allocation prices, matmuls into buffers, the element-wise
    # chain less its allocations; 11: an op of the memory passes' programs; 10: weights read
    # from memory; 9: a streamed block read measured on the op; 8: CPU attention timed on as
    # many heads as threads; 7: the element-wise bandwidth from two windows; 6, whose
    # block_call_seconds was taken back, must not be read as current either)
    return {"device": dev.type, "hardware": hardware, "threads": torch.get_num_threads(),
            "disk": disk, "host": platform.node(), "version": 13,
            # glibc's settings decide what a fresh tensor costs (`solver.allocation`)
            "allocator": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))}


def _path(key: dict) -> str | None:
    """The file of `key`, None when the cache directory is not private (then no cache)."""
    directory = private_dir("profiles", "device profile cache")
    if directory is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(directory, f"{key['device']}-{digest}.json")


def device_profile(device: str = "cpu", dir: str | None = None, refresh: bool | None = None) -> DeviceProfile:
    """This machine's profile for `device`: stored, or calibrated now and stored.

    Args:
        device: "cpu" or "cuda[:i]".
        dir: the offload directory the disk figures are for (default: the system temp dir).
        refresh: calibrate even when a profile is stored (default: env SPPO_FX_RECALIBRATE=1).

    Returns:
        The `DeviceProfile`; its `source` says whether it was read from a file.
    """
    if refresh is None:
        refresh = os.environ.get("SPPO_FX_RECALIBRATE", "").strip().lower() in ("1", "true", "yes", "on")
    use_cache = enabled("SPPO_FX_PROFILE_CACHE")
    key = profile_key(device, dir) if use_cache else None
    path = _path(key) if use_cache else None
    use_cache = path is not None
    cores = os.cpu_count() or 1
    load = None
    if use_cache and not refresh:
        stored, provisional = _read(path, key)
        if stored is not None and provisional:
            load = others_runnable()
            if _busy(device, load, cores):
                if path not in _warned_provisional:
                    _warned_provisional.add(path)
                    log.warning("device profile: using %s, calibrated while the machine was busy; it is "
                                "measured again at the first call that finds the machine idle (now %.1f other "
                                "runnable threads on %d cores)", path, load, cores)
                return stored
            log.info("device profile: %s was calibrated while the machine was busy; the machine is idle now "
                     "(%s other runnable threads on %d cores): calibrating again", path,
                     "?" if load is None else f"{load:.1f}", cores)
        elif stored is not None:
            log.info("device profile: stored calibration %s (SPPO_FX_RECALIBRATE=1 measures again)", path)
            return stored
    if load is None:
        load = others_runnable()
    with phase(f"calibrating the device profile ({device}, {CALIBRATE_SECONDS:g} s of matmuls, copies, disk)", log):
        profile = calibrate(device, seconds=CALIBRATE_SECONDS, dir=dir)
    if load is not None:
        profile.source = f"{profile.source}; {load:.1f} other runnable threads on {cores} cores before calibrating"
    busy = _busy(device, load, cores)
    if busy:
        # the figures are what a shared CPU does now (calibration.calibrate): stored as
        # provisional, replaced at the first idle call; say so where the user looks when
        # predicted step times are far off
        log.warning("calibrated the device profile while the machine was busy (%.1f other runnable threads on "
                    "%d cores): its FLOP rate is low and step-time predictions will be too slow; it is stored as "
                    "provisional and measured again at the first call that finds the machine idle; or refresh it "
                    "on an idle machine with SPPO_FX_RECALIBRATE=1", load, cores)
    if use_cache:
        _write(path, key, profile, provisional=busy)
    return profile


_warned_provisional: set = set()


def _busy(device: str, load: float | None, cores: int) -> bool:
    """Whether other processes compete for a CPU's cores (a CUDA device's figures are the GPU's)."""
    return load is not None and str(device).startswith("cpu") and load >= BUSY_LOAD_PER_CORE * cores


def load_average() -> float | None:
    """The 1-minute load average (other processes' demand for the cores), None where the
    OS does not report it."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _read(path: str, key: dict) -> tuple[DeviceProfile | None, bool]:
    """(the stored profile or None, whether it was stored as provisional: calibrated busy)."""
    try:
        data = json.loads(read_private(path))
        if not isinstance(data, dict) or not isinstance(data.get("profile"), dict):
            raise ValueError("not a stored device profile")
        if data.get("key") != key:
            return None, False
        profile = DeviceProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("ignoring the stored device profile %s (%s); calibrating again", path, e)
        return None, False
    except Exception as e:  # noqa: BLE001 - a stale file from another version (SppoError on fields)
        log.warning("ignoring the stored device profile %s (%s); calibrating again", path, e)
        return None, False
    profile.source = f"{profile.source}; stored in {path}"
    return profile, data.get("provisional") is True


def _write(path: str, key: dict, profile: DeviceProfile, provisional: bool = False) -> None:
    """Write atomically (another process may read or write the same file); `provisional`:
    calibrated on a busy machine, measured again at the first idle call."""
    try:
        data = {"key": key, "profile": profile.to_dict(), "provisional": bool(provisional)}
        write_atomically(path, json.dumps(data, indent=2).encode())
        log.info("device profile stored in %s", path)
    except OSError as e:
        log.warning("could not store the device profile in %s: %s", path, e)


_pass_ops_measured: dict = {}


def with_pass_ops(profile: DeviceProfile, device: str = "cpu", dir: str | None = None) -> DeviceProfile:
    """`profile` with its `pass_op_seconds`: the fixed cost per op of the programs the
    memory passes build (a plan with a tier runs them op by op where chunk programs are not
    compiled), measured on first need and stored beside the profile's other figures, so
    that a machine pays the probe (two tiny programs through AOTAutograd, about 8 s) once
    and a compiled run never does. A CPU's only (a GPU's op cost is the plain figure's);
    unchanged where the probe cannot run."""
    if profile.pass_op_seconds or not str(device).startswith("cpu"):
        return profile
    op = _pass_ops_measured.get(str(device))  # once per process where no cache stores it
    if op is None:
        from sppo_fx.solver.clock_calibration import program_op_seconds
        with phase("measuring an op of the memory passes' programs (op by op, with a tier)", log):
            op = _pass_ops_measured[str(device)] = program_op_seconds(profile.attention_call_seconds, 0.3,
                                                                        offload="device") or 0.0
    if not op:
        return profile
    key = profile_key(device, dir) if enabled("SPPO_FX_PROFILE_CACHE") else None
    path = _path(key) if key else None
    if path is not None:
        try:
            data = json.loads(read_private(path))
            if data.get("key") == key and isinstance(data.get("profile"), dict):
                data["profile"]["pass_op_seconds"] = float(op)
                write_atomically(path, json.dumps(data, indent=2).encode())
        except (OSError, ValueError) as e:
            log.warning("could not store the memory passes' op cost in %s: %s", path, e)
    return dataclasses.replace(profile, pass_op_seconds=float(op))
