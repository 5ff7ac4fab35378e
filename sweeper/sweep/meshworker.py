"""The process a trial runs in: one Ray actor owning one mesh for its whole life.

Emulated mesh (`hardware: host`): the actor's process is started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (the device count is fixed when JAX
starts, so one process serves one chip count) and pins itself to its slot's CPU cores
(`split_cores`) with `os.sched_setaffinity` before JAX is imported. Real devices: no
device-count flag, no pinning. Every actor keeps an engine/compile cache
(`run_trial(engine_cache=...)`) across its trials, so a repeated shape and layout is not
compiled again (the last ENGINE_CACHE_ENTRIES shapes: each holds its weights and inputs
placed on the mesh, and a worker lives for the whole sweep), and the sweep's persistent
compilation cache (`sweeper/sweep/compile_cache.py`) serves the programs another worker
compiled. A serving trial (`TrialConfig.serving`, a space's `serving:` block) serves its
request stream on the same mesh instead (workloads/serving/trial.py; its slot server is
built for the trial, outside the engine cache). A disaggregated serving trial runs its
prefill slice here, on the first half of this worker's devices, and its decode slice on a
`DecodeSliceWorker` actor this worker starts for the trial (the other half of the chips,
its own process and device count), the KV caches handed over through Ray as `sweeper
serve` hands them over (with `hardware: host` the decode slice also runs its part of the
measurement before the stream, workloads/serving/trial.py `measure_before_stream`); the two
share this worker's cores (split in two when it has two
or more), so the trial uses no core outside its slot (docs/space-files.md "Serving
trials"). The actor answers `where()` (pid, Ray node
id and IP, the resources it holds) as soon as its process is up, before its first trial.

A multi-host trial's hosts (README "Multi-host trials") join with `jax.distributed` at rank
0's address before their first trial, then meet at a barrier before each (`JOIN_TIMEOUT_S`).

Test-only: `SWEEPER_TEST_TRIAL_DELAY_S` makes a worker sleep before a trial (`SECONDS`, or
`SECONDS:N1,N2` for trials N1 and N2 only), so that the fault tests can kill a worker or let
a trial time out in the middle of it; with it, `SWEEPER_TEST_TRIAL_ALLOC_MB=N` makes the
worker then allocate and touch N MiB (the OOM test's memory: what a trial allocates by itself
is too little and changes with the code). `SWEEPER_TEST_FAIL_HOST=RANK` makes host RANK of a
multi-host trial raise before the trial. They are forwarded from the controller's environment
to the workers and have no use outside tests.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import time
from collections import OrderedDict
from typing import Any

from sweeper import paths
from sweeper.sweep import compile_cache
from sweeper.sweep.slices import JOIN_TIMEOUT_S, free_port
from workloads import hoststate
from workloads.config import HardwareProfile
from workloads.measure import run_trial
from workloads.serving.trial import run_serving_trial
from workloads.trial import TrialConfig

TEST_DELAY_ENV = "SWEEPER_TEST_TRIAL_DELAY_S"     # test-only, see the module docstring
TEST_FAIL_HOST_ENV = "SWEEPER_TEST_FAIL_HOST"      # test-only, see the module docstring
TEST_ALLOC_ENV = "SWEEPER_TEST_TRIAL_ALLOC_MB"     # test-only, see the module docstring
TEST_ENVS = (TEST_DELAY_ENV, TEST_FAIL_HOST_ENV, TEST_ALLOC_ENV)
ENGINE_CACHE_ENTRIES = 4    # shapes a worker keeps compiled in memory (the rest: from disk)


class EngineCache(OrderedDict):
    """`run_trial`'s engine cache, least recently used shape dropped past `capacity`."""

    def __init__(self, capacity: int = ENGINE_CACHE_ENTRIES):
        super().__init__()
        self.capacity = capacity

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
        return super().get(key, default)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


