"""`sweeper run SPACE --set KEY=VALUE` overrides and `sweeper schema` (no Ray, no sweep):
overrides are validated exactly like the file and their errors name the override; the JSON
Schema accepts every shipped space file, rejects bad ones and is derived from the loader."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from sweeper.cli import main
from sweeper.spec import space as sp
from sweeper.spec.overrides import load_space_with_overrides, parse_override
from sweeper.spec.schema import space_schema
from workloads.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "search_spaces" / "quickstart.yaml"
SHIPPED = sorted(glob.glob(str(ROOT / "search_spaces" / "*.yaml")))


def test_overrides_change_the_space_before_validation():
    space = load_space_with_overrides(QUICKSTART, ["params.batch=[4,8]", "trials=3",
                                                   "sampler={type: random, seed: 7}",
                                                   "objectives.0.metric=total_s"])
    assert dict((p.name, p.choices) for p in space.params)["batch"] == (4, 8)
    assert space.trials == 3 and space.sampler.type == "random" and space.sampler.seed == 7
    assert space.objectives[0].metric == "total_s"
    # what ran is what MLflow logs as the space's text
    assert "# --set params.batch=[4,8]" in space.text and yaml.safe_load(space.text)["trials"] == 3
    # no override: the file as it is
    assert load_space_with_overrides(QUICKSTART, []).text == QUICKSTART.read_text()


@pytest.mark.parametrize("override, message", [
    ("params.batch=[0,4]", "quickstart.yaml with --set params.batch=[0,4]: params.batch.choices: got 0; "
                           "expected an integer >= 1"),
    ("params.bacth=[4]", "with --set params.bacth=[4]: params: got 'bacth'"),
    ("trials=many", "quickstart.yaml with --set trials=many: trials: got 'many'; expected an integer >= 1"),
    ("sampler.type=tpe2", "with --set sampler.type=tpe2: sampler.type: got 'tpe2'"),
    ("objectives.0.metric=speed", "with --set objectives.0.metric=speed: objectives[0].metric: got 'speed'"),
    ("trials", "--set: got 'trials'; expected KEY=VALUE"),
    ("params.batch=[4,", "--set params.batch: got '[4,'; expected a YAML value"),
    ("objectives.5.metric=total_s", "expected an index below"),
    ("trials.x=1", "not a mapping"),
])
def test_override_errors_name_the_override(override, message):
    with pytest.raises(ConfigError) as err:
        load_space_with_overrides(QUICKSTART, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_error_elsewhere_in_the_file_reads_as_a_file_error(tmp_path):
    data = yaml.safe_load(QUICKSTART.read_text())
    data["parallel"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_space_with_overrides(path, ["trials=2"])
    assert str(err.value) == str(pytest.raises(ConfigError, sp.load_space, str(path)).value)
    assert "--set" not in str(err.value)


def test_run_with_a_bad_override_exits_2_before_any_work(capsys):
    assert main(["run", str(QUICKSTART), "--set", "params.chips=[3]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sweeper run: error: ") and "--set params.chips=[3]" in err
    assert len(err.splitlines()) == 1


def test_parse_override_reads_values_as_yaml():
    assert parse_override("memory_budget_bytes=2GiB").value == "2GiB"
    assert parse_override("params.batch={low: 4, high: 32, log: true}").value == {
        "low": 4, "high": 32, "log": True}
    assert parse_override("description=").value is None


# ----------------------------------------------------------------------------- schema


def test_schema_accepts_every_shipped_space_file():
    validator = jsonschema.Draft202012Validator(space_schema())
    jsonschema.Draft202012Validator.check_schema(space_schema())
    assert len(SHIPPED) >= 5
    for path in SHIPPED:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(Path(path).read_text()))]
        assert not errors, (path, errors)


@pytest.mark.parametrize("change", [
    {"trails": 10},                                   # misspelt field
    {"params": {"decode_ffn": ["ws3d"]}},             # unknown layout
    {"params": {"batch": {"low": 4}}},                # a range without high
    {"objectives": [{"metric": "speed"}]},            # not a metric
    {"sampler": {"type": "bayes"}},
    {"hardware": "tpu"},
    {"constraints": ["decode_step_s == 1"]},
    {"prefill": {"ffn": "ws2d", "mlp": "x"}},
])
def test_schema_rejects_what_the_loader_rejects(change, tmp_path):
    data = {**yaml.safe_load(QUICKSTART.read_text()), **change}
    assert list(jsonschema.Draft202012Validator(space_schema()).iter_errors(data))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError):
        sp.load_space(str(path))


def test_schema_follows_the_loader(monkeypatch):
    schema = space_schema()
    assert set(schema["properties"]) == set(sp.SPACE_FIELDS) | set(sp.FIXED_FIELDS)
    assert set(schema["properties"]["params"]["properties"]) == set(sp.PARAM_NAMES)
    # a field the loader learns without a schema type fails here, not silently in editors
    monkeypatch.setattr(sp, "FIXED_FIELDS", sp.FIXED_FIELDS + ("new_field",))
    with pytest.raises(KeyError, match="new_field"):
        space_schema()


def test_schema_command_prints_the_schema(capsys, tmp_path):
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == space_schema()
    assert main(["schema", "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == space_schema()
