"""`sweeper serve` when things fail, for real (issue 36; docs/reliability.md "Serving").

- Hostile plans and flags (a batch of 10^9, 100 replicas, 128 emulated chips, a deployment
  that does not fit in memory, `format: sweeper-plan/99`, a 100,000-deep or a 5 MiB JSON
  file, `--requests 10^9`, `sweeper plan --requests 10^9`): exit 2 and one line naming the
  bound, through the real CLI in its own process, before JAX, Ray or MLflow is imported.
  The advice of the format refusal (`sweeper plan --out` makes a plan this sweeper reads)
  is run.
- A real stream on real Ray workers (the tiny model, 1 emulated chip per worker), then a
  real fault: SIGKILL of a worker's pid (aggregated; disaggregated, decode side and prefill
  side), SIGTERM and SIGINT to the `sweeper serve` process. Each ends with one line on
  stderr naming the phase, the worker and its pid (or the signal), exit 1 / 143 / 130,
  the requests that completed printed ("of N completed") and logged to a real MLflow store
  (FAILED / KILLED, with the reason), no Ray process left, and the stream ended before its
  last arrival (the loss was seen mid-stream, not at its end). While the stream runs,
  `ss` lists every listening socket of the command's processes on the loopback.
- In a `sweeper run` of disaggregated serving trials, the decode slice's worker SIGKILLed
  mid-stream fails that trial with the reason, and the sweep goes on.

The real runs start Ray and compile (about 30-60 s each on 2 loaded cores): `ci_slow`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from requires import require
from test_bad_input import check_rejected, run_cli

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
# a fixed profile: no test measures this host (the prediction is not what is checked here)
HARDWARE = {"name": "test-host", "peak_flops": 9e10, "hbm_bandwidth": 6e9, "hbm_bytes": 2.5e10,
            "ici_bandwidth": 1e9, "measured": True}
RATE, REQUESTS = 4, 80          # a 20 s stream: the fault lands in its middle
STARTED = re.compile(r"^sweeper serve: serving (\d+) requests \((.*)\)$")


def plan(tmp_path: Path, mode: str = "aggregated", replicas: int = 1, name: str = "plan",
         **changes) -> Path:
    part = {"chips": 1, "replicas": replicas, "ffn": "ws1d", "attn": "head", "batch": 2,
            "weights": "bf16"}
    data = {"format": "sweeper-plan/1",
            "deployment": {"model": "tiny", "hardware": HARDWARE, "mode": mode,
                           "prefill": {**part, "batch": 1}, "decode": dict(part)},
            "profile": {"rate": RATE, "input_len": 8, "output_len": 6, "ttft": 1.0,
                        "tpot": 0.2}}
    for key, value in changes.items():
        phase, _, field = key.partition("__")
        if field:
            data["deployment"][phase][field] = value
        else:
            data[key] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


# ----------------------------------------------------------------------------- before Ray


def hostile(tmp_path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """case -> (the command's arguments, what its one line must name)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    deep_value = tmp_path / "deep-value.json"
    deep_value.write_text('{"deployment": {"mode": "aggregated", "model": '
                          + "[" * 900 + "]" * 900 + "}}")
    huge = tmp_path / "huge.json"
    huge.write_text('{"deployment": {"mode": "aggregated"}, "pad": "' + "x" * (5 * 2**20) + '"}')
    serve = ["serve", "--rate", "4", "--requests", "5", "--no-mlflow", "--plan"]
    fields = {"big_batch": {"decode__batch": 10**9, "prefill__batch": 10**9},
              "many_replicas": {"prefill__replicas": 100, "decode__replicas": 100},
              "many_chips": {"prefill__chips": 128, "decode__chips": 128},
              "huge_chips": {"prefill__chips": 10**6, "decode__chips": 10**6},
              "format_99": {"format": "sweeper-plan/99"},
              # 65,536 slots of 100,000 tokens: ~800 GiB of KV cache per chip
              "memory": {"decode__batch": 65536}}
    paths = {case: str(plan(tmp_path, name=case, **changes)) for case, changes in fields.items()}
    return {
        "big_batch": ([*serve, paths["big_batch"]], ["batch", "1000000000", "65,536"]),
        "many_replicas": ([*serve, paths["many_replicas"]], ["replicas", "at most 64 workers"]),
        "many_chips": ([*serve, paths["many_chips"]], ["chips", "at most 64 chips"]),
        "huge_chips": ([*serve, paths["huge_chips"]], ["chips", "4,096"]),
        "format_99": ([*serve, paths["format_99"]], ["format", "sweeper-plan/99",
                                                     "sweeper-plan/1"]),
        "memory": ([*serve, paths["memory"], "--input-len", "100000"],
                   ["decode.batch", "65536", "fits in memory", "KV cache"]),
        "deep": ([*serve, str(deep)], ["--plan", "nested at most 32 levels", "100,000"]),
        "deep_value": ([*serve, str(deep_value)], ["--plan", "nested at most 32 levels"]),
        "huge": ([*serve, str(huge)], ["--plan", "at most 4 MiB"]),
        "serve_requests": (["serve", "--plan", paths["big_batch"], "--rate", "4", "--requests",
                            "1000000000"], ["--requests", "10,000"]),
        "serve_seed": (["serve", "--plan", paths["big_batch"], "--rate", "4", "--seed",
                        str(2**40)], ["--seed", "2,147,483,647"]),
        "plan_requests": (["plan", "--model", "tiny", "--hardware", "tpu-v4", "--rate", "4",
                           "--input-len", "8", "--output-len", "4", "--ttft", "1", "--tpot",
                           "0.2", "--no-mlflow", "--requests", "1000000000"],
                          ["--requests", "20,000"]),
        "plan_max_chips": (["plan", "--model", "tiny", "--hardware", "tpu-v4", "--rate", "4",
                            "--input-len", "8", "--output-len", "4", "--ttft", "1", "--tpot",
                            "0.2", "--no-mlflow", "--max-chips", str(10**9)],
                           ["--max-chips", "65,536"]),
    }


CASES = ["big_batch", "many_replicas", "many_chips", "huge_chips", "format_99", "memory",
         "deep", "deep_value", "huge", "serve_requests", "serve_seed", "plan_requests",
         "plan_max_chips"]


@pytest.fixture(scope="module")
def rejected(tmp_path_factory):
    """Every case run once, a few at a time (each a short-lived `sweeper` process)."""
    base = tmp_path_factory.mktemp("hostile")
    cases = hostile(base)
    for case in cases:
        (base / case).mkdir()
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case: pool.submit(run_cli, args, base / case / "home",
                                     base / f"{case}.imports.json")
                   for case, (args, _) in cases.items()}
        return {case: (futures[case].result(), base / case / "home",
                       base / f"{case}.imports.json", cases[case][1]) for case in cases}


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_plan_or_flag_is_one_line_before_ray(case, rejected):
    proc, home, imports, expected = rejected[case]
    check_rejected(proc, home, imports, expected, None)


