"""deploy/: the KubeRay RayJob manifest and the container file, checked without Kubernetes
or a container runtime (none can run here: no container registry is reachable for the base
image, so no image is built):

- the manifest validates against KubeRay 1.2's RayJob schema (tests/data/, its source
  cited there), every pod mounts a memory-backed /dev/shm, and its rayVersion is the Ray
  the image installs;
- its entrypoint is a `sweeper run` command line our own parser accepts, naming a space
  file the image holds and `sweeper run` validates;
- the Dockerfile's steps are checked (dependencies installed from pyproject.toml before the
  code is copied, every COPY source present and not excluded by .dockerignore, no git
  without .git) and, in CI (`ci_slow`), executed one by one into a virtual environment.

Each check is also run on a broken copy of the file it checks, so it is seen to fail.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

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
    assert re.search(r'python requirements\.py "\$\{EXTRAS\}"', dockerfile)
    # the manifest's pods use GPUs: the image named there is built with the cuda extra
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"].endswith("-cuda") and "cuda" in extras
    gpus = [w["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            for w in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    space = yaml.safe_load((ROOT / entrypoint_args(rayjob)[1][len(APP) + 1:]).read_text())
    assert all(int(g) == space["resources"]["GPU"] for g in gpus)   # one trial worker per pod
    assert "wget" in dockerfile                        # KubeRay's health probes call it


# ----------------------------------------------------------------- the manifest vs KubeRay
SCHEMA = ROOT / "tests" / "data" / "kuberay-rayjob-v1-schema.yaml"   # KubeRay 1.2, cited there


def pod_templates(rayjob) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{w["groupName"]: w["template"] for w in cluster["workerGroupSpecs"]}}


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))


def manifest_problems(rayjob: dict, dockerfile: str) -> list[str]:
    """Schema errors against the KubeRay 1.2 RayJob CRD, pods without a memory-backed
    /dev/shm, and a rayVersion that is not the Ray the image installs."""
    schema = yaml.safe_load(SCHEMA.read_text())
    problems = [f"{'.'.join(map(str, e.absolute_path)) or 'RayJob'}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(rayjob)]
    if problems:
        return problems
    for group, template in pod_templates(rayjob).items():
        spec = template["spec"]
        memory = {v["name"] for v in spec.get("volumes", [])
                  if (v.get("emptyDir") or {}).get("medium") == "Memory"}
        for container in spec["containers"]:
            if not any(m["mountPath"] == "/dev/shm" and m["name"] in memory
                       for m in container.get("volumeMounts", [])):
                problems.append(f"{group}/{container['name']}: no emptyDir (medium: Memory) "
                                "mounted at /dev/shm (Ray's object store)")
    ray_version = rayjob["spec"]["rayClusterSpec"].get("rayVersion")
    if ray_version != dockerfile_args(dockerfile).get("RAY_VERSION"):
        problems.append(f"rayVersion {ray_version!r} is not the image's RAY_VERSION "
                        f"{dockerfile_args(dockerfile).get('RAY_VERSION')!r}")
    return problems


def test_manifest_validates_against_the_kuberay_schema(rayjob, dockerfile):
    assert manifest_problems(rayjob, dockerfile) == []
    assert re.search(r"KubeRay (operator )?>= 1\.2", (DEPLOY / "rayjob.yaml").read_text())


def _head(doc) -> dict:
    return doc["spec"]["rayClusterSpec"]["headGroupSpec"]


def _worker(doc) -> dict:
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _broken(rayjob, change) -> dict:
    doc = copy.deepcopy(rayjob)
    change(doc)
    return doc


@pytest.mark.parametrize("what, change, says", [
    ("a field KubeRay 1.2 does not have", lambda d: d["spec"].update(deletionPolicy="DeleteNone"),
     "Additional properties are not allowed ('deletionPolicy'"),
    ("a rayStartParams value that is not a string",
     lambda d: _head(d)["rayStartParams"].update({"num-cpus": 0}),
     "0 is not of type 'string'"),
    ("a worker group without minReplicas",
     lambda d: _worker(d).pop("minReplicas"),
     "'minReplicas' is a required property"),
    ("a memory quantity that is not one", lambda d: _worker(d)["template"]["spec"]["containers"][0]
     ["resources"]["limits"].update(memory="200 GB"),
     "does not match"),
    ("a GPU worker without /dev/shm",
     lambda d: _worker(d)["template"]["spec"].pop("volumes"),
     "no emptyDir (medium: Memory) mounted at /dev/shm"),
    ("another Ray than the image's",
     lambda d: d["spec"]["rayClusterSpec"].update(rayVersion="2.59.0"), "RAY_VERSION"),
])
def test_manifest_check_fails_on_a_broken_manifest(rayjob, dockerfile, what, change, says):
    problems = manifest_problems(_broken(rayjob, change), dockerfile)
    assert any(says in p for p in problems), (what, problems)


def test_image_ray_is_inside_the_project_ray_range(dockerfile):
    ray_version = dockerfile_args(dockerfile)["RAY_VERSION"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (ray,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "ray"]
    assert ray.specifier.contains(ray_version), (str(ray), ray_version)


# ----------------------------------------------------------------- the Dockerfile's steps
def dockerfile_steps(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    steps, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            steps.append((word.upper(), rest.strip()))
            current = ""
    return steps


def dockerignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p)
               or (p.startswith("**/") and any(fnmatch.fnmatch(x, p[3:]) for x in parts))
               for p in patterns)


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def dockerfile_problems(text: str, ignored: list[str]) -> list[str]:
    """What would make the image wrong or its dependency layer rebuild on every code edit."""
    problems = []
    steps = dockerfile_steps(text)
    installs = [i for i, (op, arg) in enumerate(steps) if op == "RUN" and "pip install" in arg]
    if not installs:
        return ["no RUN pip install"]
    first_install = installs[0]
    for i, (op, arg) in enumerate(steps):
        if op != "COPY":
            continue
        *sources, _dest = shlex.split(arg)
        for source in sources:
            if source != "." and not (ROOT / source).exists():
                problems.append(f"COPY {source}: not in the repository")
            elif source != "." and dockerignored(source, ignored):
                problems.append(f"COPY {source}: excluded by .dockerignore")
            is_code = source == "." or (ROOT / source).is_dir() or source.endswith(".py") and \
                not source.startswith("deploy/")
            if i < first_install and is_code:
                problems.append(f"COPY {source} before the dependencies are installed: every "
                                "code edit would reinstall them")
    if not any(op == "COPY" and i > first_install for i, (op, _) in enumerate(steps)):
        problems.append("the code is not copied after the dependency layer")
    apt = " ".join(arg for op, arg in steps if op == "RUN" and "apt-get install" in arg)
    if re.search(r"\bgit\b", apt) and ".git" in ignored:
        problems.append("git is installed but .dockerignore drops .git: it has nothing to read")
    return problems


def test_dockerfile_installs_dependencies_before_the_code(dockerfile):
    assert dockerfile_problems(dockerfile, dockerignore_patterns()) == []


@pytest.mark.parametrize("what, edit, says", [
    ("the code copied before pip install",
     lambda t: t.replace("COPY pyproject.toml deploy/requirements.py ./",
                         "COPY pyproject.toml deploy/requirements.py ./\nCOPY sweeper/ sweeper/"),
     "COPY sweeper/ before the dependencies"),
    ("the old Dockerfile's order", lambda t: t.replace(
        "COPY pyproject.toml deploy/requirements.py ./", "COPY . ."), "COPY . before"),
    ("a file that is not there", lambda t: t.replace("deploy/requirements.py", "deploy/reqs.py"),
     "COPY deploy/reqs.py: not in the repository"),
    ("git without .git", lambda t: t.replace("no-install-recommends wget",
                                             "no-install-recommends wget git"), "git is installed"),
])
def test_dockerfile_check_fails_on_a_broken_dockerfile(dockerfile, what, edit, says):
    broken = edit(dockerfile)
    assert broken != dockerfile
    problems = dockerfile_problems(broken, dockerignore_patterns())
    assert any(says in p for p in problems), (what, problems)


def _context_copy(dest: Path) -> Path:
    """The build context as Docker sends it: the files of a fresh clone (tracked, or new and
    not ignored by git) less what .dockerignore drops."""
    ignored = dockerignore_patterns()
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file() and not dockerignored(name, ignored):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.ci_slow
@pytest.mark.timeout(1800)
def test_dockerfile_steps_build_a_working_environment(tmp_path, dockerfile, rayjob):
    """The image's steps, one by one, on this machine: WORKDIR /app is a folder here, COPY
    copies from the build context, RUN runs in bash with the ARG defaults, and `python`/`pip`
    are a fresh virtual environment's (apt-get steps are skipped: system packages). `pip
    install` is run as `uv pip install` (the same requirements from the same index, in a
    fraction of the time; docs/installing.md; bytecode is compiled as modules are imported). Then the image's CMD and
    the manifest's entrypoint space, and the Ray version KubeRay is told."""
    context = _context_copy(tmp_path / "context")
    app = tmp_path / "app"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv (the test extra) is needed to run the image's pip steps here"
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "pip").write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        "args = [a for a in sys.argv[1:] if a != '--no-cache-dir']\n"
        "assert args[:1] == ['install'], args\n"
        f"os.execv({uv!r}, [{uv!r}, 'pip', 'install', '--python', "
        f"{str(venv / 'bin' / 'python')!r}, *args[1:]])\n")
    (shims / "pip").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env["PATH"] = f"{shims}{os.pathsep}{venv / 'bin'}{os.pathsep}{env['PATH']}"
    workdir = tmp_path
    ran = []
    for op, arg in dockerfile_steps(dockerfile):
        if op == "ARG":
            name, _, default = arg.partition("=")
            env.setdefault(name, default)
        elif op == "ENV":
            name, _, value = arg.partition("=")
            env[name] = value
        elif op == "WORKDIR":
            assert arg == APP
            workdir = app
            workdir.mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *sources, dest = shlex.split(arg)
            target = workdir / dest
            for source in sources:
                origin = context / source
                if origin.is_dir():
                    shutil.copytree(origin, target if source == "." else target / origin.name,
                                    dirs_exist_ok=True)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
        elif op == "RUN" and "apt-get" not in arg:
            done = subprocess.run(["bash", "-ec", arg], cwd=workdir, env=env, capture_output=True,
                                  text=True, timeout=1200)
            assert done.returncode == 0, (arg, (done.stdout + done.stderr)[-3000:])
            ran.append(arg)
    assert len(ran) == 2                         # the dependency layer and the project's

    python = venv / "bin" / "python"
    version = subprocess.run([str(python), "-c", "import ray; print(ray.__version__)"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert version == rayjob["spec"]["rayClusterSpec"]["rayVersion"]
    cmd = subprocess.run(["sweeper", "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cmd.returncode == 0 and "run" in cmd.stdout
    # the entrypoint's space, at its path in the image; --address where nothing answers:
    # a valid space gets as far as the --address check (exit 2)
    space = entrypoint_args(rayjob)[1].replace(APP, str(app), 1)
    run = subprocess.run(["sweeper", "run", space, "--address", "127.0.0.1:1"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--address" in run.stderr, run.stderr[-2000:]
    # installed, not run from the folder: the package is in the environment
    where = subprocess.run([str(python), "-c", "import sweeper; print(sweeper.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv)
