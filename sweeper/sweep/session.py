"""The sweep's Ray session: started (or joined), signals held while Ray starts, and a
shutdown that is bounded whatever Ray does.

    session = RaySession(address)     # address None: a new local cluster on 127.0.0.1
    session.start()                   # ConfigError / ClusterLost: nothing was created
    ...
    session.close()                   # returns within SHUTDOWN_WAIT_S + KILL_WAIT_S

A local cluster (no `--address`, no RAY_ADDRESS) listens on the loopback only: a
single-machine sweep needs no other interface. Its processes (GCS, raylet, dashboard and
runtime-env agents, workers) are this process's descendants; `close` kills the head's
helper processes (`stop_head_helpers`), calls `ray.shutdown()` (the raylet and the GCS
server) and, if it has not returned within SHUTDOWN_WAIT_S (a stopped raylet, a control store that
stopped answering), kills every one of them still alive and takes Ray's own `atexit`
shutdown off the exit path (it would wait forever on the lock the stuck shutdown holds).
The command line then exits without finalizing the interpreter around Ray's stuck threads
(`exit_without_finalizing_if_abandoned`, called by sweeper.cli.main); an exit that still
hangs is ended by SIGALRM EXIT_ALARM_S later.
On a cluster (`--address`) the sweep owns no Ray process: `close` only disconnects.

Three private names of Ray are used, checked before `ray.init` (a ConfigError naming
SUPPORTED_RAY when one is missing, never a silent fallback):

- `ray._private.utils.set_sigterm_handler`: `ray.init` installs `sys.exit(15)` for SIGTERM
  through it; while Ray starts it is replaced by a no-op so the CLI's handler stays
  (`signals_deferred`).
- `ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER`: read by the driver's core
  worker when it connects; set only around that connect (Ray's C++ failure handler turned a
  SIGTERM during start-up into a stack dump and abort). Not set in the environment, so the
  Ray processes keep their crash stacks.
- `ray._private.ray_constants.ENABLE_RAY_CLUSTER`: False makes Ray use the loopback as the
  node address (what it does on macOS and Windows), so every server binds 127.0.0.1; set in
  the environment of the processes `ray.init` starts too (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`).
- `ray._private.worker.print_to_stdstream`: the driver's error listener prints the raylet's
  messages with it, on stdout (a lost worker: "(raylet) A worker died or was killed ...",
  a paragraph that broke `--json` and the one-line rule); they are kept in
  `raylet_messages` instead (`quiet_raylet_messages`): the sweep and `sweeper serve` say in
  one line which worker was lost and why.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from sweeper.formatting import one_line
from sweeper.sweep.pool import ClusterLost
from workloads.config import ConfigError

SUPPORTED_RAY = ">=2.40,<2.61"    # the range the private names above are known in (pyproject)
SHUTDOWN_WAIT_S = 30.0     # at most this long for ray.shutdown() when a sweep ends
KILL_WAIT_S = 5.0          # then this long for the killed processes to go
EXIT_ALARM_S = 20          # an interpreter exit still running this long after is ended
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # Ray's switch for ENABLE_RAY_CLUSTER
# The handlers ray.init tried to install through set_sigterm_handler and was kept from
# (tests/test_ray_session.py checks that ray.init still goes through that name).
held_back: list = []
PRIVATE_NAMES = (("ray._private.utils", "set_sigterm_handler"),
                 ("ray._private.ray_constants", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
                 ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
                 ("ray._private.worker", "print_to_stdstream"))
# The raylet's messages to the driver (a worker died, ...), newest last, at most RAYLET_KEPT;
# not printed (`quiet_raylet_messages`).
raylet_messages: list[str] = []
RAYLET_KEPT = 20


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an address nothing listens on (ray.init would retry for minutes)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--address", address, "HOST:PORT of a Ray cluster's head (e.g. "
                          "10.0.0.1:6379), ray://HOST:10001 or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ConfigError("--address", address, f"the address of a running Ray cluster head "
                          f"(nothing answers there: {err.strerror or err})") from None


def ray_private(module: str, name: str) -> Any:
    """The module holding private name `name` of Ray; ConfigError when this Ray lacks it."""
    import importlib

    import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

    try:
        holder = importlib.import_module(module)
    except ImportError:
        holder = None
    if holder is None or not hasattr(holder, name):
        raise ConfigError("ray", ray.__version__, f"a Ray version in {SUPPORTED_RAY} (this one "
                          f"has no {module}.{name}, which sweeper patches while Ray starts)")
    return holder


def check_ray_version() -> None:
    """ConfigError unless every private name this module patches exists."""
    for module, name in PRIVATE_NAMES:
        ray_private(module, name)


@contextlib.contextmanager
def signals_deferred():
    """SIGTERM and SIGINT wait until the block (ray.init) has returned, then reach the
    caller's handlers (the CLI's: stop cleanly, exit 143 / 130).

    Interrupted half-way, ray.init leaves a core worker that crashes the process at exit
    (SIGSEGV or abort instead of 143, seen with a SIGTERM 10-11 s into a sweep); and it
    replaces the driver's SIGTERM handler with its own sys.exit(15) (a traceback, exit 15),
    which is kept from being installed here and the caller's put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ray_utils = ray_private("ray._private.utils", "set_sigterm_handler")
    constants = ray_private("ray._private.ray_constants", "RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    pending: list[int] = []
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: pending.append(signum))
    set_sigterm = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = held_back.append
    # Ray's core worker installs a C++ failure handler (absl) for SIGTERM too while it
    # connects: a SIGTERM then printed a stack dump and the process ended in abort (-6).
    failure_handler_off = constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = failure_handler_off
        ray_utils.set_sigterm_handler = set_sigterm
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if pending and callable(previous[pending[0]]):
        previous[pending[0]](pending[0], None)     # raises: the stop the caller asked for


