"""deploy/: the KubeRay RayJob manifest and the container file, checked without Kubernetes
or a container runtime (none here): the manifest is a RayJob with the fields KubeRay needs,
its entrypoint is a `sweeper run` command line our own parser accepts, naming a space file
the image holds and `sweeper run` validates, and the image installs the package with the
extras the manifest relies on.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
APP = "/app"          # where deploy/Dockerfile puts the project in the image


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return yaml.safe_load((DEPLOY / "rayjob.yaml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def entrypoint_args(rayjob) -> list[str]:
    words = shlex.split(rayjob["spec"]["entrypoint"])
    assert words[0] == "sweeper", words
    return words[1:]


def test_manifest_is_a_rayjob_with_a_head_and_workers(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert rayjob["metadata"]["name"]
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] and cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    workers = cluster["workerGroupSpecs"]
    assert workers and all(w["replicas"] >= 1 and w["groupName"] for w in workers)
    for group in workers:
        container = group["template"]["spec"]["containers"][0]
        assert container["image"] == head["image"]           # one image for the cluster
    # the driver runs on the head: the store password must be in its environment
    assert "PGPASSWORD" in {e["name"] for e in head.get("env", [])}


def test_entrypoint_is_a_valid_sweeper_command_line(rayjob):
    from sweeper.cli import build_parser

    args = build_parser().parse_args(entrypoint_args(rayjob))   # exits 2 on a bad flag
    assert args.command == "run" and args.address == "auto"
    assert args.storage.startswith("postgresql://") and args.tracking_uri.startswith("postgresql://")


def test_entrypoint_space_is_in_the_image_and_valid(rayjob, dockerfile):
    args = entrypoint_args(rayjob)
    space = args[1]
    assert space.startswith(f"{APP}/") and f"WORKDIR {APP}" in dockerfile
    local = ROOT / space[len(APP) + 1:]
    assert local.is_file(), f"{space}: no {local.relative_to(ROOT)} in the project"
    # `sweeper run` validates the space before it looks for a cluster: with an address
    # nothing answers at, a valid space gets as far as the --address check (exit 2).
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "run", str(local),
                           "--address", "127.0.0.1:1"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "--address" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_dockerfile_installs_the_extras_the_manifest_needs(rayjob, dockerfile):
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    default = re.search(r"^ARG EXTRAS=(\S+)", dockerfile, re.M).group(1).split(",")
    assert "postgres" in default and set(default) <= set(extras)
    assert re.search(r'pip install .*-e "\.\[\$\{EXTRAS\}\]"', dockerfile)
    # the manifest's pods use GPUs: the image named there is built with the cuda extra
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"].endswith("-cuda") and "cuda" in extras
    gpus = [w["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            for w in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    space = yaml.safe_load((ROOT / entrypoint_args(rayjob)[1][len(APP) + 1:]).read_text())
    assert all(int(g) == space["resources"]["GPU"] for g in gpus)   # one trial worker per pod
    assert "wget" in dockerfile                        # KubeRay's health probes call it
