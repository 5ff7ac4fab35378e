"""Bad input is rejected by the real CLI before Ray, Optuna or MLflow start.

Table-driven: malformed search spaces (`sweeper run`), trial files (`sweeper trial
--config`) and command-line arguments. Every case runs `sweeper` as a subprocess and must
exit 2 with ONE line on stderr that names the file (for a file), the field, the value and
what is accepted; no traceback; nothing on stdout; no store created ($SWEEPER_HOME stays
absent, an explicit --storage file is not created); and neither JAX, Ray nor MLflow was
imported. Each process takes a fraction of a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SWEEPER = Path(sys.executable).parent / "sweeper"
HEAVY = ("jax", "ray", "mlflow")

# Runs `sweeper.cli.main` exactly as the console script does, then writes which heavy
# packages the process imported to the file named by SWEEPER_TEST_IMPORTS.
WRAPPER = """
import json, os, sys
from sweeper.cli import main
code = 1
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
finally:
    loaded = sorted({m.split('.')[0] for m in sys.modules} & set(%r))
    with open(os.environ['SWEEPER_TEST_IMPORTS'], 'w') as f:
        json.dump(loaded, f)
sys.exit(code)
""" % (HEAVY,)

SPACE = {"name": "bad", "model": "tiny", "hardware": "host", "chips": 2, "batch": 4,
         "params": {"decode_ffn": ["ws1d", "ws2d"]}, "trials": 4}
TRIAL = {"model": "tiny", "chips": 2, "batch": 4, "input_len": 8, "decode_steps": 2}


def space(**changes) -> dict:
    data = {**SPACE, **changes}
    return {k: v for k, v in data.items() if v is not None}


def trial(**changes) -> dict:
    data = {**TRIAL, **changes}
    return {k: v for k, v in data.items() if v is not None}


# 5.7 MiB (issue 23: a 5-16 MB space file took ~90 s and 1.9 GB to refuse)
TOO_LARGE = "name: big\nparams: [unclosed\n" + "# padding\n" * 600_000

# (case id, command, file contents (dict -> YAML, str -> as is, None -> no file), what the
#  one line must contain besides the file name)
CASES = [
    # --- search spaces: sweeper run SPACE
    ("space-invalid-yaml", "run", "name: bad\nparams: {batch: [1, 2\n", ["line", "valid YAML"]),
    ("space-unknown-key", "run", space(bach=4), ["bach", "did you mean 'batch'"]),
    ("space-unknown-param", "run", space(params={"bacth": [1, 2]}), ["params", "did you mean 'batch'"]),
    ("space-wrong-type", "run", space(parallel="two"), ["parallel", "'two'", "integer >= 1"]),
    ("space-zero-batch", "run", space(batch=0), ["batch", "got 0", "integer >= 1"]),
    ("space-negative-batch", "run", space(batch=-4), ["batch", "got -4", "integer >= 1"]),
    ("space-negative-batch-choice", "run", space(batch=None, params={"batch": [4, -8]}),
     ["params.batch.choices", "-8", "integer >= 1"]),
    ("space-unknown-layout", "run", space(decode={"ffn": "ws3d"}), ["decode.ffn", "'ws3d'", "ws2d"]),
    ("space-unknown-layout-choice", "run", space(params={"decode_ffn": ["ws3d"]}),
     ["params.decode_ffn.choices", "'ws3d'", "did you mean 'ws2d'"]),
    ("space-topology-product", "run", space(chips=4, topology="2x2x2"),
     ["topology", "'2x2x2'", "X*Y*Z equal to chips=4"]),
    ("space-batch-not-divisible", "run", space(chips=4, batch=2, params=None,
                                               decode={"attn": "batch"}),
     ["batch", "got 2", "multiple of chips=4", "no point of this space can run"]),
    ("space-unknown-model", "run", space(model="tiyn"), ["model", "'tiyn'", "did you mean 'tiny'"]),
    ("space-unknown-hardware", "run", space(hardware="analytical:tpu-v9"),
     ["hardware", "tpu-v9", "did you mean"]),
    ("space-unknown-objective", "run", space(objectives=[{"metric": "decode_latency_s"}]),
     ["objectives[0].metric", "'decode_latency_s'", "numeric Measurement field"]),
    ("space-empty-choices", "run", space(params={"decode_ffn": []}),
     ["params.decode_ffn.choices", "[]", "non-empty list"]),
    ("space-bad-constraint", "run", space(constraints=["decode_step_s < fast"]),
     ["constraints[0].bound", "'fast'", "number"]),
    ("space-negative-resources", "run", space(resources={"TPU": -4}), ["resources.TPU", "-4", ">= 0"]),
    ("space-missing-file", "run", None, ["file", "an existing YAML file"]),
    # refused by its size before it is parsed (the unclosed list would be a YAML error)
    ("space-too-large", "run", TOO_LARGE, ["file", "at most 256 KiB", f"{len(TOO_LARGE):,} bytes"]),
    ("space-serving-not-a-mapping", "run", space(serving="fast"), ["serving", "'fast'", "a mapping"]),
    ("space-negative-seed-range", "run", space(params={"seed": {"low": -1, "high": 2}}),
     ["params.seed.low", "got -1", "integer >= 0"]),
    # --- trial files: sweeper trial --config TRIAL
    ("trial-invalid-yaml", "trial", "model: tiny\nchips: [2\n", ["line", "valid YAML"]),
    ("trial-unknown-key", "trial", trial(bacth=4), ["bacth", "did you mean 'batch'"]),
    ("trial-wrong-type", "trial", trial(chips="two"), ["chips", "'two'", "integer >= 1"]),
    ("trial-zero-batch", "trial", trial(batch=0), ["batch", "got 0", "integer >= 1"]),
    ("trial-negative-batch", "trial", trial(batch=-1), ["batch", "got -1", "integer >= 1"]),
    ("trial-unknown-layout", "trial", trial(prefill={"ffn": "wg_q"}), ["prefill.ffn", "'wg_q'", "wg_xyz"]),
    ("trial-topology-product", "trial", trial(chips=4, topology="2x2x2"),
     ["topology", "X*Y*Z equal to chips=4"]),
    ("trial-batch-not-divisible", "trial", trial(chips=4, batch=2, decode={"attn": "batch"}),
     ["batch", "got 2", "multiple of chips=4"]),
    ("trial-unknown-model", "trial", trial(model="palm-8"), ["model", "'palm-8'", "did you mean"]),
    ("trial-missing-file", "trial", None, ["file", "an existing YAML file"]),
    ("trial-negative-decode-steps", "trial", trial(decode_steps=-1),
     ["decode_steps", "got -1", "integer >= 0"]),
]

GOOD_SPACE = space()
# (case id, extra arguments after `sweeper run GOOD_SPACE`, what the line must contain)
ARG_CASES = [
    ("args-zero-trials", ["--trials", "0"], ["--trials", "got 0", "positive integer"]),
    ("args-negative-parallel", ["--parallel", "-2"], ["--parallel", "got -2", "positive integer"]),
    ("args-trials-not-int", ["--trials", "many"], ["--trials", "invalid int value", "'many'"]),
    ("args-unknown-option", ["--trails", "3"], ["unrecognized arguments", "--trails"]),
    ("args-bad-address", ["--address", "headnode"], ["--address", "'headnode'", "HOST:PORT"]),
    ("args-dead-address", ["--address", "127.0.0.1:9"], ["--address", "127.0.0.1:9",
                                                         "nothing answers there"]),
    ("args-bad-storage", ["--storage", "optuna.db"], ["--storage", "'optuna.db'", "sqlite:///"]),
    ("args-bad-tracking-uri", ["--tracking-uri", "ftp://host/x"], ["--tracking-uri", "ftp://host/x",
                                                                   "http://mlflow-server:5000"]),
    ("args-empty-study", ["--study", " "], ["--study", "a study name of at most 100"]),
]


def run_cli(args: list[str], home: Path, imports_file: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWEEPER_HOME": str(home), "SWEEPER_TEST_IMPORTS": str(imports_file)}
    return subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=home.parent)


def check_rejected(proc: subprocess.CompletedProcess, home: Path, imports_file: Path,
                   expected: list[str], file_name: str | None) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("sweeper") and "Traceback" not in proc.stderr, line
    assert proc.stdout == "", proc.stdout
    if file_name is not None:
        assert file_name in line, line
    for text in expected:
        assert text in line, (text, line)
    assert not home.exists(), "a store was created"
    imported = json.loads(imports_file.read_text())
    assert imported == [], f"imported before rejecting: {imported}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case once (a few at a time: each is a short-lived process)."""
    base = tmp_path_factory.mktemp("bad_input")
    jobs = {}
    for case_id, command, contents, _ in CASES:
        folder = base / case_id
        folder.mkdir()
        path = folder / ("space.yaml" if command == "run" else "trial.yaml")
        if contents is not None:
            path.write_text(contents if isinstance(contents, str) else yaml.safe_dump(contents))
        argv = ["run", str(path)] if command == "run" else ["trial", "--config", str(path)]
        jobs[case_id] = (argv, folder / "home", folder / "imports.json", path.name)
    good = base / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD_SPACE))
    for case_id, extra, _ in ARG_CASES:
        folder = base / case_id
        folder.mkdir()
        jobs[case_id] = (["run", str(good), *extra], folder / "home", folder / "imports.json", None)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case_id: pool.submit(run_cli, argv, home, imports)
                   for case_id, (argv, home, imports, _) in jobs.items()}
        return {case_id: (futures[case_id].result(), *jobs[case_id][1:]) for case_id in jobs}


