"""The project as a user installs it (issue 24): the wheel and the sdist, what they hold, the
dependency ranges, and a fresh virtual environment with nothing but the wheel that runs a
shipped search space by name from another directory and writes its report.

The last test builds and installs for real (minutes): it is `ci_slow`. The others read
pyproject.toml and the checkout, and run `sweeper` in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from sweeper import installed_version, paths
from sweeper.cli import main
from sweeper.tracking.mlflow_log import git_revision

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
TOP_LEVEL = {"sweeper", "workloads"}


def _package_dir(name: str) -> Path:
    mapped = SETUPTOOLS.get("package-dir", {})
    return ROOT / (mapped[name] if name in mapped else name.replace(".", "/"))


# ----------------------------------------------------------------- pyproject.toml
def test_every_folder_of_code_and_data_is_a_listed_package():
    """setuptools warns ("Package 'sweeper.dashboards' is absent from the packages
    configuration") and, in a later release, drops any folder of the tree that is not listed:
    a new subpackage must be added to pyproject.toml's list."""
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for top in TOP_LEVEL:
        for folder in [ROOT / top, *(ROOT / top).rglob("*")]:
            if folder.is_dir() and folder.name != "__pycache__" and any(
                    f.is_file() and f.suffix in (".py", ".j2", ".yaml") for f in folder.iterdir()):
                found.add(".".join(folder.relative_to(ROOT).parts))
    assert found - listed == set(), "folders of code or data missing from pyproject's packages"
    assert all(_package_dir(name).is_dir() for name in listed)
    assert {name.split(".")[0] for name in listed} == TOP_LEVEL
    # the shipped spaces: the repository's search_spaces/, installed as sweeper/search_spaces
    assert _package_dir("sweeper.search_spaces") == ROOT / "search_spaces"
    # with the model config.json files a shipped space names beside it (search_spaces/moe.yaml)
    assert SETUPTOOLS["package-data"]["sweeper.search_spaces"] == ["*.yaml", "*.json"]
    for space in (ROOT / "search_spaces").glob("*.yaml"):
        model = yaml.safe_load(space.read_text()).get("model")
        if isinstance(model, str) and model.endswith(".json"):
            assert (space.parent / model).parent == ROOT / "search_spaces"
            assert (space.parent / model).is_file()


def test_license_and_its_build_system_floor():
    """An SPDX `license` string and `license-files` (PEP 639) need setuptools >= 77: an older
    one stops with "`project.license` must be valid exactly by one definition"."""
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text          # the whole text, not a stub
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]
                     if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.1") and setuptools.specifier.contains("77.0")


