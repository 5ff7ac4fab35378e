"""Nothing a serving trial measured is lost (issue 19): its worker's whole
`Measurement.extra["serving"]` (per-request records with tokens, slices, warm-up, the
prediction note) is the `serving.json` artifact of the trial's MLflow child run, and the
prediction note in one line is the Optuna user attr and MLflow tag `prediction_note`
(docs/serving.md, "Serving trials in `sweeper run`").

A real sweep (real Ray workers serving on the emulated mesh, a real SQLite Optuna study and
MLflow store) of two trials: `pad_heads: auto`, which the serving model predicts, and
`pad_heads: 16`, which it does not describe (its `pred_*` are NaN and the note says why).
"""

from __future__ import annotations

import json
import math

import optuna
from mlflow.tracking import MlflowClient

from sweeper.sweep.controller import run_sweep
from sweeper.sweep.recording import prediction_note
from sweeper.spec.space import load_space
from sweeper.tracking.results import load_trials
from workloads.serving.trial import trial_requests

SPACE = {"name": "serving-records", "model": "tiny", "hardware": "host", "chips": 1,
         "batch": 2, "serving": {"rate": 40, "requests": 4, "input_len": 16, "output_len": 4},
         "params": {"pad_heads": ["auto", 16]}, "sampler": {"type": "grid"}, "trials": 2,
         "timeout_s": 120}


def test_a_serving_trials_requests_and_prediction_note_are_stored(session_sweeper_home,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    space = load_space(SPACE)
    result = run_sweep(space, progress=False, storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.counts == {"complete": 2, "failed": 0, "pruned": 0}, \
        load_trials(result.study_name, result.storage).reason.tolist()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    client = MlflowClient(tracking_uri=result.tracking_uri)
    notes = {}
    for trial in study.trials:
        run_id = trial.user_attrs["mlflow_run_id"]
        folder = client.download_artifacts(run_id, "serving.json", str(tmp_path / run_id))
        with open(folder) as f:
            serving = json.load(f)
        # the per-request records: one per request of the trial's stream, in order, each
        # with its arrival, lengths, times and the tokens the engine answered
        requests = trial_requests(space.trial_config(trial.params))
        records = serving["per_request"]
        assert len(records) == serving["requests"] == len(requests) == 4
        for record, request in zip(records, requests):
            assert record["arrival_s"] == request.arrival_s
            assert (record["input_len"], record["output_len"]) == (16, 4)
            assert len(record["tokens"]) == 4 and all(isinstance(t, int) for t in record["tokens"])
            assert record["finish_s"] >= record["first_token_s"] >= record["arrival_s"]
        assert serving["deployment"] == "aggregated" and serving["slots"] == 2
        # the note in one line: Optuna attr == MLflow tag == the artifact's note, summarised
        note = trial.user_attrs["prediction_note"]
        assert client.get_run(run_id).data.tags["prediction_note"] == note
        assert note == prediction_note(serving["prediction"])
        notes[trial.params["pad_heads"]] = (note, serving["prediction"], trial)
    note, full, trial = notes["auto"]
    # a host trial: the serving model on its calls measured before the stream, not analytical
    assert full["source"] == "measured calls" and note.startswith("measured calls: serving model")
    assert math.isfinite(trial.user_attrs["measurement"]["pred_ttft_p99_s"])
    note, full, trial = notes[16]
    assert full["source"] is None and "pad_heads" in full["reason"]
    assert note == f"no prediction: {full['reason']}"
    assert "pred_ttft_p99_s" not in trial.user_attrs["measurement"]     # NaN: not stored
