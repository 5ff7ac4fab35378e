"""Each trial field is declared once (TrialConfig's field metadata, workloads/trial.py) and
every reader derives from it: the trial file, the space file's fixed fields and searched
parameters, the JSON Schema, the flat parameters and the results columns (issue 21).

No Ray, Optuna storage or MLflow: the space is only loaded.
"""

from __future__ import annotations

import dataclasses

import jsonschema
import pandas as pd
import pytest
import yaml

from sweeper.spec import space as sp
from sweeper.spec.schema import space_schema
from sweeper.tracking import results
from workloads.config import MAX_FILE_BYTES, ConfigError, read_yaml
from workloads.layouts import PhaseLayout
from workloads.trial import (FIELDS, FLAT_PARAMS, INT_FLAT_PARAMS, LAYOUT_PARAMS, PHASE_PARTS,
                             SEARCHABLE, TRIAL_FIELDS, TrialConfig)

TRIAL = {"model": "tiny", "chips": 2, "batch": 4}
SPACE = {"name": "t", "model": "tiny", "hardware": "host", "chips": 2, "batch": 4}
INTEGER_FIELDS = [name for name, f in TRIAL_FIELDS.items() if f.metadata.get("integer")]
# a serving trial's fields (stages, prefill_chunk): searched in a space with a serving: block
SERVING_SPACE = {**SPACE, "serving": {"rate": 1, "input_len": 8, "output_len": 4}}


def schema_errors(document: dict) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(space_schema()).iter_errors(document)]


def test_every_field_says_what_it_accepts():
    kinds = ("integer", "choices", "parts", "parse")
    for name, f in TRIAL_FIELDS.items():
        meta = f.metadata
        assert meta.get("help"), name
        declared = [k for k in kinds if meta.get(k)] + (["number"] if not any(meta.get(k) for k in kinds)
                                                        and meta.get("minimum") is not None else [])
        assert len(declared) == 1, (name, declared)        # one way to check each field
        if meta.get("integer"):
            assert isinstance(meta["minimum"], int), name
    assert set(PHASE_PARTS) == {f.name for f in dataclasses.fields(PhaseLayout)}


def test_a_trial_round_trips_through_plain_data():
    trial = TrialConfig.from_dict({**TRIAL, "chips": 4, "topology": "1x2x2", "decode": {"ffn": "ws1d"},
                                   "decode_steps": 0, "seed": 7, "warmup": 0, "ci_target": 0,
                                   "pad_heads": "none", "hosts": 2, "weights": "int8"})
    data = trial.to_dict()
    assert tuple(data) == FIELDS
    assert yaml.safe_load(yaml.safe_dump(data)) == data             # plain YAML data
    assert TrialConfig.from_dict(data) == trial
    flat = trial.flat_params()
    assert tuple(flat) == FLAT_PARAMS
    assert (flat["topology"], flat["decode_ffn"], flat["prefill_ffn"], flat["seed"]) == ("1x2x2", "ws1d",
                                                                                         "ws2d", 7)


@pytest.mark.parametrize("name", INTEGER_FIELDS)
def test_an_integer_fields_minimum_is_one_rule_for_every_reader(name):
    """`seed`, `warmup` and `decode_steps` may be 0, the others not: declared once as `minimum`,
    applied by the trial file, the space's fixed fields and searched values, and the schema."""
    minimum = TRIAL_FIELDS[name].metadata["minimum"]
    assert getattr(TrialConfig.from_dict({**TRIAL, name: minimum}), name) == minimum
    with pytest.raises(ConfigError) as err:
        TrialConfig.from_dict({**TRIAL, name: minimum - 1})
    assert err.value.field == name and f"an integer >= {minimum}" in str(err.value)

    assert sp.load_space({**SPACE, name: minimum}).fixed[name] == minimum
    with pytest.raises(ConfigError) as err:
        sp.load_space({**SPACE, name: minimum - 1})
    assert err.value.field == name
    assert not schema_errors({**SPACE, name: minimum})
    assert schema_errors({**SPACE, name: minimum - 1})

    if name in sp.PARAM_NAMES:
        base = SERVING_SPACE if TRIAL_FIELDS[name].metadata.get("serving_only") else SPACE
        space = {k: v for k, v in base.items() if k != name}
        assert sp.load_space({**space, "params": {name: [minimum, minimum + 2]}}).params[0].choices[0] \
            == minimum
        for spec, field in (([minimum - 1], f"params.{name}.choices"),
                            ({"low": minimum - 1, "high": 4}, f"params.{name}.low")):
            with pytest.raises(ConfigError) as err:
                sp.load_space({**space, "params": {name: spec}})
            assert err.value.field == field and f"an integer >= {minimum}" in str(err.value)
            assert schema_errors({**space, "params": {name: spec}})