def _requirements() -> dict[str, list[Requirement]]:
    project = PYPROJECT["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


@pytest.mark.parametrize("name, private_api", [
    ("ray", "ray._private.utils.set_sigterm_handler (sweeper/sweep/controller.py)"),
    ("jax", "jax._src.distributed (sweeper/sweep/workers.py)"),
])
def test_private_apis_have_an_upper_bound_the_installed_release_meets(name, private_api):
    """Where the code reaches into a private module every requirement of the package has an
    upper bound, and the release installed here (the one the tests ran on) is inside it: a
    newer installed release fails this test until its bound is raised on purpose."""
    installed = Version(__import__(name).__version__)
    reqs = [r for group in _requirements().values() for r in group if r.name == name]
    assert reqs
    for req in reqs:
        assert any(s.operator in ("<", "<=", "~=") for s in req.specifier), (req, private_api)
        assert req.specifier.contains(installed), (str(req), str(installed))


def test_dependencies_are_ranges_not_pins():
    for group, reqs in _requirements().items():
        for req in reqs:
            assert not any(s.operator in ("==", "===") for s in req.specifier), (group, str(req))
            assert any(s.operator in (">=", "~=") for s in req.specifier), (group, str(req))


# ----------------------------------------------------------------- shipped search spaces
def test_shipped_space_runs_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shipped = paths.shipped_spaces()
    assert set(shipped) == {f.stem for f in (ROOT / "search_spaces").glob("*.yaml")}
    assert Path(paths.resolve_space("quickstart")) == ROOT / "search_spaces" / "quickstart.yaml"
    # a file here wins over a shipped name
    (tmp_path / "quickstart").write_text("name: mine\n")
    assert paths.resolve_space("quickstart") == "quickstart"
    # an unknown name, or the checkout's path from elsewhere: one line, exit 2, before Ray
    for arg, says in (("nosuch", "the name of a shipped space (attention-context, calibration"),
                      ("search_spaces/decode-layouts.yaml", "sweeper run decode-layouts")):
        assert main(["run", arg]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_examples_lists_every_shipped_space_on_one_line(capsys):
    assert main(["examples"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in paths.shipped_spaces():
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        assert len(line.split()) > 3            # the name and its description
    assert main(["examples", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["spaces"]
    assert [s["name"] for s in listed] == list(paths.shipped_spaces())
    assert main(["examples", "quickstart"]) == 0
    assert capsys.readouterr().out == (ROOT / "search_spaces" / "quickstart.yaml").read_text()
    assert main(["examples", "nosuch"]) == 2


def test_version_is_recorded_and_git_revision_only_for_this_checkout(tmp_path):
    assert installed_version() == PYPROJECT["project"]["version"]
    # a folder inside some other repository (site-packages of a venv in a user's project)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "site-packages").mkdir()
    assert git_revision(tmp_path / "site-packages") == "unknown"
    assert git_revision(tmp_path) == "unknown"          # a repository, not this project


# ----------------------------------------------------------------- the wheel, for real
def _checkout_copy(dest: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored), as a fresh clone has."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE", "RAY_AUTH_MODE")}
    return {**env, **extra}


@pytest.mark.slow
@pytest.mark.ci_slow
@pytest.mark.timeout(1800)
def test_wheel_in_a_fresh_venv_runs_quickstart_from_another_directory(tmp_path):
    """Done-when of issue 24: build the sdist and, from it, the wheel (no packaging
    warning); a fresh virtual environment with nothing but the wheel and its dependencies
    runs `sweeper run quickstart` (two trials) from another directory and writes its report.

    Dependencies are installed with uv (`uv pip install --compile-bytecode`, like pip's
    default of compiling): from its cache when this machine has run the test before, else
    from the package index, in seconds to a couple of minutes instead of pip's ~4-5 min
    for jax, ray and mlflow (docs/installing.md). Without uv, pip does it, slower."""
    src = _checkout_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)],
                           capture_output=True, text=True, env=_clean_env(), timeout=900)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-3000:]
    # pip's own notes about this machine's package-index settings are not packaging warnings
    warnings = [line for line in output.splitlines() if "warn" in line.lower()
                and "is ignored: it is neither a file nor a directory" not in line]
    assert warnings == [], warnings[:10]

    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    import tarfile
    with tarfile.open(sdist) as tar:
        in_sdist = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    assert {"LICENSE", "pyproject.toml", "search_spaces/quickstart.yaml"} <= in_sdist
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == TOP_LEVEL
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    shipped = {f"sweeper/search_spaces/{f.name}" for f in (ROOT / "search_spaces").glob("*.yaml")}
    assert shipped | {"sweeper/dashboards/report.html.j2"} <= set(names)
    code = {f.relative_to(ROOT).as_posix() for top in TOP_LEVEL for f in (ROOT / top).rglob("*.py")
            if (src / f.relative_to(ROOT)).is_file()}
    assert code - set(names) == set(), "code files the wheel left out"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    install = ([uv, "pip", "install", "--compile-bytecode", "--python", str(python), str(wheel)]
               if uv else [str(python), "-m", "pip", "install", str(wheel)])
    done = subprocess.run(install, capture_output=True, text=True, env=_clean_env(), timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    elsewhere, home = tmp_path / "elsewhere", tmp_path / "home"
    elsewhere.mkdir()
    env = _clean_env(SWEEPER_HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def sweeper(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "sweeper"), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=timeout)

    listed = sweeper("examples", "--json")
    assert listed.returncode == 0, listed.stderr
    listing = json.loads(listed.stdout)
    assert Path(listing["folder"]).is_relative_to(venv)        # package data, not the checkout
    assert {s["name"] for s in listing["spaces"]} == {Path(n).stem for n in shipped}

    run = sweeper("run", "quickstart", "--set", "trials=2", "--set", "parallel=1", "--json",
                  "--no-analysis")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Token authentication" not in run.stderr       # Ray's notice (sweeper/sweep/session.py)
    result = json.loads(run.stdout)
    study = result["study"]
    assert study.startswith("quickstart-")
    assert result["trials_complete"] == 2, result
    assert not (elsewhere / ".sweeper").exists()          # everything went to $SWEEPER_HOME

    report = sweeper("report", "--study", study, "--out", str(tmp_path / "report"), "--json")
    assert report.returncode == 0, report.stderr[-3000:]
    html = (tmp_path / "report" / "report.html").read_text()
    assert study in html and "<html" in html.lower()

    # the run's record: the installed version, no revision. Read with the fresh venv's own
    # MLflow: the store's schema is that version's, which may be newer than this process's
    read = subprocess.run([str(python), "-c", "import json, sys; from mlflow import MlflowClient; "
                           "print(json.dumps(MlflowClient(sys.argv[1]).get_run(sys.argv[2])"
                           ".data.tags))", result["tracking_uri"], result["parent_run_id"]],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    tags = json.loads(read.stdout.strip().splitlines()[-1])
    assert tags["sweeper_version"] == PYPROJECT["project"]["version"]
    assert tags["git_revision"] == "unknown"


def test_ray_token_notice_is_silenced_only_for_a_local_cluster(monkeypatch):
    """Ray 2.60 warns on every new local cluster when RAY_AUTH_MODE is unset (the ci_slow test
    above checks the notice is gone from a real run); naming `token`, Ray's own default
    there, silences it. A cluster given by address, and a mode the user chose, are untouched."""
    from sweeper.sweep.session import quiet_ray_auth_notice

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "ray" in sys.modules:       # Ray reads the mode when imported: an imported Ray is left alone
        monkeypatch.setitem(sys.modules, "ray", sys.modules["ray"])
        quiet_ray_auth_notice(None)
        assert "RAY_AUTH_MODE" not in os.environ
        monkeypatch.delitem(sys.modules, "ray")
    quiet_ray_auth_notice("10.0.0.1:6379")
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    quiet_ray_auth_notice(None)
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.delenv("RAY_ADDRESS")
    quiet_ray_auth_notice(None)
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    quiet_ray_auth_notice(None)
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
