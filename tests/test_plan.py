"""`sweeper plan` (sweeper/serving/plan.py, sweeper/cli/plan.py): the issue-19 questions as a
user asks them (real subprocesses, a real MLflow store), the no-plan answer, error bands,
and bad serving input (one line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeper.cli import main
from sweeper.serving import bands
from sweeper.serving.plan import PlanQuestion, band_streams, plan
from workloads.config import load_hardware, load_model
from workloads.deployment import load_plan
from workloads.serving.model import simulate
from workloads.serving.profile import AppProfile, parse_length, requests

PLAN_KEYS = {"mode", "chips_total", "ttft_p99_s", "tpot_p99_s", "ttft_p50_s", "tpot_p50_s",
             "goodput_rps", "tokens_per_s_per_chip"}
SLICE_KEYS = {"chips", "replicas", "ffn", "attn", "batch", "weights"}


def _sweeper(args, home, timeout=240):
    env = {**os.environ, "SWEEPER_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _check_shape(best: dict) -> None:
    assert PLAN_KEYS <= set(best)
    for phase in ("prefill", "decode"):
        assert SLICE_KEYS <= set(best[phase])
    chips = (best["decode"]["chips"] * best["decode"]["replicas"] if best["mode"] == "aggregated"
             else sum(best[p]["chips"] * best[p]["replicas"] for p in ("prefill", "decode")))
    assert best["chips_total"] == chips
    assert best["ttft_p50_s"] <= best["ttft_p99_s"] and best["tpot_p50_s"] <= best["tpot_p99_s"]


def test_palm_540b_chatbot_on_tpu_v4(tmp_path):
    """Paper §4.4's chatbot: 2048-token context, 64-token answers; the plan file is what
    `sweeper serve --plan` reads."""
    out = tmp_path / "plan.json"
    proc = _sweeper(["plan", "--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
                     "--input-len", "2048", "--output-len", "64", "--ttft", "1", "--tpot", "0.03",
                     "--out", str(out), "--json", "--no-mlflow"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    best = data["best"]
    _check_shape(best)
    assert best["ttft_p99_s"] <= 1 and best["tpot_p99_s"] <= 0.03 and best["meets_slo"]
    assert best["chips_total"] >= 16          # 540B int8 weights need >= 16 x 32 GiB
    assert set(data["best_per_mode"]) == {"aggregated", "disaggregated"}
    assert best in data["plans"]
    assert "binding:" in data["reason"] and "fewer chips" in data["reason"]   # what stops cheaper
    assert best["band"] == "uncalibrated" and best["at_risk"] is None   # a preset: no band
    assert "sweeper serve --plan" in data["settle"]
    deployment = load_plan(out)
    assert deployment.mode == best["mode"] and deployment.chips_total == best["chips_total"]
    assert deployment.decode.batch == best["decode"]["batch"]
    assert json.loads(out.read_text())["profile"]["input_len"] == 2048


@pytest.mark.ci_slow     # a fresh MLflow store's migrations: 10-40 s on a loaded 2-core host
def test_plan_is_logged_to_a_real_mlflow_store(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "2",
                 "--input-len", "512", "--output-len", "64", "--mode", "aggregated",
                 "--requests", "100", "--json", "--tracking-uri", store]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["best"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(data["mlflow_run_id"])
    assert run.data.tags["sweeper.kind"] == "plan" and run.data.params["model"] == "llama2-70b"
    assert run.data.params["serving_rate"] == "2.0"
    assert run.data.metrics["chips_total"] == best["chips_total"]
    assert run.data.metrics["ttft_p99_s"] == pytest.approx(best["ttft_p99_s"])
    assert "plan.json" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_llama2_70b_on_h100(tmp_path):
    proc = _sweeper(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "4",
                     "--input-len", "1024", "--output-len", "256", "--ttft", "1", "--tpot",
                     "0.04", "--json", "--no-mlflow"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    _check_shape(data["best"])
    assert data["best"]["cost_per_million_tokens"] > 0        # h100 has a list price
    # the human output names the binding constraint and the frontier
    text = _sweeper(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "4",
                     "--input-len", "1024", "--output-len", "256", "--ttft", "1", "--tpot",
                     "0.04", "--mode", "disaggregated", "--no-mlflow"], tmp_path)
    assert text.returncode == 0, text.stderr
    assert "binds:" in text.stdout and "frontier" in text.stdout
    assert text.stdout.split("best plan per mode:")[1].split("\n")[1].startswith("  disaggregated")


def test_no_plan_exits_0_with_the_failing_constraint(tmp_path):
    proc = _sweeper(["plan", "--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
                     "--ttft", "2", "--tpot", "0.001", "--json", "--no-mlflow"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["best"] is None
    assert "TPOT" in data["reason"] and "off by" in data["reason"]


def test_chip_budget_too_small_names_memory(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    code = main(["plan", "--model", "palm-540b", "--hardware", "tpu-v4", "--rate", "1",
                 "--max-chips", "8", "--json", "--no-mlflow"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["best"] is None
    assert "memory" in data["reason"] and "8 x 29 GiB (HBM less its reserve)" in data["reason"]


def test_rate_too_high_for_the_budget_says_by_how_much():
    q = PlanQuestion(load_model("llama2-70b"), load_hardware("h100"),
                     AppProfile(rate=200.0, input_len=parse_length(1024, "x", None),
                                output_len=parse_length(256, "x", None), ttft=1.0, tpot=0.04),
                     modes=("aggregated",), max_chips=4, requests=150)
    result = plan(q)
    assert result.best is None and "off by" in result.reason


def test_error_band_marks_a_plan_at_risk():
    """A fitted profile's held-out residuals give a band; a plan whose SLO target lies
    inside it is at_risk. Measured 2x slower than predicted on some held-out points."""
    base = load_hardware("h100").to_dict()
    residuals = [0.0] * 10 + [-0.5] * 10        # predicted/measured - 1: measured up to 2x
    fitted = load_hardware({**base, "name": "h100-fitted",
                            "heldout_residuals": {"prefill": residuals, "decode": residuals}})
    profile = AppProfile(rate=4.0, input_len=parse_length(1024, "x", None),
                         output_len=parse_length(256, "x", None), ttft=1.0, tpot=0.04)
    q = PlanQuestion(load_model("llama2-70b"), fitted, profile, modes=("aggregated",),
                     requests=150)
    result = plan(q)
    best = result.to_dict()["best"]
    assert best["band"].startswith("calibrated")
    low, high = best["tpot_p99_band_s"]
    assert low <= best["tpot_p99_s"] <= high and high > low
    # every percentile's band, from the same two simulations (benchmarks/blind.py checks a
    # served stream's p50 and p99 against them)
    assert best["bands_s"]["tpot_p99"] == [low, high]
    for metric, (lo, hi) in best["bands_s"].items():
        assert lo <= best[f"{metric}_s"] <= hi, metric
    # the plan meets the SLO as predicted; at 2x slower steps it could not
    assert best["at_risk"] is True and result.settle and "sweeper serve" in result.settle
    # the band's upper end is the same plan simulated with every step time x 2, on the
    # slowest of the band's arrival streams (19 for 90%: none of them the plan's own)
    d = result.best.deployment
    streams = band_streams(q, 150)
    assert len(streams) == 19 and all(len(s) == 150 for s in streams)
    assert all(s != requests(profile, 150, 0) for s in streams)
    slow = max(simulate(d, s, _scaled(result, 2.0), slo=profile).summary()["tpot_p99_s"]
               for s in streams)
    assert high == pytest.approx(slow, rel=1e-9)


def test_a_band_covers_the_arrivals_of_a_stream_of_the_served_length():
    """Without any step-time error (every held-out residual 0) the band is the spread of the
    statistic over other arrival streams: wider for a served stream of 40 requests than for
    one of 400, and containing the plan's own prediction."""
    base = load_hardware("h100").to_dict()
    exact = load_hardware({**base, "name": "h100-exact",
                           "heldout_residuals": {"prefill": [0.0] * 20, "decode": [0.0] * 20}})
    profile = AppProfile(rate=40.0, input_len=parse_length(512, "x", None),
                         output_len=parse_length(64, "x", None), ttft=2.0, tpot=0.1)
    widths = {}
    for served in (40, 400):
        q = PlanQuestion(load_model("llama3.1-8b"), exact, profile, modes=("aggregated",),
                         requests=400, band_requests=served)
        best = plan(q).to_dict()["best"]
        low, high = best["bands_s"]["ttft_p99"]
        assert low <= best["ttft_p99_s"] <= high
        assert "19 arrival streams" in best["band"]
        widths[served] = high / low
    assert widths[40] > widths[400] > 1.0


