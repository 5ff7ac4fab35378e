"""Which controller is running a study: a lease in the study's user attrs.

    study.user_attrs["controller"] = {"host", "pid", "started", "heartbeat", "status"}

`sweeper run` claims the lease when it opens a study, refreshes `heartbeat` every
HEARTBEAT_S seconds and writes its final `status` (finished, failed, killed) when it ends.
A second `sweeper run --resume` (or `sweeper sync`) of a study whose lease is live is
refused: it would mark the running controller's in-flight trials as interrupted and log
their MLflow runs twice. A lease is live while its process exists (same host: checked by
pid and process start time, so a reused pid does not count) or, for a controller on
another host, while its heartbeat is recent. A controller killed with `kill -9` leaves
`status: running` behind; its pid is gone, so the lease is free again.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Mapping

import psutil

from workloads.config import ConfigError

LEASE_ATTR = "controller"
HEARTBEAT_S = 30.0
RUNNING = "running"


def new_lease() -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now,
            "status": RUNNING}


def holder(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The live lease in a study's user attrs, or None when no other controller runs it."""
    lease = attrs.get(LEASE_ATTR)
    if not isinstance(lease, Mapping) or lease.get("status") != RUNNING:
        return None
    if lease.get("host") == socket.gethostname():
        if lease.get("pid") == os.getpid():
            return None                      # this process (a library caller running sweeps)
        return dict(lease) if _process_alive(lease.get("pid"), lease.get("started")) else None
    age = time.time() - float(lease.get("heartbeat") or 0)
    return dict(lease) if age < 3 * HEARTBEAT_S else None


def _process_alive(pid: Any, started: Any) -> bool:
    try:
        process = psutil.Process(int(pid))
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # a pid reused by a process started after the lease is not the controller
        return started is None or process.create_time() <= float(started) + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, ValueError):
        return False


def check_free(attrs: Mapping[str, Any], study_name: str, field: str) -> None:
    """ConfigError if another live controller holds the study."""
    lease = holder(attrs)
    if lease is None:
        return
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(lease.get("started") or 0)))
    raise ConfigError(field, study_name, f"a study that no running controller holds (pid "
                      f"{lease.get('pid')} on {lease.get('host')} has been running it since "
                      f"{since}; wait for it to end or stop it first)")


def claim(study) -> dict[str, Any]:
    lease = new_lease()
    study.set_user_attr(LEASE_ATTR, lease)
    return lease


def heartbeat(study, lease: dict[str, Any]) -> None:
    lease["heartbeat"] = time.time()
    study.set_user_attr(LEASE_ATTR, lease)


def release(study, lease: dict[str, Any], status: str) -> None:
    lease.update(status=status, heartbeat=time.time(), ended=time.time())
    study.set_user_attr(LEASE_ATTR, lease)