def trial_delay_s(number: int | None, environ: dict | None = None) -> float:
    """Seconds a worker waits before trial `number` (test-only; 0 when the variable is unset)."""
    spec = (environ if environ is not None else os.environ).get(TEST_DELAY_ENV, "").strip()
    if not spec:
        return 0.0
    seconds, _, numbers = spec.partition(":")
    if numbers.strip() and number not in {int(n) for n in numbers.split(",") if n.strip()}:
        return 0.0
    return float(seconds)


def where_am_i() -> dict[str, Any]:
    """This process: pid, host, and (inside Ray) node id, node IP and assigned resources."""
    info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        import ray   # lazy: Ray (~1 s) only where a pool or cluster is used

        if ray.is_initialized():
            context = ray.get_runtime_context()
            info["node_id"] = context.get_node_id()
            info["node_ip"] = ray.util.get_node_ip_address()
            info["resources"] = {k: float(v) for k, v in context.get_assigned_resources().items()}
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node to report
        pass
    return info


def split_cores(parallel: int, available: list[int] | None = None) -> list[list[int]]:
    """`parallel` disjoint groups of this process's cores (overlapping only if too few)."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if parallel >= len(cores):
        return [[cores[i % len(cores)]] for i in range(parallel)]
    size, extra = divmod(len(cores), parallel)
    groups, start = [], 0
    for i in range(parallel):
        end = start + size + (1 if i < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


def device_cores(cores, devices: int) -> set[int]:
    """The first `devices` of a worker's `cores`: an emulated mesh runs on at most one core
    per device, as the host model prices it (workloads/hostmodel.py `throughput_ratio`). A
    worker's share of the host (its slot's cores, and their cache) is unchanged. Measured
    on a d128 five-layer model, a one-device worker on two cores decoded 9-17% slower than
    on one; a d640 one 25-35% faster: neither is what a one-core calibration predicts."""
    return set(sorted(cores)[:devices])


class DecodeSliceWorker:
    """A disaggregated serving trial's decode slice (the module docstring): its own process
    with `chips` emulated devices (set by its constructor, before JAX is imported, as
    workers.py `PooledMeshWorker` does), pinned to `cores`; two threads, one receiving
    handovers (`deliver`) while the other serves (`serve`)."""

    def __init__(self, env: dict[str, str], cores: list[int] | None):
        os.environ.update(env)
        if cores:
            wanted = set(cores) & os.sched_getaffinity(0)
            if wanted:
                os.sched_setaffinity(0, wanted)
        self.inbox: queue.Queue = queue.Queue()
        self.server = None
        self._stopped: set[int] = set()   # `decode_beside` runs told to stop

    def setup(self, spec, prompt_lens: list[int]) -> dict[str, float]:
        """Build the decode slot server (a workloads.serving.slots.SlotSpec) and warm it up."""
        from workloads.serving.slots import SlotServer   # lazy: imports JAX (this process's mesh)

        compile_cache.enable(os.environ.get(compile_cache.CACHE_DIR_ENV))
        self.server = SlotServer(spec)
        times: dict[str, float] = {}
        for length in sorted(set(prompt_lens)):
            times.update(self.server.warm_up(length))
        return times

    def pid(self) -> int:
        return os.getpid()

    def deliver(self, handover: list[dict]) -> None:
        delivered = time.time()    # when this process had it (the stream's `delivered_s`)
        for item in handover:
            self.inbox.put({**item, "delivered": delivered})

    def serve(self, expected: int, start_at: float) -> dict[int, dict]:
        from workloads.serving.slots import serve_decode_slice   # lazy: imports JAX

        return serve_decode_slice(self.server, self.inbox, expected, start_at)

    # serving host costs before the stream (workloads/serving/hostcosts.py, the code `sweeper serve
    # --measure-overheads`'s workers run; workloads/serving/trial.py `measure_before_stream`)

    def measure_loop(self, input_len: int, output_len: int, how: dict) -> dict:
        from workloads.serving.hostcosts import measure_loop   # lazy: imports JAX

        return measure_loop(self.server, input_len, output_len, **how)

    def decode_beside(self, token: int, max_s: float = 60.0) -> int:
        """Every slot stepping back to back until `stop_decode_beside(token)` (or `max_s`):
        the decode loop beside the prefill slice's closed loop, as during a stream's prefill
        calls (docs/serving.md "Serving host costs"); the closed loop's handovers (`sink`)
        arrive on this actor's other thread. The steps made."""
        from workloads.serving.hostcosts import step_beside   # lazy: imports JAX

        return step_beside(self.server, self._stopped, token, max_s)

    def stop_decode_beside(self, token: int) -> None:
        self._stopped.add(token)

    def sink(self, handover: list[dict]) -> int:
        """Receive a closed loop's handover and drop it."""
        return len(handover)

    def handover_receive(self, handover: list[dict]) -> dict[str, float]:
        from workloads.serving.hostcosts import handover_receive   # lazy: imports JAX

        return handover_receive(self.server, handover)

    def cpu_seconds(self) -> float:
        """This process's CPU seconds, all its threads (Ray's receiving ones included)."""
        return time.process_time()


