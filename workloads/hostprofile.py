"""The `host` hardware profile: this machine's peak numbers, measured once and cached.

An emulated mesh (n virtual XLA CPU devices, DESIGN.md "Emulated mesh") runs on this
host's cores, so its MFU must be a fraction of *this host's* measured peak, never a
TPU's. `host_profile()` measures (a few seconds, once per host):

- peak_flops: best of a few large jitted bf16 matmuls (2·n³ FLOPs each);
- hbm_bandwidth: a jitted sum over a 256 MiB f32 array (bytes read / second: the
  memory roofline of decode is reads of weights and KV cache);
- ici_bandwidth: a copy of a 64 MiB array between two virtual devices when this process
  has at least two, else a jitted copy on one device (read + write bytes / second); the
  cache records which as `ici_measured_as`. Either way it is host memory traffic;
- hbm_bytes: physical memory.

The result is cached as YAML in `$SWEEPER_HOME/host_profile.yaml` (default
`./.sweeper/host_profile.yaml`), keyed by hostname + CPU count + jax version, so a
second call (or another process on the same host) does not measure again.
`per_chip(profile, n)` splits the whole host evenly over n virtual chips.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import yaml

from workloads.config import HardwareProfile

MATMUL_N = 2048
REDUCE_BYTES = 256 * 2**20
COPY_BYTES = 64 * 2**20
TRIES = 3


def sweeper_home() -> Path:
    """`$SWEEPER_HOME`, else `./.sweeper` (as sweeper/paths.py; workloads does not import sweeper)."""
    return Path(os.environ.get("SWEEPER_HOME") or ".sweeper").expanduser().resolve()


def cache_path() -> Path:
    return sweeper_home() / "host_profile.yaml"


def host_key() -> str:
    import jax

    return f"{socket.gethostname()}|cpus={os.cpu_count()}|jax={jax.__version__}"


def physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        import psutil

        return float(psutil.virtual_memory().total)


def _best_seconds(fn, *args) -> float:
    fn(*args).block_until_ready()            # compile and warm up
    best = float("inf")
    for _ in range(TRIES):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peak_flops(n: int = MATMUL_N) -> float:
    """bf16 matmul FLOP/s of this host (paper §2: 2 FLOPs per multiply-add)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds = _best_seconds(jax.jit(lambda p, q: p @ q), a, b)
    return 2.0 * n**3 / seconds


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


def measure() -> tuple[HardwareProfile, dict]:
    """Measure this host now (a few seconds). Returns the profile and how it was measured."""
    start = time.perf_counter()
    peak = measure_peak_flops()
    bandwidth = measure_memory_bandwidth()
    ici, ici_how = measure_copy_bandwidth()
    profile = HardwareProfile(name="host", peak_flops=peak, hbm_bandwidth=bandwidth,
                              hbm_bytes=physical_memory_bytes(), ici_bandwidth=ici, measured=True)
    notes = {
        "peak_flops_measured_as": f"best of {TRIES} jitted bf16 matmuls {MATMUL_N}x{MATMUL_N}",
        "hbm_bandwidth_measured_as": f"jitted sum over {REDUCE_BYTES // 2**20} MiB f32 (bytes read)",
        "ici_measured_as": ici_how,
        "hbm_bytes_is": "physical memory of the host",
        "measure_s": round(time.perf_counter() - start, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
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


def host_profile(refresh: bool = False, path: Path | None = None) -> HardwareProfile:
    """This host's measured profile: from the cache, or measured now and cached."""
    path = path or cache_path()
    if not refresh:
        entry = cached_entry(path)
        if entry is not None:
            return HardwareProfile.from_dict(entry["profile"])
    profile, notes = measure()
    data = _read_cache(path)
    data[host_key()] = {"profile": profile.to_dict(), "notes": notes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)           # atomic: concurrent workers never read half a file
    return profile


def per_chip(profile: HardwareProfile, n: int) -> HardwareProfile:
    """One of n virtual chips sharing this host: every peak number split evenly."""
    if n <= 1:
        return profile
    return dataclasses.replace(profile, peak_flops=profile.peak_flops / n,
                               hbm_bandwidth=profile.hbm_bandwidth / n,
                               hbm_bytes=profile.hbm_bytes / n,
                               ici_bandwidth=profile.ici_bandwidth / n)
