"""Multi-host trials on one machine: a trial's mesh spans two JAX processes (two Ray
actors, two emulated devices each, joined by `jax.distributed` over gloo) and must equal
the same trial on one process with four devices: the same logits against the unsharded
reference, the same collectives in the compiled programs. Real Ray, real Optuna and MLflow
SQLite stores; timings are never asserted. The two-node cluster case is in
tests/test_multinode.py.
"""

from __future__ import annotations

import os
import time

import optuna
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips

from sweeper.sweep.controller import run_sweep  # noqa: E402
from sweeper.sweep.slices import plan_slice  # noqa: E402
from sweeper.sweep.meshworker import TEST_FAIL_HOST_ENV  # noqa: E402
from sweeper.sweep.workers import RayPool, TrialError  # noqa: E402
from workloads.config import ConfigError  # noqa: E402
from workloads.trial import TrialConfig  # noqa: E402

# ci_slow: multi-process JAX trials under Ray, about 40 s (CI's second stage; keeps `make test` near 10 minutes on 2 cores)
pytestmark = pytest.mark.ci_slow

ATOL = 0.1     # bf16 logits of the sharded engine against the f32 reference (tests/test_measure.py)
TRIAL = {"model": "tiny", "chips": 4, "batch": 4, "input_len": 8, "decode_steps": 2,
         "repeats": 1, "warmup": 0, "time_budget_s": 0}


@pytest.fixture(scope="module")
def ray_session(session_sweeper_home):
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
    if old is None:
        os.environ.pop("SWEEPER_HOME", None)
    else:
        os.environ["SWEEPER_HOME"] = old


def alive(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (a zombie is gone)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {pid for pid in pids if running(pid)}


def run_on_pool(pool: RayPool, trial: TrialConfig, timeout: float = 300):
    handle = pool.submit(0, trial, None, 0)
    deadline = time.monotonic() + timeout
    while not pool.ready([handle], 1.0):
        assert time.monotonic() < deadline, "the trial hangs"
    return handle, pool.outcome(handle)


def test_two_hosts_of_two_devices_equal_one_host_of_four_in_a_sweep(ray_session, tmp_path):
    space = tmp_path / "hosts.yaml"
    space.write_text(yaml.safe_dump({
        "name": "hosts", "model": "tiny", "hardware": "host", "chips": 4, "batch": 4,
        "input_len": 8, "decode_steps": 2, "repeats": 1, "warmup": 0, "time_budget_s": 0,
        "params": {"hosts": [1, 2]}, "sampler": {"type": "grid"}, "trials": 2, "parallel": 1,
        "timeout_s": 300, "verify": True, "memory_budget_bytes": "1GiB"}))
    stores = {"storage": f"sqlite:///{tmp_path / 'optuna.db'}",
              "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = run_sweep(str(space), progress=False, **stores)
    trials = optuna.load_study(study_name=result.study_name, storage=result.storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2, [t.user_attrs.get("reason") for t in trials]
    by_hosts = {t.params["hosts"]: t for t in trials}
    client = MlflowClient(stores["tracking_uri"])
    for hosts, t in by_hosts.items():
        m = t.user_attrs["measurement"]
        assert m["tokens_match"] == 1.0 and m["verify_max_abs_err"] <= ATOL     # the reference
        run = client.get_run(t.user_attrs["mlflow_run_id"])
        assert run.data.params["hosts"] == str(hosts)                            # recorded
        assert t.user_attrs["flat_params"]["hosts"] == hosts
    one, two = (by_hosts[h].user_attrs for h in (1, 2))
    for metric in ("prefill_comm_bytes_per_chip", "decode_comm_bytes_per_chip",
                   "weight_bytes_per_chip", "kv_bytes_per_chip"):
        assert one["measurement"][metric] == two["measurement"][metric], metric
    # the 2-host trial ran as two processes, one per host, each its own rank
    ranks = two["worker"]["hosts"]
    assert [w["rank"] for w in ranks] == [0, 1] and len({w["pid"] for w in ranks}) == 2
    assert "hosts" not in one["worker"]


def test_same_logits_and_collectives_and_a_failing_host_frees_the_trial(ray_session, monkeypatch):
    pool = RayPool("host", 1, verify=True)
    try:
        single = TrialConfig.from_dict(TRIAL)
        double = TrialConfig.from_dict({**TRIAL, "hosts": 2})
        _, one = run_on_pool(pool, single)
        handle, two = run_on_pool(pool, double)
        for m in (one.measurement, two.measurement):
            assert m.tokens_match is True and m.verify_max_abs_err <= ATOL
        assert two.measurement.collectives == one.measurement.collectives    # same programs
        assert two.measurement.extra["process_count"] == 2
        assert {h["rank"] for h in two.measurement.extra["hosts"]} == {0, 1}
        group_pids = {w["pid"] for w in two.worker["hosts"]}
        assert alive(group_pids) == group_pids           # the group stays for the next trial

        # Host 1 raises: the trial fails with its reason, at once (host 0 would wait at the
        # barrier), and every actor of the group and its placement group are freed.
        pool.discard(handle)                              # a fresh group reads the variable
        monkeypatch.setenv(TEST_FAIL_HOST_ENV, "1")
        start = time.monotonic()
        handle = pool.submit(0, double, None, 1)
        places = None
        while not pool.ready([handle], 1.0):
            places = places or pool.placement(handle)
            assert time.monotonic() - start < 120, "a failed host left the trial hanging"
        places = places or pool.placement(handle, 30)
        with pytest.raises(TrialError, match=r"host 1 of 2: RuntimeError: injected failure on host 1"):
            pool.outcome(handle)
        failed_pids = {w["pid"] for w in places["hosts"]}
        deadline = time.monotonic() + 30
        while alive(failed_pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive(failed_pids)
        from ray.util import placement_group_table

        assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    finally:
        pool.close()


def test_hosts_must_divide_chips_and_match_the_processes():
    with pytest.raises(ConfigError, match="hosts"):
        TrialConfig.from_dict({**TRIAL, "hosts": 3})
    assert TrialConfig.from_dict(TRIAL).hosts == 1
    assert "hosts" in TrialConfig.from_dict(TRIAL).flat_params()
    assert plan_slice(2, 2, nodes=1).strategy == "PACK"            # one machine
    assert plan_slice(2, 2, {"TPU": 4}, nodes=2).strategy == "STRICT_SPREAD"
