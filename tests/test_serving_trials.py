"""Serving trials: a space's `serving:` block makes each trial of `sweeper run` a real serving
run (docs/space-files.md, "Serving trials").

A real sweep of the shipped `search_spaces/serving.yaml` (real Ray actors serving a Poisson
stream with wall-clock arrivals on the emulated mesh, a real SQLite Optuna study and MLflow
store): its trials carry the serving metrics, in Optuna and in their MLflow child runs, and
the serving model's prediction of the same stream beside them (`pred_ttft_p50_s` ...). Bad
serving input exits 2 with one line through the real CLI. A trial's summary is
`SimResult.summary`'s on the same requests; its prediction is `simulate` of its deployment on
the same requests. Timings are never asserted.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml

from test_bad_input import check_rejected, run_cli
from sweeper.spec.space import load_space
from sweeper.sweep.controller import run_sweep
from sweeper.tracking.results import load_runs, load_trials
from workloads.config import ConfigError, HARDWARE_PRESETS, load_model
from workloads.deployment import Deployment, PhaseSlice
from workloads.metrics import METRIC_NAMES, SERVING_METRICS, SERVING_PREDICTIONS
from workloads.serving import profile as app_profile
from workloads.serving.model import SimResult, simulate
from workloads.serving.trial import predict_stream, summarize, trial_requests
from workloads.trial import TrialConfig

ROOT = Path(__file__).resolve().parents[1]
SERVING_SPACE = ROOT / "search_spaces" / "serving.yaml"
REPORTED = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "slo_attainment",
            "goodput_rps", "throughput_rps", "tokens_per_s_per_chip", "completed")
BASE = {"name": "s", "model": "tiny", "hardware": "host", "chips": 1, "batch": 2,
        "serving": {"rate": 40, "requests": 8, "input_len": 16, "output_len": 4}}


# ----------------------------------------------------------------------------- a real sweep


@pytest.fixture(scope="module")
def sweep(session_sweeper_home, tmp_path_factory):
    stores = tmp_path_factory.mktemp("serving_stores")
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)
    try:
        yield run_sweep(str(SERVING_SPACE), progress=False,
                        storage=f"sqlite:///{stores / 'optuna.db'}",
                        tracking_uri=f"sqlite:///{stores / 'mlflow.db'}")
    finally:
        if old is None:
            os.environ.pop("SWEEPER_HOME", None)
        else:
            os.environ["SWEEPER_HOME"] = old


def test_a_serving_sweep_records_each_trials_serving_metrics_in_optuna(sweep):
    space = load_space(str(SERVING_SPACE))
    requests = space.fixed["serving"]["requests"]
    assert sweep.counts == {"complete": 2, "failed": 0, "pruned": 0}, \
        load_trials(sweep.study_name, sweep.storage).reason.tolist()
    study = optuna.load_study(study_name=sweep.study_name, storage=sweep.storage)
    assert sorted(t.params["batch"] for t in study.trials) == [2, 4]     # the grid: slots
    for trial in study.trials:
        measured = trial.user_attrs["measurement"]
        assert set(REPORTED) <= set(measured), sorted(measured)
        assert measured["completed"] == requests              # every request answered
        assert 0 < measured["ttft_p50_s"] <= measured["ttft_p99_s"]
        assert 0 < measured["tpot_p50_s"] <= measured["tpot_p99_s"]
        assert 0 <= measured["slo_attainment"] <= 1 and measured["throughput_rps"] > 0
        assert "cost_per_million_tokens" not in measured      # host: no price, none invented
        # the serving model's prediction of the same stream, from this host's profile
        assert set(SERVING_PREDICTIONS) <= set(measured), sorted(measured)
        assert 0 < measured["pred_ttft_p50_s"] <= measured["pred_ttft_p99_s"]
        assert 0 < measured["pred_tpot_p50_s"] <= measured["pred_tpot_p99_s"]
        # this host's profile: the step times are the deployment's calls and host costs
        # measured before the stream (the roofline alone, without the serving host costs,
        # predicted this tiny model's TTFT ~30x too fast)
        note = trial.user_attrs["prediction_note"]
        assert "step times measured before the stream" in note and "host costs measured" in note
        # (that the prediction IS the serving model on those measured calls, the
        # serving.json test below recomputes; no ratio to the stream is asserted: the
        # stream's timings move with the host's load)
        # the objectives Optuna was told are the measured serving latencies
        assert trial.values == [measured["ttft_p99_s"], measured["tpot_p99_s"]]
        assert trial.user_attrs["hardware"] == "host" and trial.user_attrs["source"] == "measured"
        assert trial.user_attrs["config"]["serving"]["rate"] == 40.0
        assert trial.user_attrs["config"]["serving"]["requests"] == requests
        # prompt and answer lengths are the block's (the memory check sized the slots for them)
        assert trial.user_attrs["flat_params"]["input_len"] == 16
        assert trial.user_attrs["flat_params"]["decode_steps"] == 7
    # the profile the trials were predicted with is kept with the study (`sweeper fit`
    # starts from it, never from a host cache measured later)
    kept = study.user_attrs["hardware_profile"]
    assert kept["name"] == "host" and kept["measured"] and kept["hbm_bandwidth"] > 0
    # the results table read from Optuna puts each prediction beside its measured metric
    table = load_trials(sweep.study_name, sweep.storage).set_index("number")
    for trial in study.trials:
        measured = trial.user_attrs["measurement"]
        for name in SERVING_PREDICTIONS:
            assert table.loc[trial.number, name] == measured[name], name


def test_the_end_of_sweep_summary_of_a_serving_sweep_is_its_prediction_error(sweep, tmp_path):
    from sweeper.analysis.report import summarize_sweep
    from sweeper.cli.run import format_sweep_summary

    summary = summarize_sweep(sweep.study_name, sweep.storage, sweep.tracking_uri,
                              out_dir=tmp_path, log=False)
    table = load_trials(sweep.study_name, sweep.storage)
    for predicted in SERVING_PREDICTIONS:
        measured = predicted.removeprefix("pred_")
        error = (table[predicted] - table[measured]) / table[measured]
        assert summary["serving"][measured]["n"] == 2
        assert summary["serving"][measured]["median_ape"] == pytest.approx(error.abs().median())
        assert summary["serving"][measured]["median_signed_error"] == pytest.approx(error.median())
    text = format_sweep_summary(summary)
    # no empty prefill/decode frontiers, no "not computed" fit for a study of serving trials
    assert "serving model vs measured" in text and "over 2 trials" in text
    assert "Pareto frontier" not in text and "held-out" not in text


def test_a_serving_sweeps_mlflow_child_runs_carry_the_serving_metrics(sweep):
    study = optuna.load_study(study_name=sweep.study_name, storage=sweep.storage)
    runs = load_runs(sweep.tracking_uri, parent_run_id=sweep.parent_run_id)
    assert sorted(runs.number) == sorted(t.number for t in study.trials)
    by_number = {t.number: t for t in study.trials}
    for _, run in runs.iterrows():
        measured = by_number[run.number].user_attrs["measurement"]
        for name in REPORTED:
            assert run[name] == pytest.approx(measured[name], rel=1e-12), name
        # logged as `pred_<metric>`, read back as the prediction of that metric
        for name in SERVING_PREDICTIONS:
            assert run[name] == pytest.approx(measured[name], rel=1e-12), name


def test_a_host_serving_trial_keeps_what_it_measured_before_its_stream(sweep, tmp_path):
    """The calls and host costs a `hardware: host` trial measured before its stream (its
    prediction's step times) are in its `serving.json`, and measuring them on the trial's
    own slot server left its answers the unsharded reference's."""
    import json

    from mlflow.tracking import MlflowClient

    from workloads.model import prompt_tokens
    from workloads.serving.slots import reference_generation

    study = optuna.load_study(study_name=sweep.study_name, storage=sweep.storage)
    space = load_space(str(SERVING_SPACE))
    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    for trial in study.trials:
        run_id = trial.user_attrs["mlflow_run_id"]
        with open(client.download_artifacts(run_id, "serving.json", str(tmp_path / run_id))) as f:
            serving = json.load(f)
        costs = serving["measured_before_stream"]
        loop = costs["detail"]["aggregated"]
        assert loop["engine_prefill_s"] > 0 and loop["engine_step_s"] > 0
        assert costs["engine_prefill_by_len_s"] == {"16": loop["engine_prefill_s"]}
        for name in ("step_overhead_s", "prefill_overhead_per_prompt_s", "prefill_wake_s"):
            assert math.isfinite(costs[name]) and costs[name] >= 0, name
        assert serving["prediction"]["step_times"].startswith("measured before the stream")
        config = space.trial_config(trial.params)
        # the recorded prediction is the serving model on exactly these measured calls (an
        # aggregated trial's step times are all measured: the profile's rates price nothing)
        profile = dataclasses.replace(HARDWARE_PRESETS["tpu-v4"], name="host", measured=True)
        again, _ = predict_stream(config, trial_requests(config), profile, costs)
        measured = trial.user_attrs["measurement"]
        for name in SERVING_PREDICTIONS:
            assert measured[name] == pytest.approx(again[name], rel=1e-9), name
        # ... so every first token waits at least for the measured engine prefill (the
        # roofline alone, without the measured calls, predicted ~30x less on this model)
        assert measured["pred_ttft_p50_s"] >= loop["engine_prefill_s"]
        for i, (r, served) in enumerate(zip(trial_requests(config)[:4], serving["per_request"])):
            prompt = prompt_tokens(config.model, 1, r.input_len, config.seed * 1_000_003 + i)[0]
            _, ref = reference_generation(config.model, config.seed, prompt, r.output_len - 1)
            assert served["tokens"] == [int(t) for t in ref], f"trial {trial.number} request {i}"


def test_a_failed_serving_trial_is_recorded_with_its_reason_and_the_sweep_goes_on(
        session_sweeper_home, tmp_path, monkeypatch):
    """The trace the space named is gone when the trials run: each trial is recorded, with
    the reason, in Optuna and MLflow (PRUNED: its point no longer makes a trial), and the
    sweep finishes its trials."""
    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    trace = tmp_path / "requests.csv"
    trace.write_text("arrival_s,input_len,output_len\n0,16,4\n0.05,16,4\n")
    serving = {"trace": str(trace), "requests": 2}
    space = load_space({**{k: v for k, v in BASE.items() if k != "batch"}, "name": "gone",
                        "serving": serving, "params": {"batch": [2, 4]},
                        "sampler": {"type": "grid"}, "trials": 2, "timeout_s": 120})
    trace.unlink()
    result = run_sweep(space, progress=False, storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.counts == {"complete": 0, "failed": 0, "pruned": 2}
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert len(runs) == 2
    for trial in study.trials:
        reason = trial.user_attrs["reason"]
        assert "serving.trace" in reason and "requests.csv" in reason, reason
        assert trial.user_attrs["mlflow_run_id"] in set(runs.mlflow_run_id)


DISAGGREGATED = {**BASE, "name": "disaggregated", "chips": 2, "serving_mode": "disaggregated",
                 "serving": {"rate": 20, "requests": 4, "input_len": 8, "output_len": 4},
                 "trials": 1, "timeout_s": 120}


@pytest.mark.slow
@pytest.mark.ci_slow
def test_a_disaggregated_serving_sweep_records_measured_and_predicted_percentiles(
        session_sweeper_home, tmp_path, monkeypatch):
    """A real `sweeper run` of one disaggregated serving trial (prefill slice on the trial's
    worker, decode slice on a second Ray mesh worker, the KV caches handed over through Ray):
    every request answered, the measured and the predicted percentiles in Optuna and in the
    trial's MLflow child run, under the aggregated trials' names."""
    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    result = run_sweep(load_space(DISAGGREGATED), progress=False,
                       storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.counts == {"complete": 1, "failed": 0, "pruned": 0}, \
        load_trials(result.study_name, result.storage).reason.tolist()
    trial = optuna.load_study(study_name=result.study_name, storage=result.storage).trials[0]
    assert trial.user_attrs["config"]["serving_mode"] == "disaggregated"
    measured = trial.user_attrs["measurement"]
    assert measured["completed"] == 4
    for name in ("ttft", "tpot"):
        assert 0 < measured[f"{name}_p50_s"] <= measured[f"{name}_p99_s"]
        assert 0 < measured[f"pred_{name}_p50_s"] <= measured[f"pred_{name}_p99_s"]
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert len(runs) == 1 and runs.iloc[0]["serving_mode"] == "disaggregated"
    for name in (*REPORTED, *SERVING_PREDICTIONS):
        assert runs.iloc[0][name] == pytest.approx(measured[name], rel=1e-12), name


def test_a_disaggregated_trials_worker_serves_the_references_tokens(session_sweeper_home,
                                                                     monkeypatch):
    """The sweep's trial process (`MeshWorker.serve`, here in the test's own process, with a
    real Ray decode worker): every request's tokens are the unsharded reference's, its KV in
    a decode slot after its first token, and the slices are half the chips each. With a
    measured (host) profile, so both slices measure their calls, host costs and KV
    handovers before the stream (and still answer the reference's tokens)."""
    import ray

    from sweeper.sweep.meshworker import MeshWorker
    from workloads.model import prompt_tokens
    from workloads.serving.slots import reference_generation

    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    trial = load_space(DISAGGREGATED).trial_config({})
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        measured_profile = dataclasses.replace(HARDWARE_PRESETS["tpu-v4"], name="host",
                                               measured=True)
        measurement = MeshWorker(slot=0, chips=2, cores=None).serve(trial, measured_profile)
    finally:
        ray.shutdown()
    serving = measurement.extra["serving"]
    costs = serving["measured_before_stream"]
    assert costs["detail"]["prefill"]["engine_prefill_s"] > 0
    assert costs["detail"]["decode"]["engine_step_s"] > 0
    assert costs["detail"]["handover"]["samples"] > 0 and costs["handover_overhead_s"] > 0
    # the prefill slice's closed loop ran beside the real decode worker stepping its slots
    assert costs["detail"]["prefill"]["decode_beside_steps"] > 0
    assert serving["prediction"]["step_times"].startswith("measured before the stream")
    assert math.isfinite(measurement.pred_ttft_p50_s) and math.isfinite(measurement.pred_tpot_p50_s)
    assert serving["deployment"] == "disaggregated" and measurement.completed == 4
    assert {p: s["chips"] for p, s in serving["slices"].items()} == {"prefill": 1, "decode": 1}
    for i, (r, served) in enumerate(zip(trial_requests(trial), serving["per_request"])):
        prompt = prompt_tokens(trial.model, 1, r.input_len, trial.seed * 1_000_003 + i)[0]
        _, ref = reference_generation(trial.model, trial.seed, prompt, r.output_len - 1)
        assert served["tokens"] == [int(t) for t in ref], f"request {i}"
        assert served["finish_s"] >= served["kv_ready_s"] >= served["first_token_s"] >= r.arrival_s


def test_a_disaggregated_trials_prediction_is_the_serving_model_on_two_half_slices():
    """Disaggregated: a prefill slice and a decode slice of half the trial's chips each (the
    cost model's best split of them), the trial's layouts, one prompt per prefill call and
    `batch` slots; `simulate` of that deployment on the trial's own requests."""
    from workloads.costmodel import best_topology

    space = load_space({**BASE, "chips": 4, "batch": 4, "serving_mode": "disaggregated",
                        "prefill": {"ffn": "ws1d", "attn": "head"},
                        "decode": {"ffn": "ws2d", "attn": "batch"}})
    trial = space.trial_config({})
    reqs = trial_requests(trial)
    hardware = HARDWARE_PRESETS["tpu-v4"]
    predicted, note = predict_stream(trial, reqs, hardware)
    half = best_topology(trial.model, 2)
    prefill = PhaseSlice(chips=2, replicas=1, ffn="ws1d", attn="head", batch=1,
                         weights="bf16", topology=half)
    decode = PhaseSlice(chips=2, replicas=1, ffn="ws2d", attn="batch", batch=4,
                        weights="bf16", topology=half)
    expected = simulate(Deployment(load_model("tiny"), hardware, "disaggregated", prefill, decode),
                        reqs).summary()
    for name in SERVING_PREDICTIONS:
        assert predicted[name] == expected[name[len("pred_"):]], name
    assert note["source"] == "analytical"


def test_a_disaggregated_trial_needs_chips_that_halve():
    trial = load_space({**BASE, "chips": 2, "serving_mode": "disaggregated"}).trial_config({})
    trial.validate()                                     # 1 + 1 chips
    odd = dataclasses.replace(trial, chips=3, topology=(1, 1, 3))
    with pytest.raises(ConfigError) as err:
        odd.validate()
    assert (err.value.field, err.value.value) == ("chips", 3)
    assert "even number of chips" in err.value.accepted


# ----------------------------------------------------------------------------- bad input


BAD = [
    ("serving-unknown-key", {**BASE, "serving": {**BASE["serving"], "arival": 3}},
     ["serving.arival", "requests", "rate"]),
    ("serving-objective-without-block", {**{k: v for k, v in BASE.items() if k != "serving"},
                                         "input_len": 8, "decode_steps": 2,
                                         "objectives": [{"metric": "ttft_p99_s"}]},
     ["objectives[0].metric", "ttft_p99_s", "add a serving: block"]),
    ("serving-block-with-a-batch-objective", {**BASE, "objectives": ["decode_step_s"]},
     ["objectives[0].metric", "decode_step_s", "a serving metric"]),
    ("serving-constraint-without-block", {**{k: v for k, v in BASE.items() if k != "serving"},
                                          "constraints": ["goodput_rps >= 3"]},
     ["constraints[0]", "goodput_rps"]),
    ("serving-bad-rate", {**BASE, "serving": {**BASE["serving"], "rate": -1}},
     ["serving.rate", "-1", "a positive number of requests per second"]),
    ("serving-bad-requests", {**BASE, "serving": {**BASE["serving"], "requests": 0}},
     ["serving.requests", "0"]),
    ("serving-input-len-also-fixed", {**BASE, "input_len": 32},
     ["input_len", "32", "serving block's input_len"]),
    ("serving-analytical", {**BASE, "hardware": "analytical:tpu-v4"},
     ["hardware", "host or devices"]),
    ("serving-two-hosts", {**BASE, "chips": 2, "hosts": 2}, ["hosts", "one host"]),
    ("serving-verify", {**BASE, "verify": True}, ["verify", "no reference comparison"]),
    ("serving-pad-vocab-none", {**BASE, "pad_vocab": "none"}, ["pad_vocab", "auto"]),
    ("disaggregated-one-chip", {**BASE, "chips": 1, "serving_mode": "disaggregated"},
     ["chips", "1", "even number of chips"]),
    ("serving-mode-without-block", {**{k: v for k, v in BASE.items() if k != "serving"},
                                    "serving_mode": "disaggregated"},
     ["serving_mode", "serving: block"]),
    ("serving-mode-unknown", {**BASE, "serving_mode": "split"},
     ["serving_mode", "split", "disaggregated"]),
    # chunked prefill and pipeline stages (tests/test_serving_trial_behaviours.py)
    ("prefill-chunk-without-block", {**{k: v for k, v in BASE.items() if k != "serving"},
                                     "input_len": 8, "decode_steps": 2, "prefill_chunk": 8},
     ["prefill_chunk", "8", "serving: block"]),
    ("prefill-chunk-disaggregated", {**BASE, "chips": 2, "serving_mode": "disaggregated",
                                     "prefill_chunk": 8},
     ["prefill_chunk", "8", "disaggregated"]),
    ("stages-over-the-layers", {**BASE, "chips": 4, "stages": 4},
     ["stages", "4", "n_layers=2"]),
    ("stages-with-a-prefix", {**BASE, "chips": 2, "stages": 2,
                              "serving": {**BASE["serving"], "prefix_len": 4}},
     ["stages", "serving.prefix_len=4", "no prefix caching"]),
]


@pytest.mark.parametrize("contents, expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_serving_input_exits_2_with_one_line_before_anything_starts(tmp_path, contents,
                                                                        expected):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(contents))
    home, imports = tmp_path / "home", tmp_path / "imports.json"
    check_rejected(run_cli(["run", str(path)], home, imports), home, imports, expected, path.name)


def test_a_serving_block_without_objectives_minimises_ttft_and_tpot_p99():
    space = load_space(BASE)
    assert [(o.metric, o.direction) for o in space.objectives] == [
        ("ttft_p99_s", "minimize"), ("tpot_p99_s", "minimize")]
    assert set(SERVING_METRICS) >= {o.metric for o in space.objectives}
    # lengths: the longest prompt, and the longest answer less its first token (prefill's)
    block = {**BASE["serving"], "input_len": "uniform:8:24", "output_len": {"dist": "uniform",
                                                                            "low": 2, "high": 6}}
    fixed = load_space({**BASE, "serving": block}).fixed
    assert (fixed["input_len"], fixed["decode_steps"]) == (24, 5)
    assert space.serving == BASE["serving"]                  # the block as read, for `plan`


def test_a_deployment_that_cannot_prefill_one_prompt_is_pruned_before_it_runs():
    """Serving trials prefill one prompt per call: batch-sharded prefill attention over two
    chips cannot split it, whatever the decode slots (the point is pruned with the reason)."""
    space = load_space({**BASE, "chips": 2, "params": {"prefill_attn": ["head", "batch"]}})
    assert space.trial_config({"prefill_attn": "head"}).serving is not None
    with pytest.raises(ConfigError) as err:
        space.trial_config({"prefill_attn": "batch"})
    assert err.value.field == "batch" and err.value.value == 1


def test_a_serving_trial_round_trips_through_its_dict_and_draws_a_seeded_stream():
    trial = load_space(BASE).trial_config({})
    again = TrialConfig.from_dict(trial.to_dict())
    assert again == trial and again.serving["requests"] == 8
    first = trial_requests(trial)
    assert first == trial_requests(again) and len(first) == 8
    other = TrialConfig.from_dict({**trial.to_dict(), "seed": 1})
    assert [r.arrival_s for r in trial_requests(other)] != [r.arrival_s for r in first]
    with pytest.raises(ConfigError) as err:
        TrialConfig.from_dict({**trial.to_dict(), "serving": {"rate": 1, "requests": 2.5}})
    assert err.value.field == "serving.requests"


def test_a_trial_file_with_a_serving_block_exits_2_with_one_line(tmp_path):
    """`sweeper trial` times one batch: a serving block there would be ignored, so it is refused."""
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "chips": 1, "batch": 2,
                                    "serving": BASE["serving"]}))
    home, imports = tmp_path / "home", tmp_path / "imports.json"
    check_rejected(run_cli(["trial", "--config", str(path)], home, imports), home, imports,
                   ["serving", "no serving block in a trial file"], path.name)


