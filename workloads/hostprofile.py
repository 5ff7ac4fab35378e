"""The `host` hardware profile: this machine's peak numbers, measured once and cached.

An emulated mesh (n virtual XLA CPU devices, docs/architecture.md "Emulated mesh") runs on this
host's cores, so its MFU must be a fraction of *this host's* measured peak, never a
TPU's. A peak that reads low makes MFU exceed 100% (an early version measured one plain
bf16 2048 matmul under load and the quickstart showed 229%), so the peak is built to be
an upper bound on what the engine can reach (`host_profile()`, ~3-5 s once per host):

- peak_flops: matmuls the way the engine runs them (`partitioning.matmul`: bf16 inputs,
  f32 accumulation via `preferred_element_type`; on XLA CPU this takes a bf16 dot-product
  kernel and runs ~2x faster than a plain bf16 dot), at several sizes, plus f32; best of
  a few repeats, max over all of them. Measured twice: in this process on the cores it
  may use, and in a child process pinned to ONE core (whose best x the host's cores is
  the whole host's compute if every core ran like that one). The larger one is kept: a
  measurement disturbed by other jobs can only read low, so the max of the two is the
  closer upper bound;
- hbm_bandwidth: a jitted sum over 256 MiB of f32 (bytes read / second; decode's memory
  roofline is reads of weights and KV cache), best of this process and the pinned child.
  Bandwidth is shared by the cores, so it is not multiplied by them;
- ici_bandwidth: a copy of a 64 MiB array between two virtual devices when this process
  has at least two, else a jitted copy on one device (read + write bytes / second); the
  cache records which as `ici_measured_as`. Either way it is host memory traffic;
- hbm_bytes: physical memory.

The result is cached as YAML in `$SWEEPER_HOME/host_profile.yaml` (default
`./.sweeper/host_profile.yaml`), keyed by hostname + CPU count + jax version + the
measurement's version (`PROFILE_VERSION`: a cache written by an older measurement is
measured again). `workloads.hardware.per_chip` splits the whole host evenly over n virtual chips.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from workloads.config import HardwareProfile

# 2: peak = max over bf16->f32 / f32 matmul sizes, in-process and cores x one pinned core
# (1 was one plain bf16 2048 matmul, which read 2-3x below what the engine reaches).
PROFILE_VERSION = 2
# (rows = cols = contraction, input dtype, accumulation dtype); bf16 -> f32 is the engine's.
# 2048 and up read lower on this class of host (cache blocking) and cost ~0.1 s each.
MATMULS = ((256, "bfloat16", "float32"), (512, "bfloat16", "float32"),
           (1024, "bfloat16", "float32"), (1024, "float32", "float32"))
REDUCE_BYTES = 256 * 2**20
COPY_BYTES = 64 * 2**20
TRIES = 5
CHILD_TIMEOUT_S = 60.0


def sweeper_home() -> Path:
    """`$SWEEPER_HOME`, else `./.sweeper` (as sweeper/paths.py; workloads does not import sweeper)."""
    return Path(os.environ.get("SWEEPER_HOME") or ".sweeper").expanduser().resolve()


def cache_path() -> Path:
    return sweeper_home() / "host_profile.yaml"


def host_cores() -> int:
    """The host's CPU count (the whole machine an emulated mesh shares)."""
    return os.cpu_count() or 1


def host_key() -> str:
    # the installed version from its metadata: importing JAX here cost the controller ~1 s
    # of CPU while its workers start (docs/performance.md, "Start-up and shutdown")
    from importlib.metadata import version

    return f"{socket.gethostname()}|cpus={host_cores()}|jax={version('jax')}|v{PROFILE_VERSION}"


def physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        import psutil

        return float(psutil.virtual_memory().total)


