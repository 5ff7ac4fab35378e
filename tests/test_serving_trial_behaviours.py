"""Chunked prefill and pipeline stages in a sweep's serving trials (issue 38 item 4;
docs/serving-behaviours.md "Serving trials"): `prefill_chunk` and `stages` are TrialConfig
fields declared once (workloads/trial.py), so a space fixes or searches them and every
reader derives them (flat tables, Optuna params, MLflow params, the schema); bad
combinations are one ConfigError line before any Ray work; the trial's deployment, its
prediction and its server carry them; two real serving trials (a chunked one, a 2-stage
one) serve every request with the unsharded reference's tokens.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from sweeper.spec import space as sp
from sweeper.spec.schema import space_schema
from workloads.config import HARDWARE_PRESETS, ConfigError
from workloads.deployment import Deployment, PhaseSlice
from workloads.metrics import SERVING_PREDICTIONS
from workloads.serving.model import simulate
from workloads.serving.trial import predict_stream, trial_deployment, trial_requests
from workloads.trial import (FLAT_PARAMS, INT_FLAT_PARAMS, SEARCHABLE, TRIAL_FIELDS, TrialConfig,
                             field_help, nested_of)

SERVING = {"rate": 40, "requests": 5, "input_len": 10, "output_len": 4}
BASE = {"name": "s", "model": "tiny-serial", "hardware": "host", "chips": 2, "batch": 2,
        "serving": SERVING}
NEW = ("stages", "prefill_chunk")


def trial_of(**fields) -> TrialConfig:
    serving = fields.pop("serving", SERVING)
    return sp.load_space({**BASE, "serving": serving, **fields}).trial_config({})


# ----------------------------------------------------------------------------- declared once


def test_the_fields_are_declared_once_and_derived_everywhere():
    schema = space_schema()["properties"]
    for name in NEW:
        meta = TRIAL_FIELDS[name].metadata
        assert meta["serving_only"] and meta["integer"]
        assert name in FLAT_PARAMS and name in INT_FLAT_PARAMS and name in SEARCHABLE
        assert name in sp.PARAM_NAMES and name in sp.INT_PARAMS and name in sp.SERVING_ONLY
        assert schema[name]["description"].startswith(meta["help"])
        assert field_help(name).startswith(meta["help"])
    assert (TRIAL_FIELDS["stages"].default, TRIAL_FIELDS["prefill_chunk"].default) == (1, 0)


def test_a_trial_without_them_is_what_it_was():
    """Defaults: no stages, whole prompts; a non-serving trial's mesh is all its chips."""
    trial = TrialConfig.from_dict({"model": "tiny", "chips": 4, "batch": 4})
    assert (trial.stages, trial.prefill_chunk, trial.stage_chips) == (1, 0, 4)
    assert math.prod(trial.mesh_shape) == 4
    flat = trial.flat_params()
    assert (flat["stages"], flat["prefill_chunk"]) == (1, 0)
    assert TrialConfig.from_dict(nested_of(flat) | {"model": trial.model}).resolved() == trial.resolved()


@pytest.mark.parametrize("fields", [{"stages": 2}, {"prefill_chunk": 4},
                                    {"prefill_chunk": 4, "serving": {**SERVING, "prefix_len": 6}}])
def test_a_serving_trial_with_them_round_trips(fields):
    trial = trial_of(**fields)
    again = TrialConfig.from_dict(trial.to_dict())
    assert again == trial
    assert yaml.safe_load(yaml.safe_dump(trial.to_dict())) == trial.to_dict()
    flat = trial.flat_params()
    for name in NEW:
        assert flat[name] == getattr(trial, name)
    row = {k: float(v) if k in INT_FLAT_PARAMS else v for k, v in flat.items()}   # a table's
    nested = TrialConfig.from_dict({**nested_of(row), "model": trial.model,
                                    "serving": trial.serving})
    assert nested.resolved() == trial


def test_stages_make_the_topology_one_stages_mesh():
    trial = trial_of(stages=2)
    assert (trial.chips, trial.stage_chips, math.prod(trial.mesh_shape)) == (2, 1, 1)
    wide = trial_of(stages=2, chips=4, topology="1x1x2")
    assert wide.mesh_shape == (1, 1, 2)
    with pytest.raises(ConfigError) as err:
        sp.load_space({**BASE, "stages": 2, "chips": 4, "topology": "1x2x2"}, source="s.yaml")
    assert err.value.field == "topology" and "chips=4 / stages=2" in err.value.accepted