# ----------------------------------------------------------------------------- one definition


def test_a_trials_summary_is_the_serving_models_on_the_same_requests():
    """The same statistics as `sweeper serve` (SimResult.summary) for the same requests,
    including ones that never finished and one-token answers."""
    profile = app_profile.profile_from_dict({"rate": 20, "input_len": 16,
                                                "output_len": "uniform:1:9", "ttft": 0.05,
                                                "tpot": 0.01})
    reqs = app_profile.requests(profile, 40, seed=5)
    rng = np.random.default_rng(0)
    first = np.array([r.arrival_s for r in reqs]) + rng.exponential(0.03, len(reqs))
    finish = first + np.array([r.output_len - 1 for r in reqs]) * rng.uniform(0.005, 0.015, len(reqs))
    finish[[3, 17]] = np.nan                                 # not finished
    ours = summarize(reqs, first, finish, chips=4, profile=profile, price_per_chip_hour=2.0)
    done = np.isfinite(finish)
    slice_ = PhaseSlice(chips=4, replicas=1, ffn="ws2d", attn="head", batch=4, weights="bf16")
    hardware = HARDWARE_PRESETS["tpu-v4"]
    deployment = Deployment(load_model("tiny"), hardware, "aggregated", slice_, slice_)
    theirs = SimResult(deployment, np.array([r.arrival_s for r in reqs])[done], first[done],
                       finish[done], np.array([r.output_len for r in reqs])[done],
                       slo=app_profile.profile_from_dict(profile.to_dict())).summary()
    theirs["completed"] = int(done.sum())
    theirs["cost_per_million_tokens"] = (theirs["cost_per_million_tokens"] * 2.0
                                         / hardware.price_per_chip_hour)
    for name in SERVING_METRICS:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-9), name
    assert ours["completed"] == 38 and 0 < ours["slo_attainment"] < 1
    assert math.isnan(summarize(reqs, first, finish, 4, profile)["cost_per_million_tokens"])