def test_a_plan_of_another_format_names_a_command_that_makes_one_this_sweeper_reads(tmp_path):
    """The refusal says to make the plan again with `sweeper plan --out`: that command's
    plan loads (docs/reliability.md: every command an error line names is run by a test)."""
    from sweeper.cli import main
    from workloads.config import ConfigError
    from workloads.deployment import PLAN_FORMAT, load_plan

    old = plan(tmp_path, format="sweeper-plan/99")
    with pytest.raises(ConfigError) as refused:
        load_plan(old)
    assert "`sweeper plan --out`" in str(refused.value)
    made = tmp_path / "made.json"
    assert main(["plan", "--model", "tiny", "--hardware", "tpu-v4", "--rate", "4",
                 "--input-len", "8", "--output-len", "4", "--ttft", "1", "--tpot", "0.2",
                 "--no-mlflow", "--out", str(made)]) == 0
    assert json.loads(made.read_text())["format"] == PLAN_FORMAT
    assert load_plan(made).model.name == "tiny"


def test_json_depth_counts_brackets_outside_strings():
    from workloads.deployment import json_depth

    assert json_depth('{"a": "[[[{", "b": [[1], [2, {"c": "\\"]]"}]]}') == 4
    assert json_depth("[]") == 1 and json_depth('"[["') == 0
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000