@contextlib.contextmanager
def loopback_node():
    """Ray takes the loopback as this node's address inside the block (it and the processes
    it starts: every server of a local cluster binds 127.0.0.1)."""
    constants = ray_private("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")
    previous_env = os.environ.get(LOOPBACK_ENV)
    previous = constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = previous
        if previous_env is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = previous_env


def quiet_raylet_messages() -> None:
    """The driver's error listener keeps the raylet's messages in `raylet_messages` instead
    of printing them on stdout (the module docstring). Only that listener calls the patched
    function while Ray's logs are not sent to the driver (`log_to_driver=False`)."""
    worker = ray_private("ray._private.worker", "print_to_stdstream")
    if getattr(worker.print_to_stdstream, "sweeper_quiet", False):
        return

    def keep(data, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            raylet_messages.append(" ".join(str(line).split())[:2000])
        del raylet_messages[:-RAYLET_KEPT]

    keep.sweeper_quiet = True
    worker.print_to_stdstream = keep


def descendants(pids: set[int]) -> list[psutil.Process]:
    """The live processes `pids` and every descendant of theirs."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def kill_processes(procs: list[psutil.Process], wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL (stopped ones too) and reap what is ours; the pids that were still alive."""
    killed = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                killed.append(proc.pid)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=wait_s)
    return killed


RAY_SERVERS = ("raylet", "gcs_server")   # a local cluster's servers, stopped by ray.shutdown


def stop_head_helpers(roots: set[int]) -> list[int]:
    """SIGKILL the head's helper processes a local cluster started beside its servers (the
    autoscaler monitor, the log monitor, the dashboard head): `roots` minus the raylet and
    the GCS server; the pids killed.

    `ray.shutdown()` stops a local cluster's processes one at a time, SIGTERM then up to
    1 s each; the autoscaler monitor used the whole second every time (docs/performance.md,
    "Start-up and shutdown"). They keep nothing a sweep needs (every trial is recorded before the session
    closes); the raylet and the GCS server are left to ray.shutdown, which disconnects the
    driver from them first, and the raylet stops its own agents and workers."""
    helpers = []
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            if proc.name() not in RAY_SERVERS:
                helpers.append(proc)
        except psutil.Error:
            continue
    return kill_processes(helpers, wait_s=1.0)


_abandoned: list[int] = []    # pids whose ray.shutdown() was left running (RaySession.close)


