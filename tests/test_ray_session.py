"""The sweep's Ray session (sweeper/sweep/session.py) against a real local Ray.

- `ray.init` still goes through the private name sweeper patches
  (`ray._private.utils.set_sigterm_handler`), so the caller's SIGTERM handler survives it;
  a Ray without one of the patched names is refused in one line naming the supported range.
- Ray's failure-handler switch is set only for the driver's connect: the worker processes
  keep their crash stacks (no RAY_DISABLE_FAILURE_SIGNAL_HANDLER in their environment).
- A local cluster listens on the loopback only (issue 23, item 9).
- Closing kills the head's helper processes first and leaves the raylet and the GCS server
  to `ray.shutdown()` (issue 22, item 3: the quickstart's shutdown).
- Shutdown is bounded (issue 23, item 2): with the raylet SIGSTOPped, `sweeper run` still
  exits, and no Ray process it started is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}

SESSION_SCRIPT = r"""
import json, os, signal, sys
import psutil

def callers_handler(signum, frame):
    pass

signal.signal(signal.SIGTERM, callers_handler)
from sweeper.sweep import session as ray_session
import ray
import ray._private.ray_constants as constants

flag_before = constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
session = ray_session.RaySession(None)
session.start()

@ray.remote
def worker_side():
    import ray._private.ray_constants as constants
    return {"env": os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
            "handler_off": constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER}

worker = ray.get(worker_side.remote())
procs = session.processes()
listening = []
for proc in procs + [psutil.Process()]:
    try:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append([proc.name(), conn.laddr.ip, conn.laddr.port])
    except psutil.Error:
        pass
handler = signal.getsignal(signal.SIGTERM)
report = {
    "held_back": len(ray_session.held_back),
    "held_back_callable": all(callable(h) for h in ray_session.held_back),
    "handler_kept": handler is callers_handler,
    "flag_restored": constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER == flag_before,
    "driver_env": os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
    "loopback_env": os.environ.get(ray_session.LOOPBACK_ENV),
    "worker": worker,
    "processes": sorted(p.name() for p in procs),
    "listening": listening,
}
# the head's helpers go first (close does this too); the servers and the cluster's work stay
report["helpers_killed"] = len(ray_session.stop_head_helpers(session.owned))
report["servers_alive"] = sorted(p.name() for p in procs if p.is_running()
                                 and p.status() != psutil.STATUS_ZOMBIE
                                 and p.name() in ray_session.RAY_SERVERS)