def _best_seconds(fn, *args, tries: int = TRIES) -> float:
    fn(*args).block_until_ready()            # compile and warm up
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_per_s(n: int, dtype: str = "bfloat16", accumulate: str = "float32",
                       tries: int = TRIES) -> float:
    """FLOP/s of one jitted n x n x n matmul (paper §2: 2 FLOPs per multiply-add), written as
    the engine writes its matmuls (`partitioning.matmul`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    fn = jax.jit(lambda p, q: jnp.einsum("ij,jk->ik", p, q, preferred_element_type=accumulate))
    return 2.0 * n**3 / _best_seconds(fn, a, b, tries=tries)


def matmul_rates(tries: int = TRIES) -> dict[str, float]:
    """{'bfloat16->float32 1024': FLOP/s, ...} for every shape in MATMULS."""
    return {f"{dtype}->{acc} {n}": matmul_flops_per_s(n, dtype, acc, tries) for n, dtype, acc in MATMULS}


def measure_memory_bandwidth(nbytes: int = REDUCE_BYTES) -> float:
    """Bytes read per second by a jitted reduction over a large array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    seconds = _best_seconds(jax.jit(jnp.sum), x)
    return nbytes / seconds


def measure_copy_bandwidth(nbytes: int = COPY_BYTES) -> tuple[float, str]:
    """Device-to-device copy bandwidth (bytes moved / s) and how it was measured."""
    import jax
    import jax.numpy as jnp

    devices = jax.devices()
    x = jnp.ones((nbytes // 4,), jnp.float32)
    if len(devices) >= 2:
        x = jax.device_put(x, devices[0]).block_until_ready()
        seconds = _best_seconds(lambda v: jax.device_put(v, devices[1]), x)
        return nbytes / seconds, "copy between two virtual devices"
    seconds = _best_seconds(jax.jit(lambda v: v + 1.0), x)
    return 2 * nbytes / seconds, "copy within one device (read + write)"


# --------------------------------------------------------------------------- one pinned core


def _core_main(core: int) -> None:
    """Child process entry: pin to `core` BEFORE JAX starts (XLA sizes and places its
    thread pool then), then matmul rates and read bandwidth on that core alone."""
    os.sched_setaffinity(0, {core})
    rates = matmul_rates()
    print(json.dumps({"rates": rates, "bandwidth": measure_memory_bandwidth(),
                      "cores": sorted(os.sched_getaffinity(0))}))


def measure_one_core(core: int | None = None) -> dict | None:
    """Rates measured by a fresh process pinned to one core (so XLA's thread pool runs on
    that core alone, whatever this process is pinned to). None if the child fails."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if core is None:
        core = allowed[-1] if allowed else 0
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        # No preexec_fn: forking a process that runs JAX's threads is unsafe; the child pins itself.
        done = subprocess.run([sys.executable, "-m", "workloads.hostprofile", "--one-core", str(core)],
                              env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if done.returncode != 0:
            return None
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- the profile


def measure() -> tuple[HardwareProfile, dict]:
    """Measure this host now (~3-5 s). Returns the profile and how it was measured."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    one_core = measure_one_core()
    rates = matmul_rates()
    here = max(rates.values())
    cores = host_cores()
    scaled = max(one_core["rates"].values()) * cores if one_core else 0.0
    peak = max(here, scaled)
    bandwidth = max(measure_memory_bandwidth(), one_core["bandwidth"] if one_core else 0.0)
    ici, ici_how = measure_copy_bandwidth()
    profile = HardwareProfile(name="host", peak_flops=peak, hbm_bandwidth=bandwidth,
                              hbm_bytes=physical_memory_bytes(), ici_bandwidth=ici, measured=True)
    notes = {
        "peak_flops_measured_as": (
            f"max of: best of {TRIES} jitted matmuls {', '.join(rates)} in this process "
            f"({len(os.sched_getaffinity(0))} cores usable); the same on one pinned core x {cores} cores"),
        "peak_flops_in_process": here,
        "peak_flops_one_core": max(one_core["rates"].values()) if one_core else None,
        "peak_flops_cores_x_one_core": scaled or None,
        "peak_flops_from": "cores x one core" if scaled > here else "in process",
        "matmul_rates_in_process": rates,
        "matmul_rates_one_core": one_core["rates"] if one_core else None,
        "hbm_bandwidth_measured_as": (f"jitted sum over {REDUCE_BYTES // 2**20} MiB f32 (bytes read), "
                                      "best of this process and one pinned core"),
        "ici_measured_as": ici_how,
        "hbm_bytes_is": "physical memory of the host",
        "load_average_1min": round(load_before, 2),
        "measure_s": round(time.perf_counter() - start, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "version": PROFILE_VERSION,
    }
    return profile, notes


def _read_cache(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return {}              # a corrupt cache is re-measured, not fatal
    return data if isinstance(data, dict) else {}


def cached_entry(path: Path | None = None) -> dict | None:
    """This host's cached entry ({profile: ..., notes: ...}) or None."""
    entry = _read_cache(path or cache_path()).get(host_key())
    return entry if isinstance(entry, dict) and "profile" in entry else None


_warned: set[str] = set()
BUSY_LOAD_PER_CORE = 3.0    # a cache measured above this 1-minute load per core is flagged


def _warn_if_measured_busy(entry: dict, path: Path) -> None:
    """One line (once per process and cache) when the cached profile was measured while the
    host was far busier than its cores (BUSY_LOAD_PER_CORE): its rates are then low, and
    every prediction and fit that starts from it inherits them (a cache measured at load 24
    on 2 cores capped a fit's bandwidth at a third of the quiet host's, docs/calibration.md)."""
    load = (entry.get("notes") or {}).get("load_average_1min")
    if isinstance(load, (int, float)) and load > BUSY_LOAD_PER_CORE * host_cores() \
            and str(path) not in _warned:
        _warned.add(str(path))
        print(f"sweeper: warning: the host profile in {path} was measured at load {load:g} "
              f"on {host_cores()} cores, so its rates may be low; `sweeper host-profile "
              "--refresh` measures it again (on a quiet host)", file=sys.stderr)


# --------------------------------------------------------------------------- calibrated


def calibration_path() -> Path:
    """Where `sweeper calibrate` writes this host's calibrated profile (docs/host-calibration.md)."""
    return sweeper_home() / "calibration" / "host.yaml"


def calibrated_profile(path: Path | None = None) -> HardwareProfile | None:
    """The calibrated profile of THIS host (its `calibration.host_key` is this host's key),
    or None: none written, unreadable, or written on another host or by another version
    (a constant fitted on one host is never applied to another)."""
    path = path or calibration_path()
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text()) or {}
        profile = HardwareProfile.from_dict(data, str(path))
    except (yaml.YAMLError, OSError, ValueError):
        return None
    return profile if profile.calibration.get("host_key") == host_key() else None


def host_profile(refresh: bool = False, path: Path | None = None,
                 calibrated: bool = True) -> HardwareProfile:
    """This host's profile: its calibrated profile when `sweeper calibrate` has written one
    for it (and `calibrated`), else the measured peaks (from the cache, or measured now)."""
    if calibrated and not refresh and path is None:
        found = calibrated_profile()
        if found is not None:
            return found
    path = path or cache_path()
    if not refresh:
        entry = cached_entry(path)
        if entry is not None:
            _warn_if_measured_busy(entry, path)
            return HardwareProfile.from_dict(entry["profile"])
    profile, notes = measure()
    data = _read_cache(path)
    data[host_key()] = {"profile": profile.to_dict(), "notes": notes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)           # atomic: concurrent workers never read half a file
    return profile


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one-core"]:
        _core_main(int(sys.argv[2]))
    else:
        print(yaml.safe_dump(dict(zip(("profile", "notes"), (lambda p, n: (p.to_dict(), n))(*measure()))),
                             sort_keys=False))
