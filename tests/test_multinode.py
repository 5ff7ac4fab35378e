"""A real multi-node Ray cluster on this machine: `ray.cluster_utils.Cluster` with two nodes
(a head and a second raylet), each with one unit of the custom resource `slice` standing in
for an accelerator slice. `sweeper run --address` (a subprocess, as a user runs it) asks for
`resources: {slice: 1}` per worker: with two slots, one worker lands on each node, and every
trial records the node it ran on and the resources it held (Optuna user attrs, MLflow tags).

A multi-host trial (`hosts: 2`, docs/clusters.md "Multi-host trials") runs on the same cluster: one
JAX process per node (STRICT_SPREAD), two emulated devices each, joined by
`jax.distributed`; it equals the one-host trial (reference logits, collectives). A slice the
cluster cannot hold is refused with nothing left reserved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips
from ray.cluster_utils import Cluster  # noqa: E402

from sweeper.sweep.slices import EMULATED_BUNDLE, JOIN_TIMEOUT_S, plan_slice  # noqa: E402
from workloads.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def cluster(session_sweeper_home):
    """Two raylets on this machine, one `slice` each; this process is connected as a driver."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"slice": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"slice": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


# ci_slow: ~30 s (a second Ray node); keeps `make test` near 10 minutes on 2 cores
@pytest.mark.ci_slow
def test_sweep_workers_are_placed_on_both_nodes_holding_their_resources(cluster, tmp_path,
                                                                        session_sweeper_home):
    assert len(node_ids()) == 2
    space = tmp_path / "multinode.yaml"
    space.write_text(yaml.safe_dump({
        "name": "multinode", "model": "tiny", "hardware": "devices", "chips": 1, "input_len": 8,
        "decode_steps": 2, "repeats": 1, "warmup": 0, "params": {"batch": [2, 4, 6, 8]},
        "sampler": {"type": "grid"}, "trials": 4, "parallel": 2, "timeout_s": 300,
        "resources": {"slice": 1}}))
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper.cli", "run", str(space), "--address", cluster.address,
         "--storage", storage, "--tracking-uri", tracking, "--study", "multinode", "--json",
         "--no-analysis"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "SWEEPER_HOME": str(session_sweeper_home)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["trials_complete"] == 4

    trials = optuna.load_study(study_name="multinode", storage=storage).trials
    workers = [t.user_attrs["worker"] for t in trials]
    assert {w["node_id"] for w in workers} == node_ids()             # both nodes ran trials
    for w in workers:
        assert w["resources"] == {"slice": 1.0}                        # what the space asked for
    by_node = {}
    for w in workers:
        by_node.setdefault(w["node_id"], set()).add(w["pid"])
    assert all(len(pids) == 1 for pids in by_node.values())            # one worker per node
    client = MlflowClient(tracking)
    for t in trials:
        tags = client.get_run(t.user_attrs["mlflow_run_id"]).data.tags
        assert tags["node_id"] == t.user_attrs["worker"]["node_id"]
        assert tags["node_ip"] == t.user_attrs["worker"]["node_ip"]


# ci_slow: about 25 s on the two-node cluster (keeps `make test` near 10 minutes on 2 cores)
@pytest.mark.ci_slow
def test_a_multi_host_trial_spans_both_nodes_and_equals_the_one_host_trial(cluster, tmp_path,
                                                                           session_sweeper_home):
    space = tmp_path / "hosts.yaml"
    space.write_text(yaml.safe_dump({
        "name": "multihost", "model": "tiny", "hardware": "host", "chips": 4, "batch": 4,
        "input_len": 8, "decode_steps": 2, "repeats": 1, "warmup": 0, "time_budget_s": 0,
        "params": {"hosts": [1, 2]}, "sampler": {"type": "grid"}, "trials": 2, "parallel": 1,
        "timeout_s": 400, "verify": True, "memory_budget_bytes": "1GiB"}))
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper.cli", "run", str(space), "--address", cluster.address,
         "--storage", storage, "--tracking-uri", tracking, "--study", "multihost", "--json",
         "--no-analysis"], capture_output=True, text=True, timeout=900,
        env={**os.environ, "SWEEPER_HOME": str(session_sweeper_home)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = optuna.load_study(study_name="multihost", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2, [t.user_attrs.get("reason") for t in trials]
    by_hosts = {t.params["hosts"]: t.user_attrs for t in trials}
    client = MlflowClient(tracking)
    for hosts, attrs in by_hosts.items():
        m = attrs["measurement"]
        assert m["tokens_match"] == 1.0 and m["verify_max_abs_err"] <= 0.1      # the reference
        assert client.get_run(attrs["mlflow_run_id"]).data.params["hosts"] == str(hosts)
    for metric in ("prefill_comm_bytes_per_chip", "decode_comm_bytes_per_chip"):
        assert by_hosts[1]["measurement"][metric] == by_hosts[2]["measurement"][metric]
    hosts = by_hosts[2]["worker"]["hosts"]
    assert [h["rank"] for h in hosts] == [0, 1]
    assert {h["node_id"] for h in hosts} == node_ids()          # STRICT_SPREAD: one per node


def test_a_slice_the_cluster_cannot_hold_is_refused_not_half_started(cluster):
    from sweeper.sweep.workers import RayPool, TrialError
    from workloads.trial import TrialConfig

    pool = RayPool("devices", 1, {"slice": 1}, place_timeout_s=2)      # 3 hosts, 2 nodes
    try:
        trial = TrialConfig.from_dict({"model": "tiny", "chips": 3, "batch": 3, "hosts": 3,
                                       "topology": [1, 3, 1]}, validate=False)
        handle = pool.submit(0, trial, None, 0)
        assert pool.ready([handle], 0) == [handle]
        with pytest.raises(TrialError, match="cannot place 3 hosts"):
            pool.outcome(handle)
    finally:
        pool.close()
    assert ray.available_resources().get("slice") == 2.0                # nothing held


def test_tpu_pod_slice_plan():
    # A TPU v4-32: 4 hosts x 4 chips; rank 0 on the slice's head host.
    plan = plan_slice(4, 4, {"TPU": 4}, nodes=4, rank0_resources={"TPU-v4-32-head": 1})
    assert plan.chips == 16 and plan.strategy == "STRICT_SPREAD"
    assert plan.bundles == [{"TPU": 4.0, "TPU-v4-32-head": 1.0}] + [{"TPU": 4.0}] * 3
    assert plan.distributed_args(3, "10.0.0.7:8476") == {
        "coordinator_address": "10.0.0.7:8476", "num_processes": 4, "process_id": 3,
        "initialization_timeout": JOIN_TIMEOUT_S}
    assert plan_slice(1, 8, {"GPU": 8}).strategy == "PACK"             # one host: no spread
    assert plan_slice(2, 2, nodes=1).bundles == [EMULATED_BUNDLE] * 2  # emulated, one machine
    with pytest.raises(ConfigError):
        plan.distributed_args(4, "10.0.0.7:8476")
    with pytest.raises(ConfigError):
        plan_slice(0, 4)