def test_a_stream_cut_short_is_compared_on_the_requests_that_completed(tmp_path):
    """`compare` of a stream whose last requests never completed (no worker reported them):
    measured, predicted and warm-up columns are all of the same completed requests, and the
    result says so (`percentiles_of`, `status`, `stop`, the table's label)."""
    from sweeper.serving.serve import ServeResult, Stop, compare, table
    from workloads.deployment import load_plan
    from workloads.serving.profile import AppProfile, Length, requests

    deployment = load_plan(plan(tmp_path))
    reqs = requests(AppProfile(rate=RATE, input_len=Length("fixed", 8, 8, 8),
                               output_len=Length("fixed", 6, 6, 6)), 10, 0)
    per_request = [{"tokens": [1] * 6, "first_token_s": r.arrival_s + 0.01,
                    "finish_s": r.arrival_s + 0.06} for r in reqs[:7]]
    per_request += [{"tokens": [1], "first_token_s": reqs[7].arrival_s + 0.01}, {"tokens": []},
                    {"tokens": []}]       # 7 completed; one only prefilled; two never started
    warmup = {"aggregated": {"prefill_s@8": 0.002, "decode_step_s": 0.001}}
    measured, predicted, calibrated = compare(deployment, reqs, per_request, warmup, 1.0)
    assert measured["completed"] == predicted["completed"] == calibrated["completed"] == 7
    assert measured["ttft_p50_s"] == pytest.approx(0.01)
    stop = Stop("worker_lost", "the aggregated worker 'aggregated' (pid 1) was lost mid-stream",
                worker="aggregated", phase="aggregated", pid=1)
    result = ServeResult(deployment, reqs, measured, predicted, calibrated, per_request, warmup,
                         stop=stop.to_dict())
    data = result.to_json()
    assert data["status"] == "worker_lost" and data["stop"]["pid"] == 1
    assert data["percentiles_of"] == "7 completed of 10 requests" and data["completed"] == 7
    assert "(percentiles of 7 completed of 10 requests)" in table(result)


