"""A real multi-node Ray cluster on this machine: `ray.cluster_utils.Cluster` with two nodes
(a head and a second raylet), each with one unit of the custom resource `slice` standing in
for an accelerator slice. `sweeper run --address` (a subprocess, as a user runs it) asks for
`resources: {slice: 1}` per worker: with two slots, one worker lands on each node, and every
trial records the node it ran on and the resources it held (Optuna user attrs, MLflow tags).

The multi-host slice plan (`sweeper.sweep.slices`) is checked without hardware: on the same
cluster a placement group reserves one `slice` per node (STRICT_SPREAD), one actor per host
reports where it landed and the `jax.distributed.initialize` arguments it was given.
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

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from sweeper.sweep.slices import ENV_COORDINATOR, distributed_args_from_env, plan_slice, start_slice  # noqa: E402
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


def test_a_slice_gets_one_actor_per_host_and_rank_0_coordinates(cluster):
    from ray.util.placement_group import remove_placement_group

    plan = plan_slice(hosts=2, chips_per_host=1, accelerator="slice")
    pg, actors, places, connected = start_slice(plan, initialize=False)
    try:
        assert [p["rank"] for p in places] == [0, 1]
        assert {p["node_id"] for p in places} == node_ids()            # STRICT_SPREAD
        coordinator = f"{places[0]['node_ip']}:{plan.coordinator_port}"
        assert connected == [{"rank": r, "coordinator_address": coordinator, "num_processes": 2,
                              "process_id": r} for r in range(2)]
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)


def test_a_slice_the_cluster_cannot_hold_is_refused_not_half_started(cluster):
    plan = plan_slice(hosts=3, chips_per_host=1, accelerator="slice")   # 3 hosts, 2 nodes
    with pytest.raises(TimeoutError, match="cannot place 3"):
        start_slice(plan, timeout_s=2, initialize=False)
    assert ray.available_resources().get("slice") == 2.0                # nothing held


def test_tpu_pod_slice_plan():
    # A TPU v4-32: 4 hosts x 4 chips; rank 0 on the slice's head host.
    plan = plan_slice(4, 4, "TPU", rank0_resources={"TPU-v4-32-head": 1})
    assert plan.chips == 16 and plan.strategy == "STRICT_SPREAD"
    assert plan.bundles == [{"TPU": 4.0, "TPU-v4-32-head": 1.0}] + [{"TPU": 4.0}] * 3
    env = plan.host_env(3, "10.0.0.7")
    assert env[ENV_COORDINATOR] == "10.0.0.7:8476"
    assert distributed_args_from_env(env) == {"coordinator_address": "10.0.0.7:8476",
                                              "num_processes": 4, "process_id": 3}
    assert distributed_args_from_env({}) is None
    assert plan_slice(1, 8, "GPU").strategy == "STRICT_PACK"          # one host: no spread
    with pytest.raises(ConfigError):
        plan.distributed_args(4, "10.0.0.7")
    with pytest.raises(ConfigError):
        plan_slice(0, 4)
