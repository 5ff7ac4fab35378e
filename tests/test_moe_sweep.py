"""`sweeper run moe`, the smallest real version of it (issue 39, docs/models.md "Run an MoE
model for real"): the shipped space, its Mixtral-style config.json read from beside it, run
with `--set` to 6 trials (tp and ep experts, head- and batch-sharded decode attention, on 1
and 2 emulated chips; 6 is the fewest `sweeper fit` takes) on a real local Ray, a real
SQLite Optuna study and a real SQLite MLflow store. Each trial also runs the unsharded
reference (the space's `verify: true`); `sweeper fit` then scores the cost model on them as
on a dense study. Timings and the fit's errors are never asserted.

slow and ci_slow: a few minutes on 2 cores, most of it compiling (CI's second stage)."""

from __future__ import annotations

import json
import math
import os

import pytest

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips
from requires import require  # noqa: E402

from sweeper.analysis import observations  # noqa: E402
from sweeper.analysis.calibrate import load_study_data  # noqa: E402
from sweeper.cli import main  # noqa: E402
from workloads.hardware import load_hardware  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ci_slow]

SMALLEST = ["--set", "params.chips=[1,2]", "--set", "params.decode_ffn=[ws1d]",
            "--set", "params.decode_attn=[head,batch]", "--set", "trials=6", "--set", "repeats=2"]


@pytest.fixture(scope="module")
def moe_study(session_sweeper_home, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)     # host profile measured once
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    storage = f"sqlite:///{root / 'optuna.db'}"
    try:
        code = main(["run", "moe", "--study", "moe-small", "--storage", storage,
                     "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}", "--no-analysis",
                     "--json", *SMALLEST])
        assert code == 0
        yield load_study_data("moe-small", storage), storage
    finally:
        if started:
            ray.shutdown()
        if old is None:
            os.environ.pop("SWEEPER_HOME", None)
        else:
            os.environ["SWEEPER_HOME"] = old


def test_the_moe_space_runs_tp_and_ep_and_every_trial_matches_the_reference(moe_study):
    df = moe_study[0].frame
    require(len(df) == 6, f"6 trials, got {len(df)}")
    assert (df.state == "COMPLETE").all(), df.reason.tolist()
    assert set(df.experts) == {"tp", "ep"} and set(df[df.experts == "ep"].chips) >= {2}
    assert (df.source == "measured").all()
    # the model is the config.json beside the space: 4 experts, top-2 (search_spaces/tiny-mixtral.json)
    assert df.model.str.contains("tiny-mixtral").all(), df.model.tolist()
    assert (df.tokens_match == 1).all(), df[["experts", "tokens_match"]].to_dict("records")
    assert df.verify_max_abs_err.between(0, 0.1).all(), df.verify_max_abs_err.tolist()
    assert df.decode_step_s.gt(0).all() and df.pred_decode_step_s.gt(0).all()


def test_the_cost_model_scores_moe_trials_and_names_ep_apart(moe_study, capsys):
    data, storage = moe_study
    host = load_hardware("host")
    points = observations.from_frame(data.frame, host, data.configs)
    assert len(points) == 12                      # prefill and decode of each trial
    assert all(p.config.model.moe for p in points)
    for p in points:
        predicted = observations.predict_value(p, host)
        assert math.isfinite(predicted) and predicted > 0, (p.info, predicted)
    capsys.readouterr()
    assert main(["fit", "--study", "moe-small", "--storage", storage, "--no-mlflow",
                 "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["n_trials"] == 6 and fit["n_points"] == 12 and math.isfinite(fit["mape_heldout"])
    layouts = {(e["phase"], e["layout"]) for e in fit["errors"]}
    expected = {(p.phase, p.info["layout"]) for p in points}
    assert expected <= layouts and any(layout.endswith("/ep") for _, layout in expected)