def test_the_raylets_messages_are_kept_off_stdout(capsys):
    """Ray's driver prints the raylet's messages (a lost worker's paragraph) on stdout with
    `print_to_stdstream`; after `quiet_raylet_messages` they are kept, not printed (`--json`
    stays one JSON object)."""
    import ray._private.worker as ray_worker

    from sweeper.sweep import session

    session.quiet_raylet_messages()
    ray_worker.print_to_stdstream({"lines": ["A worker died or was killed while executing "
                                             "a task"], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    assert capsys.readouterr().out == ""
    assert session.raylet_messages[-1].startswith("A worker died")


# ----------------------------------------------------------------------------- real faults


def start_serve(plan_path: Path, home: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["SWEEPER_HOME"] = str(home)
    return subprocess.Popen([sys.executable, "-m", "sweeper.cli", "serve", "--plan",
                             str(plan_path), "--rate", str(RATE), "--requests", str(REQUESTS),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=home.parent)


RAY_DID_NOT_START = "the local Ray cluster did not start"


def serving(plan_path: Path, home: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, int],
                                                                list[str]]:
    """`sweeper serve` started and its stream begun: (the process, its workers' pids from the
    line it prints then, the stderr lines read so far). A local Ray that did not start in
    Ray's own 30 s (a loaded machine: one line, exit 3, "try again") is tried once more,
    as the line says; the faults tested here come after the stream has started."""
    for attempt in range(2):
        proc = start_serve(plan_path, home, *extra)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            found = STARTED.match(line.strip())
            if found:
                workers = dict(re.findall(r"([\w-]+) pid (\d+)", found.group(2)))
                return proc, {name: int(pid) for name, pid in workers.items()}, lines
        proc.wait(timeout=60)
        text = "".join(lines)
        if not (attempt == 0 and proc.returncode == 3 and RAY_DID_NOT_START in text):
            raise AssertionError(f"the stream never started (exit {proc.returncode}): {text[-3000:]}")
    raise AssertionError("unreachable")


def family(pid: int) -> list[psutil.Process]:
    """The process and its descendants (a local Ray cluster's processes among them)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listening(pids: set[int]) -> list[tuple[str, str, int]]:
    """(local address, process, pid) of every listening TCP/UDP socket `ss` lists for `pids`."""
    require(shutil.which("ss"), "`ss` (iproute2) lists the listening sockets")
    out = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local = fields[4]
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found.append((local, name, int(pid)))
    return found


def finish(proc: subprocess.Popen, read: list[str]) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return out, "".join(read) + err


def check_one_line(err: str, code: int, proc: subprocess.Popen, *expected: str) -> str:
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    for noise in ("Traceback", "SIGTERM received", "*** ", "(raylet)", "ActorDiedError:"):
        assert noise not in err, (noise, err[-3000:])
    last = err.strip().splitlines()[-1]
    for text in expected:
        assert text in last, (text, last)
    return last


def check_kept(home: Path, run_id: str, status: str, completed: int, stop_kind: str) -> dict:
    """The MLflow run: its status, the completed requests' metrics and the reason."""
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == status
    assert run.data.metrics["completed"] == completed
    assert run.data.tags["stop_kind"] == stop_kind and run.data.tags["stop_reason"]
    assert run.data.tags["percentiles_of"] == f"{completed} completed of {REQUESTS} requests"
    for key in ("ttft_p50_s", "tpot_p50_s", "pred_ttft_p50_s"):
        assert run.data.metrics[key] > 0, key
    return run.data.tags


def check_nothing_left(processes: list[psutil.Process]) -> None:
    """Every process the command started (its Ray cluster, its workers) is gone."""
    left = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append((proc.pid, proc.name()))
        except psutil.NoSuchProcess:
            continue
    assert not left, left


def mid_stream(proc: subprocess.Popen, after_s: float = 4.0) -> None:
    time.sleep(after_s)
    assert proc.poll() is None, "the stream ended before the fault"


@pytest.mark.ci_slow
def test_a_killed_aggregated_worker_is_one_line_and_what_completed_is_kept(tmp_path):
    """Two aggregated replicas; `ss` while they serve: every listening socket of the
    command's processes is on the loopback. Then SIGKILL of replica 1's pid: exit 1, the
    line names it; the percentiles are of the requests that completed, printed and in a
    FAILED MLflow run."""
    home = tmp_path / "home"
    proc, workers, read = serving(plan(tmp_path, replicas=2), home)
    assert set(workers) == {"aggregated", "aggregated-1"}
    everything = family(proc.pid)
    sockets = listening({p.pid for p in everything})
    assert sockets, "no listening socket found for the serve command's processes"
    assert all(local.rsplit(":", 1)[0].strip("[]") in LOOPBACK for local, _, _ in sockets), sockets
    mid_stream(proc)
    os.kill(workers["aggregated-1"], signal.SIGKILL)
    out, err = finish(proc, read)
    last = check_one_line(err, 1, proc, "sweeper serve: error: the aggregated worker "
                          f"'aggregated-1' (pid {workers['aggregated-1']}) was lost mid-stream",
                          "completed of 80 requests kept in MLflow run")
    completed = int(re.search(r"(\d+) completed of 80", last).group(1))
    assert 0 < completed < REQUESTS
    assert "(raylet)" not in out and "A worker died" not in out, out[:3000]
    assert f"percentiles of {completed} completed of {REQUESTS} requests" in out
    run_id = re.search(r"MLflow run (\w+)", last).group(1)
    tags = check_kept(home, run_id, "FAILED", completed, "worker_lost")
    assert tags["stop_worker"] == "aggregated-1" and tags["stop_pid"] == str(workers["aggregated-1"])
    check_nothing_left(everything)


def stopped_mid_stream(out_json: dict) -> None:
    """The stream ended at the fault, before its last request arrived (not at its end)."""
    from workloads.serving.profile import AppProfile, Length, requests

    reqs = requests(AppProfile(rate=RATE, input_len=Length("fixed", 8, 8, 8),
                               output_len=Length("fixed", 6, 6, 6)), REQUESTS, 0)
    assert out_json["requests"] == REQUESTS
    served = out_json["completed"]
    assert 0 < served < REQUESTS
    assert out_json["measured"]["completed"] == out_json["predicted"]["completed"] == served
    assert out_json["percentiles_of"] == f"{served} completed of {REQUESTS} requests"
    assert reqs[-1].arrival_s > 10        # (the stream is long enough to be cut)


@pytest.mark.ci_slow
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_killed_disaggregated_worker_is_seen_mid_stream(victim, tmp_path):
    """Disaggregated, `--json`: SIGKILL of the decode worker (the prefill worker's next
    handover fails and the driver sees the actor gone) or of the prefill worker. Before:
    the decode side was noticed only when the whole stream had finished, then a 30-line
    traceback; now the stream stops at once, one line, exit 1, the completed requests kept."""
    home = tmp_path / "home"
    proc, workers, read = serving(plan(tmp_path, mode="disaggregated"), home, "--json")
    assert set(workers) == {"prefill", "decode"}
    everything = family(proc.pid)
    mid_stream(proc)
    os.kill(workers[victim], signal.SIGKILL)
    out, err = finish(proc, read)
    check_one_line(err, 1, proc, f"the {victim} worker '{victim}' (pid {workers[victim]}) "
                   "was lost mid-stream")
    result = json.loads(out)
    assert result["status"] == "worker_lost"
    assert result["stop"]["phase"] == victim and result["stop"]["pid"] == workers[victim]
    stopped_mid_stream(result)
    check_kept(home, result["mlflow_run_id"], "FAILED", result["completed"], "worker_lost")
    check_nothing_left(everything)


@pytest.mark.ci_slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_stream_is_one_line_and_what_completed_is_kept(signum, code, tmp_path):
    """SIGTERM / SIGINT to `sweeper serve` mid-stream (disaggregated, `--json`): exit 143 /
    130, one line naming the signal, the completed requests in a KILLED MLflow run, no
    Ray process left. Before: exit 1 and Ray's C++ dump (`*** SIGTERM received ***`)."""
    home = tmp_path / "home"
    proc, workers, read = serving(plan(tmp_path, mode="disaggregated"), home, "--json")
    everything = family(proc.pid)
    mid_stream(proc)
    proc.send_signal(signum)
    out, err = finish(proc, read)
    name = signal.Signals(signum).name
    check_one_line(err, code, proc, f"sweeper serve: stopped by {name};",
                   "completed of 80 requests kept in MLflow run")
    result = json.loads(out)
    assert result["status"] == "signal" and result["stop"]["signal"] == name
    stopped_mid_stream(result)
    tags = check_kept(home, result["mlflow_run_id"], "KILLED", result["completed"], "signal")
    assert tags["stop_signal"] == name
    check_nothing_left(everything)


# ----------------------------------------------------------------------------- serving trials


SERVING_SWEEP = {"name": "lost", "model": "tiny", "hardware": "host", "chips": 2, "batch": 2,
                 "serving_mode": "disaggregated",
                 "serving": {"rate": 4, "requests": 60, "input_len": 8, "output_len": 4},
                 "sampler": {"type": "grid"}, "params": {"decode_attn": ["head", "batch"]},
                 "trials": 2, "parallel": 1, "timeout_s": 300}


def decode_slice_pids(root: int) -> list[int]:
    """The running `DecodeSliceWorker` processes under `root` serving a stream."""
    pids = []
    for proc in family(root):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "DecodeSliceWorker" in title:
            pids.append(proc.pid)
    return pids


@pytest.mark.ci_slow
def test_a_serving_trials_lost_decode_slice_fails_that_trial_and_the_sweep_goes_on(tmp_path):
    """`sweeper run` of two disaggregated serving trials: the first trial's decode slice
    worker SIGKILLed mid-stream fails that trial, with its reason naming the decode slice
    and its pid, and the second trial completes; exit 0 (a failed trial is a result)."""
    import optuna

    home = tmp_path / "home"
    space = tmp_path / "lost.yaml"
    space.write_text(yaml.safe_dump(SERVING_SWEEP))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["SWEEPER_HOME"] = str(home)
    proc = subprocess.Popen([sys.executable, "-m", "sweeper.cli", "run", str(space), "--study",
                             "lost", "--no-analysis"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            pids = decode_slice_pids(proc.pid)
            if pids:
                time.sleep(8)        # its setup and the measurements before the stream
                if psutil.pid_exists(pids[0]):
                    os.kill(pids[0], signal.SIGKILL)
                    killed = pids[0]
            time.sleep(0.5)
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert killed is not None, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name="lost", storage=f"sqlite:///{home / 'optuna.db'}")
    states = [t.state.name for t in study.trials]
    assert sorted(states) == ["COMPLETE", "FAIL"], states
    failed = next(t for t in study.trials if t.state.name == "FAIL")
    reason = failed.user_attrs["reason"]
    assert f"the decode slice's worker (pid {killed}) was lost mid-trial" in reason, reason