class DecodeSlice:
    """The decode side of a disaggregated serving trial, as `run_serving_trial` uses it
    (workloads/serving/trial.py): a `DecodeSliceWorker` actor with `chips` devices on
    `cores`, started by the trial's worker and killed after the trial."""

    def __init__(self, chips: int, cores: list[int] | None, emulated: bool):
        import ray   # lazy: only inside the trial's Ray worker

        self.ray = ray
        env = {name: os.environ[name] for name in (paths.HOME_ENV, compile_cache.CACHE_DIR_ENV)
               if name in os.environ}
        if emulated:
            inherited = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                               os.environ.get("XLA_FLAGS", "")).split()
            env["XLA_FLAGS"] = " ".join(
                [*inherited, f"--xla_force_host_platform_device_count={chips}"])
        # num_cpus 0: the pinning decides its cores (this worker's slot), not Ray's accounting
        self.actor = ray.remote(DecodeSliceWorker).options(
            num_cpus=0, max_restarts=0, max_concurrency=2).remote(env, cores)
        self.serving = None
        self.pending: list = []      # handovers not yet seen to have arrived
        self.pid = None

    def setup(self, spec, prompt_lens: list[int]) -> dict[str, float]:
        self.pid = self.ray.get(self.actor.pid.remote())
        return self.ray.get(self.actor.setup.remote(spec, prompt_lens))

    def begin(self, expected: int, start_at: float) -> None:
        self.serving = self.actor.serve.remote(expected, start_at)
        self.pending = []

    def send(self, handover: list[dict]):
        """Hand a prefill call's KV caches over, not waited for; the earlier handovers that
        have completed are checked first, so a lost decode slice fails the trial at the next
        handover, not at the end of the stream (docs/reliability.md, "Serving")."""
        ray = self.ray
        if self.pending:
            done, _ = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            if done:
                finished = set(done)
                self.pending = [ref for ref in self.pending if ref not in finished]
                ray.get(done)        # RayActorError: the decode slice is gone
        ref = self.actor.deliver.remote(handover)
        self.pending.append(ref)
        return ref

    def finish(self, sent: list) -> dict[int, dict]:
        self.ray.get(sent)
        return self.ray.get(self.serving)

    # serving host costs before the stream (workloads/serving/trial.py `measure_before_stream`)

    def measure_loop(self, input_len: int, output_len: int, how: dict) -> dict:
        """The decode slice's closed loop (workloads/serving/hostcosts.py `measure_loop`)."""
        return self.ray.get(self.actor.measure_loop.remote(input_len, output_len, how))

    def sink(self, handover: list[dict]):
        """A closed loop's handover, sent as `send` sends (dropped there; not waited for)."""
        return self.actor.sink.remote(handover)

    def wait(self, sent: list) -> None:
        self.ray.get(sent)

    def begin_beside(self) -> tuple[int, Any]:
        """Start the decode slice stepping beside the prefill slice's closed loop
        (`DecodeSliceWorker.decode_beside`); the token `end_beside` takes."""
        token = time.monotonic_ns()
        return token, self.actor.decode_beside.remote(token)

    def end_beside(self, beside: tuple[int, Any]) -> int:
        """Stop it; the steps it made."""
        token, steps = beside
        self.ray.get(self.actor.stop_decode_beside.remote(token))
        return self.ray.get(steps)

    def receive(self, handover: list[dict]):
        """One timed handover (workloads/serving/hostcosts.py `handover_send`): sent now, its answer
        (`handover_receive`) when the returned call is called."""
        ref = self.actor.handover_receive.remote(handover)
        return lambda: self.ray.get(ref)

    def cpu_seconds(self) -> float:
        return self.ray.get(self.actor.cpu_seconds.remote())

    def close(self) -> None:
        self.ray.kill(self.actor)