def test_a_calibrated_profiles_band_draws_each_call_from_its_measured_spread():
    """On a profile `sweeper calibrate` wrote (calibration.serving_spread, per mode), the
    band's simulations scale each call by a factor drawn from the spread (bands.py
    `serving_spread`): with every held-out residual 0, a decode spread with a slow tail (1
    step in 50 three times the median) widens the TPOT p99 band above the plan's own
    prediction, which stays the same; a spread for the other mode changes nothing."""
    base = load_hardware("h100").to_dict()
    exact = {**base, "name": "h100-exact",
             "heldout_residuals": {"prefill": [0.0] * 20, "decode": [0.0] * 20}}
    tail = [0.96] * 49 + [2.92]                   # mean 1
    profile = AppProfile(rate=4.0, input_len=parse_length(512, "x", None),
                         output_len=parse_length(64, "x", None), ttft=2.0, tpot=0.1)
    best = {}
    for name, spread in (("none", {}), ("other", {"disaggregated": {"decode": tail}}),
                         ("tail", {"aggregated": {"prefill": [1.0], "decode": tail}})):
        hw = load_hardware({**exact, "calibration": {"serving_spread": spread}})
        assert bands.serving_spread(hw, "aggregated") == (
            tuple(spread.get("aggregated", {}).get("prefill", ())),
            tuple(spread.get("aggregated", {}).get("decode", ())))
        q = PlanQuestion(load_model("llama3.1-8b"), hw, profile, modes=("aggregated",),
                         requests=200, band_requests=100)
        best[name] = plan(q).to_dict()["best"]
    assert best["tail"]["tpot_p99_s"] == best["none"]["tpot_p99_s"]
    assert best["other"]["bands_s"] == best["none"]["bands_s"]
    assert best["tail"]["bands_s"]["tpot_p99"][1] > 1.05 * best["none"]["bands_s"]["tpot_p99"][1]