def exit_without_finalizing_if_abandoned(code: int) -> None:
    """After a `ray.shutdown()` that was left running, end the process now with `code`.

    Ray's core worker threads are still inside the stuck shutdown: finalizing the
    interpreter around them crashed the process (SIGSEGV at exit, seen on CI after a
    SIGTERM during start-up) instead of exiting with the code the sweep decided. Every
    trial and store write is done by then; only stdio needs flushing."""
    if os.getpid() not in _abandoned:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _alarm_at_exit() -> None:
    """Last resort, from the exit path: a process still finalizing EXIT_ALARM_S later (a Ray
    thread that never returns) is ended by SIGALRM."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(EXIT_ALARM_S)


def quiet_ray_auth_notice(address: str | None) -> None:
    """Ray (2.60 here) turns token authentication on for a new local cluster when
    RAY_AUTH_MODE is unset, and says so in a warning on every run ("Token authentication is
    enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out",
    ray/_private/authentication/authentication_token_setup.py). Naming the mode Ray would
    choose anyway, `token`, keeps that behaviour (a token in ~/.ray/auth_token, created if
    missing) without the notice. A cluster given by --address or RAY_ADDRESS is left to its
    own setting; so is a mode the user set (docs/installing.md). Called by `RaySession.start` and by every other
    place that starts a local Ray (`sweeper serve`, the benchmarks).."""
    # Ray reads the mode when it is imported: set later, the driver would lack the token
    # its own new cluster demands (InvalidAuthToken), so an imported Ray is left as it is.
    if not address and not os.environ.get("RAY_ADDRESS") and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


class RaySession:
    """The sweep's connection to Ray and, for a local cluster, the processes it started."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.started = False             # ray.init was called here (else Ray was already up)
        # a new local cluster (`--address local`, or none and no RAY_ADDRESS to join)
        self.local = address == "local" or (not address and not os.environ.get("RAY_ADDRESS"))
        self.owned: set[int] = set()     # pids ray.init started (a local cluster's roots)
        self.abandoned = False           # ray.shutdown did not return in time

    def start(self) -> None:
        """Connect to the cluster at `address`, or start a local one on the loopback.
        ClusterLost when the local cluster does not start; ConfigError for an address."""
        quiet_ray_auth_notice(None if self.local else self.address)
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        if ray.is_initialized():
            return
        check_ray_version()
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": logging.WARNING}
        if self.local:
            # a new local cluster: ray.init() would join any cluster `ray start` left on
            # this machine (another user's sweep), whose node this sweep does not own
            kwargs["address"] = "local"
        elif self.address:
            kwargs["address"] = self.address
            # Remote nodes import the project from here, installed or not.
            root = Path(__file__).resolve().parents[2]
            kwargs["runtime_env"] = {"py_modules": [str(root / "sweeper"), str(root / "workloads")]}
        quiet_raylet_messages()
        before = {p.pid for p in psutil.Process().children()}
        self.started = True
        try:
            with signals_deferred(), (loopback_node() if self.local else contextlib.nullcontext()):
                ray.init(**kwargs)
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception on a timeout
            if self.local or not self.address:   # (a loaded machine): one line, no study
                raise ClusterLost(f"the local Ray cluster did not start "
                                  f"({one_line(err)[:200]}); try again") from None
            raise ConfigError("--address", self.address, f"the address of a running Ray "
                              f"cluster, e.g. 10.0.0.1:6379 ({one_line(err)})") from None
        finally:
            if self.local:
                self.owned = {p.pid for p in psutil.Process().children()} - before

    def processes(self) -> list[psutil.Process]:
        """The live Ray processes this session started (none when it joined a cluster)."""
        return descendants(self.owned)

    def close(self, wait_s: float = SHUTDOWN_WAIT_S) -> bool:
        """ray.shutdown(), waited for at most `wait_s`, then every process of a local cluster
        still alive is killed. False when ray.shutdown did not return in time: it is left in a
        daemon thread, off the exit path, and the process exits without it."""
        if not self.started:
            return True
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        procs = self.processes()     # before: a stopped raylet still has its children
        if self.local:
            stop_head_helpers(self.owned)
        done = threading.Event()

        def shutdown() -> None:
            try:
                ray.shutdown()
            except Exception:  # noqa: BLE001 - a Ray half started or already gone: nothing to end
                pass
            finally:
                done.set()

        threading.Thread(target=shutdown, name="ray-shutdown", daemon=True).start()
        returned = done.wait(wait_s)
        if not returned:
            self.abandoned = True
            _abandoned.append(os.getpid())
            atexit.unregister(ray.shutdown)       # it would wait on the stuck shutdown's lock
            atexit.register(_alarm_at_exit)
        if procs:
            alive = [p for p in procs if p.is_running()] if returned else procs
            if returned:
                _, alive = psutil.wait_procs(alive, timeout=KILL_WAIT_S)
            killed = kill_processes(alive)
            if not returned:
                print(f"sweeper: Ray did not shut down within {wait_s:g}s; killed its "
                      f"{len(killed)} processes (every trial is recorded)", file=sys.stderr)
        elif not returned:
            print(f"sweeper: Ray did not shut down within {wait_s:g}s; left it (every trial is "
                  "recorded)", file=sys.stderr)
        self.started = False
        return returned
