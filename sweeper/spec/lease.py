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

Checking the attr and then writing it is not atomic: two `--resume` started together both
saw a free study. On a SQLite storage the claim is therefore first an exclusive, non-blocking
`flock` on `<optuna.db>.<study>.lease`, taken before Ray starts and held until the
controller ends (the OS drops it when the process dies, kill -9 included); the second
controller is refused there. A database server has no such file: the attr check is all.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import Any, Mapping

import psutil

from sweeper import paths
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


def lock(storage: str, study_name: str) -> int | None:
    """Hold the study's lock file (SQLite storage): a file descriptor to pass to `unlock`, or
    None for a database server. ConfigError when another live process holds it."""
    db = paths.sqlite_path(storage)
    if db is None or str(db) in ("", ":memory:"):
        return None
    db.parent.mkdir(parents=True, exist_ok=True)
    path = db.with_name(f"{db.name}.{study_name}.lease")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        who = path.read_text(errors="replace")[:200].strip() or "another `sweeper run`"
        raise ConfigError("--resume", study_name, f"a study that no running controller holds "
                          f"({who} is running it now; wait for it to end or stop it "
                          "first)") from None
    os.ftruncate(fd, 0)            # who holds it, for the message above
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)        # closing the descriptor releases the flock