def test_a_trials_prediction_is_the_serving_model_on_its_deployment_and_requests():
    """`predict_stream` = `simulate` of the trial's deployment (aggregated, one replica of its
    chips, topology, per-phase layouts and weights, one prompt per prefill call, `batch`
    slots) on the trial's own requests, with the profile the worker was given."""
    space = load_space({**BASE, "chips": 2, "batch": 4, "weights": "int8", "topology": "1x1x2",
                        "prefill": {"ffn": "ws1d", "attn": "head"},
                        "decode": {"ffn": "ws2d", "attn": "batch"}})
    trial = space.trial_config({})
    reqs = trial_requests(trial)
    hardware = HARDWARE_PRESETS["tpu-v4"]
    predicted, note = predict_stream(trial, reqs, hardware)
    prefill = PhaseSlice(chips=2, replicas=1, ffn="ws1d", attn="head", batch=1,
                         weights="int8", topology=(1, 1, 2))
    decode = PhaseSlice(chips=2, replicas=1, ffn="ws2d", attn="batch", batch=4,
                        weights="int8", topology=(1, 1, 2))
    expected = simulate(Deployment(load_model("tiny"), hardware, "aggregated", prefill, decode),
                        reqs).summary()
    for name in SERVING_PREDICTIONS:
        assert predicted[name] == expected[name[len("pred_"):]], name
        assert math.isfinite(predicted[name]) and predicted[name] > 0
    assert note["source"] == "analytical" and note["hardware"] == "tpu-v4"
    assert note["completed"] == len(reqs)
    # another profile, another prediction: the worker's profile is the one priced
    slower, _ = predict_stream(trial, reqs, hardware.scaled(0.25))
    assert slower["pred_tpot_p50_s"] > predicted["pred_tpot_p50_s"]


