"""Dispatch that keeps workers, and the compilation cache shared by a sweep's workers
(issue 22 items 1-2). Real JAX in subprocesses (the persistent cache is process-wide
configuration), a real local Ray, real Optuna and MLflow stores; no timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from requires import require
from sweeper.sweep import compile_cache
from sweeper.sweep.meshworker import EngineCache
from sweeper.sweep.pool import replicate_key
from sweeper.spec.space import load_space

ROOT = Path(__file__).resolve().parents[1]

COMPILE = """
import json, sys
from sweeper.sweep import compile_cache
compile_cache.enable(sys.argv[1])
counter = compile_cache.CacheCounter.install()
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0).lower(jnp.ones((16, 16))).compile()
stats = counter.snapshot()
print(json.dumps({"requests": stats.requests, "hits": stats.hits, "compiled": stats.compiled}))
"""


def _compile_in_fresh_process(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", COMPILE, str(folder)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    first = _compile_in_fresh_process(tmp_path)
    assert first["requests"] >= 1 and first["hits"] == 0 and first["compiled"] >= 1
    assert any(tmp_path.iterdir())                              # entries written
    second = _compile_in_fresh_process(tmp_path)
    assert second["requests"] == first["requests"]
    assert second["hits"] == second["requests"] and second["compiled"] == 0


def test_the_cache_folder_is_named_by_jax_versions_and_the_engine_source(tmp_path, monkeypatch):
    folder = compile_cache.cache_dir(tmp_path)
    assert folder.parent == tmp_path / "compile-cache" and folder.is_dir()
    from importlib import metadata

    assert folder.name.startswith(f"jax-{metadata.version('jax')}-jaxlib-"
                                  f"{metadata.version('jaxlib')}-")
    # a folder of other code, untouched for longer than STALE_DAYS, goes; a recent one stays
    old, recent = folder.parent / "jax-0-jaxlib-0-000000000000", folder.parent / "jax-1-x"
    old.mkdir()
    recent.mkdir()
    os.utime(old, (1, 1))
    assert compile_cache.cache_dir(tmp_path) == folder
    assert not old.exists() and recent.exists()
    monkeypatch.setenv(compile_cache.DISABLE_ENV, "1")
    assert compile_cache.cache_dir(tmp_path) is None


def test_engine_cache_keeps_the_most_recently_used_shapes():
    cache = EngineCache(capacity=2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1                                   # a is now the most recent
    cache["c"] = 3
    assert list(cache) == ["a", "c"]


def test_replicates_share_a_key_other_configurations_do_not():
    space = load_space(str(ROOT / "benchmarks" / "data" / "interleaved-grid.yaml"))
    point = {"chips": 2, "batch": 4, "decode_ffn": "ws1d"}
    seed0 = space.trial_config({**point, "seed": 0})
    seed1 = space.trial_config({**point, "seed": 1})
    other = space.trial_config({**point, "seed": 0, "decode_ffn": "ws2d"})
    assert replicate_key(seed0) == replicate_key(seed1) != replicate_key(other)


@pytest.mark.ci_slow
def test_an_interleaved_grid_starts_one_worker_per_slot_and_chip_count(
        session_sweeper_home, tmp_path, monkeypatch):
    """Chips 1 and 2 interleaved by the grid sampler, 2 slots: at most 4 worker processes
    (before issue 22 a slot started a process whenever the chip count changed); the
    second process of a chip count loads programs the first compiled."""
    require(len(os.sched_getaffinity(0)) >= 2, "needs two CPU cores")
    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    from sweeper.sweep.controller import run_sweep

    space = load_space({
        "name": "dispatch", "model": "tiny", "hardware": "host", "input_len": 8,
        "decode_steps": 2, "repeats": 2, "warmup": 0, "time_budget_s": 0.1, "batch": 4,
        "params": {"chips": [1, 2], "decode_ffn": ["ws1d", "ws2d"], "seed": [0, 1]},
        "objectives": [{"metric": "decode_step_s", "direction": "minimize"}],
        "sampler": {"type": "grid", "seed": 0}, "trials": 8, "parallel": 2,
        "timeout_s": 300, "memory_budget_bytes": "1GiB"})
    result = run_sweep(space, storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", progress=False)
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    trials = study.trials
    assert result.counts["complete"] == 8, [t.user_attrs.get("reason") for t in trials]
    workers = [t.user_attrs["worker"] for t in trials]
    by_key = {}
    for t, w in zip(trials, workers):
        by_key.setdefault((w["slot"], t.params["chips"]), set()).add(w["pid"])
    assert all(len(pids) == 1 for pids in by_key.values()), by_key     # no process restarted
    assert len({w["pid"] for w in workers}) <= 4
    measured = [t.user_attrs["measurement"] for t in trials]
    assert all(m["programs_compiled"] >= 0 and m["programs_from_cache"] >= 0 for m in measured)
    assert sum(m["programs_from_cache"] for m in measured) > 0         # shared across processes
    assert all(w["reused"] == (w["cache_hit"] or m["programs_compiled"] == 0)
               for w, m in zip(workers, measured))
    assert (compile_cache.cache_dir(Path(session_sweeper_home), prune=False)).is_dir()


# ------------------------------------------------------------------ start-up and shutdown
# (issue 22 item 3, docs/performance.md "Start-up and shutdown")

def test_the_controller_imports_no_pandas_before_its_trials():
    """pandas (~1 s) is imported when the result is built, not with the controller."""
    code = ("import sys, sweeper.sweep.controller, sweeper.sweep.workers; "
            "print(sorted(m for m in ('pandas', 'scipy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_after_trials_runs_off_the_main_thread_once_every_trial_is_recorded(
        tmp_path, sweeper_home):
    """The hook `sweeper run` imports its analysis with runs while the sweep shuts down:
    in another thread, after the last trial was recorded; the result is still complete."""
    import threading

    from sweeper.sweep.controller import run_sweep

    recorded, seen, called = [], [], threading.Event()

    def after_trials():
        seen.append((threading.current_thread() is threading.main_thread(), len(recorded)))
        called.set()

    space = load_space({
        "name": "hook", "model": "tiny", "hardware": "analytical:tpu-v4", "input_len": 8,
        "decode_steps": 2, "params": {"batch": [1, 2, 4, 8], "chips": [1, 2]},
        "objectives": [{"metric": "decode_step_s", "direction": "minimize"},
                       {"metric": "decode_cost_chip_s_per_token", "direction": "minimize"}],
        "sampler": {"type": "grid", "seed": 0}, "trials": 6, "parallel": 2})
    result = run_sweep(space, storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", progress=False,
                       on_trial=recorded.append, after_trials=after_trials)
    assert called.wait(60)
    assert seen == [(False, 6)]
    assert sum(result.counts.values()) == 6 and result.pareto      # pandas imported for it


def test_a_worker_refuses_a_device_count_once_jax_has_started():
    """JAX reads XLA_FLAGS once: a process that imported it cannot take another count."""
    import jax  # noqa: F401 - lazy: this test needs JAX started in this process

    from sweeper.sweep.workers import PooledMeshWorker

    before = dict(os.environ)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=3"
    with pytest.raises(RuntimeError, match="imported JAX before its XLA_FLAGS were set"):
        PooledMeshWorker({"XLA_FLAGS": flags.strip()}, 0, 3, None)
    assert dict(os.environ) == before


def test_workers_take_the_processes_ray_started_idle(tmp_path):
    """An actor with no runtime_env of its own runs in a worker process Ray started idle
    with the cluster (past its `import ray`), and gets its device count all the same."""
    import time

    from sweeper.sweep.session import RaySession
    from sweeper.sweep.workers import RayPool

    session = RaySession(None)
    session.start()
    try:
        idle: set[int] = set()
        deadline = time.monotonic() + 60
        while not idle and time.monotonic() < deadline:
            idle = {p.pid for p in session.processes() if p.name() == "ray::IDLE"}
            time.sleep(0.2)
        require(bool(idle), "Ray started no idle worker process on this host")
        pool = RayPool("host", 1, env={"SWEEPER_HOME": str(tmp_path)})
        pool.prestart(0, 2)
        info = pool.workers()
        assert len(info) == 1 and info[0]["pid"] in idle, (info, idle)
        assert info[0]["devices"] == 2        # what JAX saw in that process
        pool.close()
    finally:
        session.close()


def test_an_emulated_worker_runs_on_at_most_one_core_per_device():
    """A mesh worker (sweep) and a serving worker keep their slot's share of the host but
    are pinned to at most one core per emulated device (meshworker.device_cores): the host
    model prices a device's work on one core (workloads/hostmodel.py `throughput_ratio`).
    Real affinity of this process, restored after."""
    from sweeper.serving.server import worker_cores
    from sweeper.sweep.meshworker import MeshWorker

    cores = sorted(os.sched_getaffinity(0))
    require(len(cores) >= 2, "needs two CPU cores")

    def pinned(*args, **kwargs) -> list[int]:
        try:
            return MeshWorker(*args, **kwargs).cores
        finally:
            os.sched_setaffinity(0, cores)

    assert pinned(0, 1, cores) == cores[:1]                  # one device: one core
    assert pinned(0, 2, cores) == cores[:2]
    assert pinned(0, 4, cores[:1]) == cores[:1]              # oversubscribed: its slot's
    assert pinned(0, 4, cores, hosts=4) == cores[:1]         # one device on each host
    # serving: one worker of one device owns the whole host but runs on one core; two own
    # half each; `cores_per_worker` groups of that many, each still one core per device
    assert worker_cores([1]) == ([cores[:1]], 1.0)
    assert worker_cores([len(cores)]) == ([cores], 1.0)
    groups, share = worker_cores([1, 1])
    assert share == pytest.approx(0.5, abs=0.5 / len(cores))       # half each, to a core
    assert len(groups) == 2 and all(len(g) == 1 for g in groups) and groups[0] != groups[1]
    groups, share = worker_cores([2], cores_per_worker=1)
    assert groups == [cores[:1]] and share == pytest.approx(1 / len(cores))
