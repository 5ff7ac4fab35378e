"""A persistent XLA compilation cache shared by every worker of a sweep (issue 22 item 2).

    folder = cache_dir()                 # controller: $SWEEPER_HOME/compile-cache/<key>
    enable(folder)                       # worker, before its first compile
    counter = CacheCounter.install()     # worker: JAX's cache events, counted
    before = counter.snapshot(); ...compile...; counter.since(before)  # -> CacheStats

A worker process keeps its compiled programs in memory (`workloads.measure`'s engine
cache), but a sweep starts one process per slot and device count, and a new process
compiled every program again. JAX's persistent compilation cache writes each compiled
executable to disk; another process compiling the same program (same HLO, devices,
compile options, XLA flags, jaxlib) loads it instead. Every worker of every study on this
machine shares one folder per key.

The key: JAX's own cache key already covers the HLO and the jaxlib version; the folder is
named by the jax and jaxlib versions and a hash of the `workloads` package's source as
well, so a change of the engine's code or of JAX never meets an entry an older one wrote,
whatever JAX's key covers. Folders of other keys untouched for STALE_DAYS are removed when
a sweep starts (the cache only grows otherwise).

Per trial the worker records `programs_compiled` (compile requests the cache could not
serve: XLA compiled them) and `programs_from_cache` (programs loaded from the folder) in
the trial's Measurement; a trial that found its programs in the worker's engine cache
asks for none.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from sweeper import paths

CACHE_DIR_ENV = "SWEEPER_COMPILE_CACHE_DIR"   # set for the workers by the pool; "" = off
DISABLE_ENV = "SWEEPER_NO_COMPILE_CACHE"      # "1": no persistent cache (benchmarks compare)
STALE_DAYS = 14

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def code_key() -> str:
    """'jax-X-jaxlib-Y-<12 hex of the workloads sources>' (no JAX import)."""
    import workloads

    digest = hashlib.sha256()
    for path in sorted(Path(workloads.__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    versions = []
    for dist in ("jax", "jaxlib"):
        try:
            versions.append(f"{dist}-{metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist}-none")
    return "-".join(versions) + "-" + digest.hexdigest()[:12]


def cache_dir(home: Path | None = None, prune: bool = True) -> Path | None:
    """This code's cache folder under $SWEEPER_HOME/compile-cache (created), or None when
    the cache is turned off (SWEEPER_NO_COMPILE_CACHE=1)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    root = (home or paths.sweeper_home(create=True)) / "compile-cache"
    folder = root / code_key()
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder)                      # in use: not stale
    if prune:
        cutoff = time.time() - STALE_DAYS * 86400
        for other in root.iterdir():
            try:
                if other != folder and other.is_dir() and other.stat().st_mtime < cutoff:
                    shutil.rmtree(other, ignore_errors=True)
            except OSError:
                pass                      # another sweep removed it first
    return folder


def enable(folder: str | os.PathLike | None) -> bool:
    """Point this process's JAX at `folder`, caching every program (however small or quick
    to compile: the tiny models compile in well under JAX's 1 s default threshold)."""
    if not folder:
        return False
    import jax   # lazy: only in a worker process, which runs trials with JAX anyway

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True


@dataclass
class CacheStats:
    requests: int = 0          # compiles that asked the persistent cache
    hits: int = 0              # ... and were served from it
    saved_s: float = 0.0       # compile time the hits saved (JAX's estimate)

    @property
    def compiled(self) -> int:
        return self.requests - self.hits


class CacheCounter:
    """Counts JAX's persistent-cache events in this process (one listener per process)."""

    _installed: "CacheCounter | None" = None

    def __init__(self):
        self._lock = threading.Lock()
        self.total = CacheStats()

    @classmethod
    def install(cls) -> "CacheCounter":
        if cls._installed is None:
            from jax import monitoring   # lazy: only in a worker process

            counter = cls()
            monitoring.register_event_listener(counter._event)
            monitoring.register_event_duration_secs_listener(counter._duration)
            cls._installed = counter
        return cls._installed

    def _event(self, event: str, **_: object) -> None:
        with self._lock:
            if event == _REQUESTS:
                self.total.requests += 1
            elif event == _HITS:
                self.total.hits += 1

    def _duration(self, event: str, duration: float, **_: object) -> None:
        if event == _SAVED:
            with self._lock:
                self.total.saved_s += max(0.0, duration)

    def snapshot(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.total.requests, self.total.hits, self.total.saved_s)

    def since(self, before: CacheStats) -> CacheStats:
        now = self.snapshot()
        return CacheStats(now.requests - before.requests, now.hits - before.hits,
                          now.saved_s - before.saved_s)