def test_a_trial_without_a_priceable_deployment_has_nan_predictions_and_says_why():
    trial = load_space(BASE).trial_config({})
    reqs = trial_requests(trial)
    values, note = predict_stream(trial, reqs, None)
    assert all(math.isnan(values[name]) for name in SERVING_PREDICTIONS)
    assert note["source"] is None and "no hardware profile" in note["reason"]
    # padding the serving model does not describe (it pads as pad_heads auto does)
    padded = load_space({**BASE, "pad_heads": 16}).trial_config({})
    values, note = predict_stream(padded, reqs, HARDWARE_PRESETS["tpu-v4"])
    assert all(math.isnan(values[name]) for name in SERVING_PREDICTIONS)
    assert "pad_heads=16" in note["reason"]


def test_predictions_are_not_metrics_of_their_own():
    """`pred_<metric>` is the prediction of `<metric>`: the results table already has that
    column, so the prediction fields are no metric names (no `pred_pred_` column)."""
    assert not set(SERVING_PREDICTIONS) & set(METRIC_NAMES)
    assert {name[len("pred_"):] for name in SERVING_PREDICTIONS} <= set(METRIC_NAMES)


def test_a_host_trials_measurement_before_its_stream_is_cached_per_deployment_shape():
    """`measure_before_stream` on a real warmed-up slot server of the trial's deployment:
    the engine's calls and host costs (finite, the engine's calls > 0), reused for the same
    shape in the same process, and the prediction's StepTimes are those engine calls."""
    from workloads.serving.slots import SlotServer, SlotSpec
    from workloads.serving.profile import context_len
    from workloads.serving.trial import (MEASURED_STEP_TIMES, measure_before_stream,
                                         measured_step_times, trial_deployment)

    trial = load_space({**BASE, "serving": {**BASE["serving"], "requests": 4}}).trial_config({})
    reqs = trial_requests(trial)
    server = SlotServer(SlotSpec(trial.model, tuple(trial.mesh_shape), trial.prefill,
                                 trial.decode, slots=trial.batch, prefill_batch=1,
                                 context_len=context_len(reqs), weights=trial.weights,
                                 seed=trial.seed, pad_heads=trial.pad_heads))
    server.warm_up(16)
    first = measure_before_stream(trial, server, reqs)
    again = measure_before_stream(trial, server, reqs)
    assert not first["cached"] and again["cached"]
    assert {k: v for k, v in again.items() if k != "cached"} == \
        {k: v for k, v in first.items() if k != "cached"}
    loop = first["detail"]["aggregated"]
    assert loop["engine_prefill_s"] > 0 and loop["engine_step_s"] > 0
    assert (first["input_len"], first["output_len"]) == (16, 4)
    times = measured_step_times(trial_deployment(trial, HARDWARE_PRESETS["tpu-v4"]), first)
    assert times.source == MEASURED_STEP_TIMES
    assert times.prefill_s(1, 16) == loop["engine_prefill_s"]
    assert times.prefill_s(1, 40) == loop["engine_prefill_s"]     # the nearest measured length
    # the engine's steps run back to back, the step its host cost (with the wait for each
    # step's tokens) is charged on top of
    assert times.decode_step_s(2, 100.0) == loop["engine_step_pipelined_s"]
    assert times.host_costs.step_overhead_s == first["step_overhead_s"]
    assert times.host_costs.prefill_wake_s == first["prefill_wake_s"] and times.step_spread