class MeshWorker:
    """Owns one mesh (N emulated or real devices) and an engine cache; runs trials on it."""

    def __init__(self, slot: int, chips: int | None, cores: list[int] | None,
                 rank: int = 0, hosts: int = 1):
        self.slot, self.chips = slot, chips        # chips: the whole mesh's, all hosts
        self.rank, self.hosts = rank, hosts
        self.joined = hosts == 1                   # jax.distributed joined (multi-host)
        self.trials_started = 0
        self.cores: list[int] | None = None
        if cores:
            mine = os.sched_getaffinity(0)
            wanted = set(cores) & mine if mine else set(cores)
            if chips:   # at most one core per emulated device (`device_cores`)
                wanted = device_cores(wanted, max(1, chips // hosts))
            if wanted:   # on another node of a cluster the driver's core ids may not exist
                os.sched_setaffinity(0, wanted)
                self.cores = sorted(wanted)
        self.engine_cache: dict = EngineCache()
        self.trials_run = 0
        self.cache_counter = None
        self.warmed = False

    def warm(self) -> bool:
        """Set up what every trial needs, once (the pool calls it right after `where`, and
        `run` before its first trial): the sweep's persistent compilation cache, before
        this process compiles anything; for a single-host worker also the engine's imports
        and the JAX backend, so that they happen while the controller sets up (a sweep's
        workers start with Ray), not in the first trial. (A multi-host worker must join
        jax.distributed before its backend starts.)"""
        if self.warmed:
            return False
        self.warmed = True
        if compile_cache.enable(os.environ.get(compile_cache.CACHE_DIR_ENV)):
            self.cache_counter = compile_cache.CacheCounter.install()
            if self.hosts == 1:
                import jax   # lazy: JAX only in the process that runs trials

                import workloads.engine  # noqa: F401 - imported here for its start-up cost
                jax.devices()
        return True

    def where(self) -> dict[str, Any]:
        """Where this worker runs (no JAX import: answers as soon as the process is up)."""
        info = {**where_am_i(), "slot": self.slot, "chips": self.chips}
        if self.hosts > 1:
            info.update(rank=self.rank, hosts=self.hosts)
        return info

    def coordinator(self) -> str:
        """Rank 0 of a multi-host group: `ip:port` of the coordinator service it will start
        (this node's IP and a port free on it), the address every host joins."""
        return f"{where_am_i().get('node_ip') or '127.0.0.1'}:{free_port()}"

    def join(self, coordinator: str) -> None:
        """Join the slice's other hosts (once), then meet them at this trial's barrier, so a
        host that never arrives fails the trial after JOIN_TIMEOUT_S instead of hanging."""
        import jax   # lazy: JAX starts its backend; only in the process that runs a trial
        from jax._src import distributed   # the runtime client: the one barrier with a timeout

        if not self.joined:
            # CPU collectives across processes (the emulated mesh) go over gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.hosts,
                                       process_id=self.rank, initialization_timeout=JOIN_TIMEOUT_S)
            self.joined = True
        self.trials_started += 1
        distributed.global_state.client.wait_at_barrier(
            f"sweeper-trial-{self.trials_started}", JOIN_TIMEOUT_S * 1000)

    def info(self) -> dict[str, Any]:
        import jax   # lazy: JAX starts its backend; only in the process that runs a trial

        return {"pid": os.getpid(), "slot": self.slot, "chips": self.chips,
                "cores": sorted(os.sched_getaffinity(0)), "devices": len(jax.devices()),
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "cache_entries": len(self.engine_cache),
                "trials_run": self.trials_run}

    def run(self, config: dict, hardware: dict | None, number: int | None = None,
            coordinator: str | None = None, verify: bool = False) -> dict[str, Any]:
        delay = trial_delay_s(number)
        if delay:
            time.sleep(delay)       # test-only: a window to kill this worker mid-trial
            alloc_mb = int(os.environ.get(TEST_ALLOC_ENV) or 0)
            if alloc_mb:            # test-only: memory the OOM test's cgroup cannot hold
                hog = bytearray(alloc_mb * 2**20)
                hog[::4096] = b"x" * len(hog[::4096])
                del hog
        if self.hosts > 1:
            if os.environ.get(TEST_FAIL_HOST_ENV, "") == str(self.rank):
                raise RuntimeError(f"injected failure on host {self.rank} ({TEST_FAIL_HOST_ENV})")
            self.join(coordinator)
        self.warm()
        trial = TrialConfig.from_dict(config, validate=False)
        profile = HardwareProfile.from_dict(hardware) if hardware else None
        before = set(self.engine_cache)
        cached = self.cache_counter.snapshot() if self.cache_counter else None
        started = time.time()
        hoststate.reset_peak_rss()      # this trial's memory high-water, not the actor's
        if trial.serving is not None:     # a space's serving: block (docs/space-files.md)
            measurement = self.serve(trial, profile)
            measurement.extra["compile_cache_hit"] = False     # not from the engine cache
        else:
            measurement = run_trial(trial, engine_cache=self.engine_cache, hardware=profile,
                                    verify=verify)
        measurement.worker_rss_peak_bytes = hoststate.peak_rss_bytes()
        finished = time.time()
        self.trials_run += 1
        new_entries = len(set(self.engine_cache) - before)
        engine_hit = bool(measurement.extra.get("compile_cache_hit",
                                                bool(before) and new_entries == 0))
        if cached is not None:
            stats = self.cache_counter.since(cached)
            measurement.programs_from_cache = float(stats.hits)
            measurement.programs_compiled = float(stats.compiled)
            measurement.extra["compile_time_saved_s"] = stats.saved_s
        # reused: nothing compiled by XLA (the engine cache, or every program from disk)
        reused = engine_hit or (cached is not None and stats.requests > 0
                                 and stats.compiled == 0)
        return {"measurement": measurement.to_dict(), "started": started, "finished": finished,
                "worker": {**self.where(),
                           "cores": sorted(os.sched_getaffinity(0)),
                           "cache_entries": len(self.engine_cache),
                           "new_cache_entries": new_entries,
                           "cache_hit": engine_hit,        # in this process's memory
                           "reused": reused,               # ... or every program from disk
                           "trials_run": self.trials_run}}

    def serve(self, trial: TrialConfig, profile: HardwareProfile | None):
        """A serving trial (workloads/serving/trial.py); disaggregated: its decode slice on a
        `DecodeSliceWorker` sharing this worker's cores (the module docstring)."""
        if trial.serving_mode != "disaggregated":
            return run_serving_trial(trial, profile)
        trial.validate()          # each slice on its half (checked when the space was loaded)
        cores = sorted(os.sched_getaffinity(0))
        mine, theirs = (cores[:len(cores) // 2], cores[len(cores) // 2:]) if len(cores) > 1 \
            else (cores, cores)
        emulated = self.cores is not None or "xla_force_host_platform_device_count" in \
            os.environ.get("XLA_FLAGS", "")
        decode = DecodeSlice(trial.chips // 2, theirs, emulated)
        try:
            os.sched_setaffinity(0, mine)        # the prefill slice: its half of the cores
            return run_serving_trial(trial, profile, decode_slice=decode)
        except decode.ray.exceptions.RayActorError as err:
            # the trial's reason, one line naming the lost process (docs/reliability.md)
            raise RuntimeError(f"the decode slice's worker (pid {decode.pid}) was lost "
                               f"mid-trial ({type(err).__name__})") from None
        finally:
            os.sched_setaffinity(0, cores)
            decode.close()