report["runs_after_helpers"] = ray.get(worker_side.remote()) == worker
report["closed"] = session.close()
report["left"] = [[p.pid, p.name()] for p in procs
                  if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
print(json.dumps(report))
"""


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER",
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    return {**env, **more}


def test_a_ray_without_a_patched_name_is_refused_in_one_line(monkeypatch):
    import ray._private.utils as ray_utils

    from sweeper.sweep import session
    from workloads.config import ConfigError

    session.check_ray_version()          # the installed Ray has every name
    monkeypatch.delattr(ray_utils, "set_sigterm_handler")
    with pytest.raises(ConfigError) as info:
        session.check_ray_version()
    line = str(info.value)
    assert "\n" not in line and session.SUPPORTED_RAY in line and "set_sigterm_handler" in line


def test_the_supported_ray_range_is_the_one_pyproject_installs():
    """The range session.py names when it refuses a Ray is the one pip enforces."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    import ray

    from sweeper.sweep import session

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = [Requirement(d).specifier for d in deps if Requirement(d).name == "ray"]
    assert specs == [SpecifierSet(session.SUPPORTED_RAY)], specs
    assert ray.__version__ in specs[0]


def test_ray_init_goes_through_the_patched_name_and_a_local_cluster_listens_on_loopback_only(
        tmp_path):
    """One real local Ray, started as `sweeper run` starts it (~10-20 s)."""
    proc = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # ray.init called the patched name (the no-op that keeps its sys.exit(15) handler out)
    assert report["held_back"] >= 1 and report["held_back_callable"], report
    assert report["handler_kept"], report
    # the failure-handler switch: the driver's connect only, never the environment
    assert report["flag_restored"] and report["driver_env"] is None, report
    assert report["worker"] == {"env": None, "handler_off": False}, report
    assert report["loopback_env"] is None, report
    # the cluster's servers (GCS, raylet, agents, workers, the driver) on the loopback only
    assert {"gcs_server", "raylet"} <= set(report["processes"]), report
    names = {name for name, _, _ in report["listening"]}
    assert {"gcs_server", "raylet"} <= names, report["listening"]
    outside = [entry for entry in report["listening"] if entry[1] not in LOOPBACK]
    assert not outside, outside
    # close's first step (the autoscaler monitor, log monitor, dashboard head: Ray stops them
    # one at a time, up to 1 s each) leaves the raylet, the GCS server and their work running
    assert report["helpers_killed"] >= 1, report
    assert report["servers_alive"] == ["gcs_server", "raylet"], report
    assert report["runs_after_helpers"], report
    assert report["closed"] and report["left"] == [], report


def _trial_worker_pid(home: Path, study: str) -> int | None:
    import optuna

    from sweeper.paths import open_optuna_storage

    db = home / "optuna.db"
    if not db.exists():
        return None
    try:
        study_obj = optuna.load_study(study_name=study,
                                      storage=open_optuna_storage(f"sqlite:///{db}"))
        trials = study_obj.get_trials(deepcopy=False)
    except Exception:  # noqa: BLE001 - the sweep has not created its study yet
        return None
    for trial in trials:
        pid = (trial.user_attrs.get("worker") or {}).get("pid")
        if pid:
            return int(pid)
    return None


# slow: a Ray start-up, a trial reaching its worker, node-loss detection, then the
# 30 s shutdown wait (~70 s alone)
@pytest.mark.slow
@pytest.mark.ci_slow
def test_a_stopped_raylet_never_keeps_the_sweep_alive_nor_leaves_ray_processes(tmp_path):
    home = tmp_path / "home"
    space = tmp_path / "stop.yaml"
    space.write_text(yaml.safe_dump({
        "name": "stop", "model": "tiny", "hardware": "devices", "chips": 1, "batch": 2,
        "input_len": 8, "decode_steps": 2, "repeats": 1, "warmup": 0, "timeout_s": 600,
        "parallel": 1, "params": {"decode_ffn": ["ws1d", "ws2d"]},
        "sampler": {"type": "random", "seed": 0}}))
    # The trial waits 120 s on its worker; Ray's control store declares the stopped node
    # dead after ~3 missed 1 s health checks instead of its default ~60 s.
    env = clean_env(SWEEPER_HOME=str(home), SWEEPER_TEST_TRIAL_DELAY_S="120",
                    RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
                    RAY_health_check_failure_threshold="3")
    err = open(tmp_path / "stop.err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "sweeper.cli", "run", str(space), "--study",
                             "stop", "--trials", "2", "--no-analysis"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=err, text=True)
    ray_procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while _trial_worker_pid(home, "stop") is None:
            assert proc.poll() is None, open(tmp_path / "stop.err").read()[-3000:]
            assert time.monotonic() < deadline, "no trial reached its worker"
            time.sleep(0.5)
        ray_procs = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        raylets = [p for p in ray_procs if p.name() == "raylet"]
        assert len(raylets) == 1, ray_procs
        raylets[0].suspend()                               # SIGSTOP
        proc.wait(timeout=240)      # (it never exited before: Ray's atexit shutdown hung)
        left = [(p.pid, p.name()) for p in ray_procs if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in ray_procs:         # whatever happens, leave nothing stopped or running
            try:
                p.kill()
            except psutil.Error:
                pass
    err.seek(0)
    stderr = err.read()
    assert proc.returncode == 3, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "did not shut down within" in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(
        "sweeper run: error: the Ray node running the sweep was lost"), stderr[-3000:]
    assert not left, left


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