class _DecodeSliceHere:
    """A disaggregated trial's decode slice in this process (threads, no Ray), with
    sweeper/sweep/meshworker.py `DecodeSlice`'s interface (workloads/serving/trial.py
    `run_serving_trial`) over a real slot server; `beside`: it offers `begin_beside` /
    `end_beside` (workloads/serving/hostcosts.py `step_beside`)."""

    def __init__(self, spec, lengths, beside: bool):
        import queue
        import threading

        from workloads.serving.slots import SlotServer

        self.server = SlotServer(spec)
        for length in lengths:
            self.server.warm_up(length)
        self.inbox, self.stopped, self.threads = queue.Queue(), set(), {}
        self.result: dict = {}
        self._threading = threading
        if beside:
            self.begin_beside, self.end_beside = self._begin_beside, self._end_beside

    def _run(self, name, target):
        thread = self._threading.Thread(target=lambda: self.result.__setitem__(name, target()))
        thread.start()
        self.threads[name] = thread

    def measure_loop(self, input_len, output_len, how):
        from workloads.serving.hostcosts import measure_loop
        return measure_loop(self.server, input_len, output_len, **how)

    def sink(self, handover):
        return len(handover)

    def wait(self, sent):
        return None

    def receive(self, handover):
        from workloads.serving.hostcosts import handover_receive
        answer = handover_receive(self.server, handover)
        return lambda: answer

    def cpu_seconds(self):
        import time
        return time.process_time()

    def begin(self, expected, start_at):
        from workloads.serving.slots import serve_decode_slice
        self._run("serve", lambda: serve_decode_slice(self.server, self.inbox, expected, start_at))

    def send(self, handover):
        for item in handover:
            self.inbox.put(item)

    def finish(self, sent):
        self.threads["serve"].join(120.0)
        return self.result["serve"]

    def _begin_beside(self):
        from workloads.serving.hostcosts import step_beside
        self._run("beside", lambda: step_beside(self.server, self.stopped, 1, max_s=300.0))
        return 1

    def _end_beside(self, token):
        self.stopped.add(token)
        self.threads["beside"].join(120.0)
        return self.result["beside"]