@pytest.mark.parametrize("case_id, expected", [(c[0], c[3]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_file_exits_2_with_one_line_before_anything_starts(outcomes, case_id, expected):
    proc, home, imports_file, file_name = outcomes[case_id]
    check_rejected(proc, home, imports_file, expected, file_name)


@pytest.mark.parametrize("case_id, expected", [(c[0], c[2]) for c in ARG_CASES],
                         ids=[c[0] for c in ARG_CASES])
def test_bad_argument_exits_2_with_one_line_before_anything_starts(outcomes, case_id, expected):
    proc, home, imports_file, _ = outcomes[case_id]
    check_rejected(proc, home, imports_file, expected, None)


def test_resume_of_an_unknown_study_creates_no_store(tmp_path):
    space_file = tmp_path / "good.yaml"
    space_file.write_text(yaml.safe_dump(GOOD_SPACE))
    storage = tmp_path / "stores" / "optuna.db"
    home = tmp_path / "home"
    proc = run_cli(["run", str(space_file), "--study", "nope", "--resume", "--storage",
                    f"sqlite:///{storage}"], home, tmp_path / "imports.json")
    check_rejected(proc, home, tmp_path / "imports.json", ["--study", "'nope'", "existing study"],
                   None)
    assert not storage.exists() and not storage.parent.exists()


def test_sync_of_an_unknown_study_creates_no_store(tmp_path):
    home = tmp_path / "home"
    proc = run_cli(["sync", "--study", "nope"], home, tmp_path / "imports.json")
    check_rejected(proc, home, tmp_path / "imports.json", ["--storage", "no such file"], None)


def test_the_console_script_reports_the_same_line(tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text(yaml.safe_dump(space(params={"decode_ffn": ["ws3d"]})))
    proc = subprocess.run([str(SWEEPER), "run", str(bad)], capture_output=True, text=True,
                          env={**os.environ, "SWEEPER_HOME": str(tmp_path / "home")}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"sweeper run: error: {bad}: params.decode_ffn.choices: got 'ws3d'")
    assert not (tmp_path / "home").exists()