def test_a_space_searches_them_and_optuna_params_become_the_trial():
    space = sp.load_space({**BASE, "params": {"prefill_chunk": [0, 4, 8], "stages": [1, 2]},
                           "sampler": {"type": "grid"}})
    assert space.grid_size() == 6
    points = [p for p in sp.checked_points(space) if not isinstance(p, ConfigError)]
    assert sorted((p.prefill_chunk, p.stages) for p in points) == [(0, 1), (0, 2), (4, 1), (8, 1)]
    trial = space.trial_config({"prefill_chunk": 8, "stages": 1})
    assert (trial.prefill_chunk, trial.stages) == (8, 1)
    flat = space.flat_params({"prefill_chunk": 0, "stages": 2})
    assert (flat["prefill_chunk"], flat["stages"]) == (0, 2)
    with pytest.raises(ConfigError) as err:       # a searched bad combination: pruned
        space.trial_config({"prefill_chunk": 4, "stages": 2})
    assert err.value.field == "stages" and "prefill_chunk=4" in err.value.accepted


# ----------------------------------------------------------------------------- refused


BAD_TRIALS = [
    ({"stages": 2, "serving": None}, "stages", "outside a serving trial"),
    ({"prefill_chunk": 8, "serving": None}, "prefill_chunk", "outside a serving trial"),
    ({"prefill_chunk": 8, "serving_mode": "disaggregated"}, "prefill_chunk", "disaggregated"),
    ({"stages": 3}, "stages", "n_layers=2"),
    ({"stages": 2, "chips": 3, "topology": None}, "stages", "a divisor of chips=3"),
    ({"stages": 2, "prefill_chunk": 4}, "stages", "prefill_chunk=4"),
    ({"stages": 2, "serving": {**SERVING, "prefix_len": 6}}, "stages", "serving.prefix_len=6"),
    ({"stages": 2, "serving_mode": "disaggregated"}, "stages", "serving_mode='disaggregated'"),
    ({"stages": 0}, "stages", "an integer >= 1"),
    ({"prefill_chunk": -1}, "prefill_chunk", "an integer >= 0"),
    ({"prefill_chunk": 4, "model": "tiny-moe"}, "prefill_chunk", "mixture-of-experts"),
]


@pytest.mark.parametrize("fields, field, needle", BAD_TRIALS,
                         ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_TRIALS)])
def test_a_bad_combination_is_one_line_naming_the_file_field_and_value(fields, field, needle):
    serving = fields.get("serving", SERVING)
    data = {"model": "tiny-serial", "chips": 2, "batch": 2, "input_len": 10, "decode_steps": 3,
            **{k: v for k, v in fields.items() if k != "serving"}}
    if serving is not None:
        data["serving"] = serving
    with pytest.raises(ConfigError) as err:
        TrialConfig.from_dict(data, source="t.yaml")
    message = str(err.value)
    assert err.value.field == field and needle in message and "\n" not in message, message
    assert message.startswith(f"t.yaml: {field}: got ")


@pytest.mark.parametrize("space, field", [
    ({"stages": 2}, "stages"),
    ({"params": {"prefill_chunk": [0, 8]}}, "prefill_chunk")])
def test_a_space_without_a_serving_block_refuses_them(space, field):
    data = {**{k: v for k, v in BASE.items() if k != "serving"}, "input_len": 8,
            "decode_steps": 2, **space}
    with pytest.raises(ConfigError) as err:
        sp.load_space(data, source="s.yaml")
    assert err.value.field == field and "serving: block" in str(err.value)
    defaults = {**data, "params": {}, "stages": 1, "prefill_chunk": 0}     # their defaults: fine
    assert sp.load_space(defaults).fixed["stages"] == 1


def test_a_space_no_point_of_which_can_run_is_refused_at_load():
    with pytest.raises(ConfigError) as err:
        sp.load_space({**BASE, "stages": 2, "prefill_chunk": 4}, source="s.yaml")
    assert err.value.field == "stages" and "no point of this space can run" in str(err.value)


# ----------------------------------------------------------------------------- deployment


@pytest.mark.parametrize("fields", [{"prefill_chunk": 4}, {"stages": 2}])
def test_the_prediction_is_the_serving_model_of_the_same_deployment(fields):
    """`trial_deployment` carries the chunk and the stages (the plan's fields), so the
    recorded prediction is `simulate` of what the server runs."""
    trial = trial_of(**fields)
    hardware = HARDWARE_PRESETS["tpu-v4"]
    d = trial_deployment(trial, hardware)
    assert (d.prefill.chunk, d.decode.chunk) == (trial.prefill_chunk, 0)
    assert d.prefill.stages == d.decode.stages == trial.stages
    assert d.decode.chips == trial.chips and d.decode.topology == tuple(trial.mesh_shape)
    reqs = trial_requests(trial)
    predicted, note = predict_stream(trial, reqs, hardware)
    expected = simulate(Deployment(
        trial.model, hardware, "aggregated",
        PhaseSlice(chips=2, replicas=1, ffn="ws2d", attn="head", batch=1, weights="bf16",
                   topology=tuple(trial.mesh_shape), stages=trial.stages,
                   chunk=trial.prefill_chunk),
        PhaseSlice(chips=2, replicas=1, ffn="ws2d", attn="head", batch=2, weights="bf16",
                   topology=tuple(trial.mesh_shape), stages=trial.stages)), reqs).summary()
    for name in SERVING_PREDICTIONS:
        assert predicted[name] == expected[name[len("pred_"):]], name
    assert note["source"] == "analytical"