def test_the_lists_follow_the_fields_metadata():
    assert sp.FIXED_FIELDS == tuple(n for n in FIELDS if n != "model")
    assert set(sp.PARAM_NAMES) == set(SEARCHABLE) | set(PHASE_PARTS)
    assert set(sp.INT_PARAMS) == set(SEARCHABLE) & set(INT_FLAT_PARAMS)
    assert {"prefill_ffn", "decode_attn"} <= set(LAYOUT_PARAMS) <= set(FLAT_PARAMS)
    # the timing protocol is not a parameter of the trial: no column, not searchable
    for name in ("warmup", "ci_target", "time_budget_s"):
        assert name in FIELDS and name not in FLAT_PARAMS and name not in sp.PARAM_NAMES
    assert "repeats" in FLAT_PARAMS and "repeats" not in sp.PARAM_NAMES
    # a serving trial's fields: searchable, refused in a space without a serving: block
    assert set(sp.SERVING_ONLY) == {"serving_mode", "stages", "prefill_chunk"} <= set(SEARCHABLE)


def test_results_columns_are_the_flat_parameters_with_integers_typed():
    row = results.trial_row(number=0, state="COMPLETE", reason=None, source="measured",
                            hardware="host", params={"chips": "4", "batch": "8", "seed": "0",
                                                     "decode_ffn": "ws1d"},
                            metrics={}, prediction={}, mlflow_run_id=None)
    df = results.frame([row])
    assert [c for c in df.columns if c in FLAT_PARAMS] == list(FLAT_PARAMS)
    for name in INT_FLAT_PARAMS:
        assert isinstance(df[name].dtype, pd.Int64Dtype), name
    assert (df.loc[0, "chips"], df.loc[0, "seed"], df.loc[0, "decode_ffn"]) == (4, 0, "ws1d")


def test_the_schema_describes_each_field_with_its_help_and_unit():
    properties = space_schema()["properties"]
    for name in sp.FIXED_FIELDS:
        meta = TRIAL_FIELDS[name].metadata
        assert properties[name]["description"].startswith(meta["help"]), name
        if meta.get("unit"):
            assert f"[{meta['unit']}]" in properties[name]["description"], name
    jsonschema.Draft202012Validator.check_schema(space_schema())


def test_a_serving_block_is_kept_as_read_and_in_the_schema():
    serving = {"rate": 2, "ttft": 1.0, "input_len": "uniform:16:64"}
    space = sp.load_space({**SPACE, "serving": serving})
    assert space.serving == serving
    assert sp.load_space(SPACE).serving is None
    assert not schema_errors({**SPACE, "serving": serving})
    with pytest.raises(ConfigError) as err:
        sp.load_space({**SPACE, "serving": "fast"}, source="s.yaml")
    assert err.value.field == "serving" and str(err.value).startswith("s.yaml: serving: got 'fast'")
    assert schema_errors({**SPACE, "serving": "fast"})


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    # not YAML: parsing it would fail differently
    path.write_text("params: [unclosed\n" + "#" * MAX_FILE_BYTES)
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    message = str(err.value)
    assert err.value.field == "file" and str(path) in message
    assert f"at most {MAX_FILE_BYTES // 1024} KiB" in message
    assert f"{path.stat().st_size:,} bytes" in message
    path.write_text("name: [unclosed\n" + "#" * (MAX_FILE_BYTES - 100))   # under: parsed
    with pytest.raises(ConfigError, match="valid YAML"):
        read_yaml(path)


def test_a_flat_row_nests_back_to_the_same_trial():
    """`nested_of` is `flat_params_of`'s inverse (sweeper/analysis/observations.py reads a
    results row through it): integers stored as floats, an empty topology and a NaN seed
    fall back as the sweep would."""
    from workloads.trial import nested_of

    trial = TrialConfig.from_dict({**TRIAL, "weights": "int8", "seed": 7, "pad_heads": 16,
                                   "prefill": {"ffn": "wg_xy", "attn": "batch"}}).resolved()
    row = {k: float(v) if k in INT_FLAT_PARAMS else v for k, v in trial.flat_params().items()}
    again = TrialConfig.from_dict({**nested_of(row), "model": trial.model}).resolved()
    assert again == trial
    sparse = nested_of({**row, "topology": "", "seed": float("nan")})
    assert "topology" not in sparse and "seed" not in sparse


def test_the_analytical_commands_flags_say_what_the_trial_fields_say():
    import argparse

    from sweeper.cli import analytical
    from workloads.trial import field_help

    parser = argparse.ArgumentParser()
    analytical.add_parsers(parser.add_subparsers())
    predict = parser._subparsers._group_actions[0].choices["predict"]
    flags = {a.dest: a for a in predict._actions}
    for name in ("weights", "kv_cache", "pad_heads", "pad_vocab", "topology", "chips", "batch"):
        assert flags[name].help == field_help(name)
    assert flags["weights"].default == TrialConfig.__dataclass_fields__["weights"].default