def test_a_spreads_quantiles_keep_its_tail():
    """sweeper/calibrate/serving.py `quantiles`: n quantiles at (k + 1/2) / n, rounded; []
    for an empty spread."""
    from sweeper.calibrate.serving import quantiles

    values = np.arange(1, 1001) / 500.0
    q = quantiles(values, 100)
    assert len(q) == 100 and q == sorted(q)
    assert q[-1] == pytest.approx(np.quantile(values, 0.995), abs=1e-4)
    assert q[0] == pytest.approx(np.quantile(values, 0.005), abs=1e-4)
    assert quantiles([], 100) == []


def _scaled(result, factor):
    from workloads.serving.model import StepTimes, cost_model_step_times

    base = cost_model_step_times(result.best.deployment)
    return StepTimes(lambda b, n: base.prefill_s(b, n) * factor,
                     lambda b, c: base.decode_step_s(b, c) * factor, base.kv_transfer_s)


@pytest.mark.parametrize("flags,needle", [
    (["--rate", "-2"], "--rate"),
    (["--rate", "fast"], "--rate"),
    (["--rate", "1", "--input-len", "gaussian"], "--input-len"),
    (["--rate", "1", "--ttft", "0"], "--ttft"),
    (["--rate", "1", "--slo-stat", "p101"], "--slo-stat"),
    (["--rate", "1", "--band-requests", "5"], "--band-requests"),
    (["--rate", "1", "--max-chips", "0"], "--max-chips"),
    ([], "--rate"),                                    # neither --rate nor --trace
    (["--rate", "1", "--trace", "/no/such.csv"], "--trace"),
    (["--rate", "1", "--model", "palm-999b"], "--model"),
])
def test_bad_flags_are_one_line_exit_2(flags, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    args = ["plan", "--hardware", "tpu-v4", *flags]
    if "--model" not in flags:
        args += ["--model", "palm-540b"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_flags_override_a_space_files_serving_block(tmp_path, capsys, monkeypatch):
    """Flags win over the file's `serving:` block, validated as flags (sweeper/cli/appprofile.py
    declares them; `profile_from_flags` reads both back as one profile)."""
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    space = tmp_path / "space.yaml"
    space.write_text("model: llama2-70b\nhardware: h100\nserving:\n  rate: 2\n"
                     "  input_len: {dist: uniform, low: 256, high: 512}\n  output_len: 128\n"
                     "  ttft: 1.0\n  tpot: 0.05\n")
    assert main(["plan", "--space", str(space), "--json", "--no-mlflow", "--requests", "100",
                 "--mode", "aggregated", "--rate", "3", "--ttft", "2.5"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["rate"] == 3 and profile["ttft"] == 2.5 and profile["tpot"] == 0.05
    assert profile["output_len"] == 128 and profile["input_len"]["dist"] == "uniform"
    assert main(["plan", "--space", str(space), "--no-mlflow", "--rate", "3", "--ttft", "-1"]) == 2
    assert "--ttft" in capsys.readouterr().err


def test_serving_block_of_a_space_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    space = tmp_path / "space.yaml"
    space.write_text("model: llama2-70b\nhardware: h100\nserving:\n  rate: 2\n  input_len: 512\n"
                     "  output_len: 128\n  ttft: 1.0\n  tpot: 0.05\n")
    assert main(["plan", "--space", str(space), "--json", "--no-mlflow", "--requests", "100",
                 "--mode", "aggregated"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["rate"] == 2 and data["profile"]["output_len"] == 128
    _check_shape(data["best"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama2-70b\nhardware: h100\nserving:\n  rate: 2\n  tpot: -1\n")
    assert main(["plan", "--space", str(bad), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "serving.tpot" in err and str(bad) in err


def test_a_trace_is_planned_with_its_own_rate_and_lengths(tmp_path):
    trace = tmp_path / "requests.csv"
    rows = [(0.25 * i, 100 + 50 * (i % 3), 10 + 5 * (i % 4)) for i in range(41)]
    trace.write_text("arrival_s,input_len,output_len\n" +
                     "".join(f"{a},{n},{k}\n" for a, n, k in rows))
    profile = AppProfile(trace=str(trace), ttft=0.5, tpot=0.05)
    result = plan(PlanQuestion(load_model("llama2-13b"), load_hardware("a100-80g"), profile,
                               modes=("aggregated",), requests=50))
    best = result.to_dict()["best"]
    assert best is not None and best["slo_attainment"] >= 0.99
    # goodput: the requests meeting the SLO over the stream's span (40 arrivals over 10 s,
    # the last answers after them), never above the throughput
    assert best["goodput_rps"] == pytest.approx(best["throughput_rps"] * best["slo_attainment"])
    assert best["goodput_rps"] <= best["throughput_rps"]
    mean_input = sum(n for _, n, _ in rows) / len(rows)
    assert f"4 req/s, input mean {mean_input:.0f}" in profile.describe()