def test_a_staged_trials_cost_model_check_is_one_stages():
    """The sweep's feasibility check and recorded prediction of a staged trial are those of
    one stage: its layers on its chips (`costmodel.one_stage`)."""
    from workloads.costmodel import feasibility, one_stage, predict_trial

    trial = trial_of(stages=2)
    stage = one_stage(trial)
    assert (stage.chips, stage.stages, stage.model.n_layers) == (1, 1, 1)
    hardware = HARDWARE_PRESETS["tpu-v4"]
    assert feasibility(trial, hardware) is None
    assert predict_trial(trial, hardware).decode_step_s == predict_trial(stage, hardware).decode_step_s
    assert one_stage(trial_of()) == trial_of()


# ----------------------------------------------------------------------------- real trials


@pytest.mark.parametrize("fields", [{"prefill_chunk": 4}, {"stages": 2}], ids=["chunk", "stages"])
def test_a_real_serving_trial_serves_the_references_tokens(fields):
    """`run_serving_trial` (what a sweep's mesh worker runs) on the emulated mesh, this host's
    measured profile (so it measures its calls before the stream on its own server): every
    request completes with the unsharded reference's tokens, the metrics and the prediction
    are there, and the record says which behaviour ran."""
    from workloads.model import prompt_tokens
    from workloads.serving.slots import reference_generation
    from workloads.serving.trial import run_serving_trial

    trial = trial_of(**fields)
    host = dataclasses.replace(HARDWARE_PRESETS["tpu-v4"], name="host", measured=True)
    measurement = run_serving_trial(trial, host)
    reqs = trial_requests(trial)
    serving = measurement.extra["serving"]
    assert measurement.completed == len(reqs)
    assert (serving["prefill_chunk"], serving["stages"]) == (trial.prefill_chunk, trial.stages)
    for name in ("ttft", "tpot"):
        assert 0 < getattr(measurement, f"{name}_p50_s") <= getattr(measurement, f"{name}_p99_s")
        assert math.isfinite(getattr(measurement, f"pred_{name}_p50_s"))
    assert serving["prediction"]["step_times"].startswith("measured before the stream")
    by_len = serving["measured_before_stream"]["engine_prefill_by_len_s"]
    assert (str(trial.prefill_chunk) in by_len) == bool(trial.prefill_chunk)
    for i, (r, record) in enumerate(zip(reqs, serving["per_request"])):
        prompt = prompt_tokens(trial.model, 1, r.input_len, trial.seed * 1_000_003 + i)[0]
        _, ref = reference_generation(trial.model, trial.seed, prompt, r.output_len - 1)
        assert record["tokens"] == [int(t) for t in ref], f"request {i}"


@pytest.mark.slow
@pytest.mark.ci_slow
def test_a_sweep_searches_chunks_and_stages_on_real_serving_trials(session_sweeper_home,
                                                                    tmp_path, monkeypatch):
    """A real `sweeper run` (Ray mesh workers, SQLite Optuna study, MLflow) of a grid over
    `prefill_chunk` x `stages`: the point that combines both is PRUNED with the reason, the
    others complete with every request answered, and the Optuna params, the results table
    and the MLflow child runs carry both fields."""
    import optuna

    from sweeper.sweep.controller import run_sweep
    from sweeper.tracking.results import load_runs, load_trials

    monkeypatch.setenv("SWEEPER_HOME", str(session_sweeper_home))
    space = sp.load_space({**BASE, "name": "behaviours",
                           "serving": {"rate": 40, "requests": 4, "input_len": 8,
                                       "output_len": 3},
                           "params": {"prefill_chunk": [0, 4], "stages": [1, 2]},
                           "sampler": {"type": "grid"}, "trials": 4, "timeout_s": 180})
    result = run_sweep(space, progress=False, storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                       tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    table = load_trials(result.study_name, result.storage)
    assert result.counts == {"complete": 3, "failed": 0, "pruned": 1}, table.reason.tolist()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    for trial in study.trials:
        chunk, stages = trial.params["prefill_chunk"], trial.params["stages"]
        if chunk and stages > 1:
            assert "prefill_chunk=4" in trial.user_attrs["reason"]
            continue
        assert trial.user_attrs["measurement"]["completed"] == 4
        assert (trial.user_attrs["config"]["prefill_chunk"],
                trial.user_attrs["config"]["stages"]) == (chunk, stages)
    assert sorted(zip(table.prefill_chunk, table.stages)) == [(0, 1), (0, 2), (4, 1), (4, 2)]
    runs = load_runs(result.tracking_uri, parent_run_id=result.parent_run_id)
    assert sorted(zip(runs.prefill_chunk.astype(int), runs.stages.astype(int))) == \
        [(0, 1), (0, 2), (4, 1), (4, 2)]