@pytest.mark.parametrize("beside", [True, False])
def test_a_disaggregated_trials_prefill_closed_loop_runs_beside_a_stepping_decode_slice(
        beside, monkeypatch):
    """workloads/serving/trial.py `measure_before_stream`, disaggregated, on real slot servers
    (the decode slice in this process, `_DecodeSliceHere`): where the decode slice offers
    `begin_beside`, it steps while the prefill slice's closed loop runs (as `sweeper serve
    --measure-overheads`, docs/serving.md "The prefill slice beside a stepping decode
    slice") and is stopped after it (its steps in the prefill's detail); without, the
    closed loop runs alone. The handover's charge is the decode CPU per handover or the closed
    loop's insert mean, the larger. No
    timing asserted."""
    from workloads.serving.slots import SlotServer
    from workloads.serving.profile import context_len
    from workloads.serving import trial as serving_trial
    from workloads.serving.trial import measure_before_stream, slice_specs

    # a fresh per-process cache: another test of this process may have measured the shape
    monkeypatch.setattr(serving_trial, "_MEASURED", {})
    trial = load_space({**DISAGGREGATED, "serving": {**DISAGGREGATED["serving"],
                                                     "input_len": 8 + beside}}).trial_config({})
    reqs = trial_requests(trial)
    lengths = sorted({r.input_len for r in reqs})
    prefill_spec, decode_spec = slice_specs(trial, context_len(reqs))
    server = SlotServer(prefill_spec)
    for length in lengths:
        server.warm_up(length)
    decode = _DecodeSliceHere(decode_spec, lengths, beside)
    costs = measure_before_stream(trial, server, reqs, decode)
    assert not costs["cached"]
    pre = costs["detail"]["prefill"]
    if beside:
        assert pre["decode_beside_steps"] > 0 and not decode.threads["beside"].is_alive()
    else:
        assert "decode_beside_steps" not in pre
    handover = costs["detail"]["handover"]
    assert costs["handover_overhead_s"] == pytest.approx(max(handover["insert_mean_s"],
                                                             handover["decode_cpu_s"]))
    assert costs["detail"]["idle_handovers"]["requests"] > 0
