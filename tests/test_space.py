"""Search-space files: validation (one-line errors), Optuna distributions, sampled points.

No Ray, no Optuna storage, no MLflow here: a space is checked before any of them start.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from sweeper.spec.space import (AUTO_TOPOLOGY, NUMERIC_METRICS, PARAM_NAMES, SearchSpace, auto_topology,
                           load_space)
from workloads.config import ConfigError
from workloads.costmodel import best_topology
from workloads.layouts import PhaseLayout
from workloads.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[1]
SPACES = sorted((ROOT / "search_spaces").glob("*.yaml"))
SHIPPED = {"quickstart", "prefill-layouts", "decode-layouts", "attention-context", "paper-540b"}


def minimal(**extra) -> dict:
    data = {"name": "t", "model": "tiny", "hardware": "host", "batch": 4, "chips": 2}
    data.update(extra)
    return {k: v for k, v in data.items() if v is not None}   # None: leave the field out


def error_of(data, source="space.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_space(data, source=source)
    return info.value


# ----------------------------------------------------------------------------- shipped files


def test_every_paper_question_has_a_space_file():
    assert SHIPPED <= {p.stem for p in SPACES}


@pytest.mark.parametrize("path", SPACES, ids=[p.stem for p in SPACES])
def test_shipped_space_files_validate(path):
    space = load_space(str(path))
    assert space.name == path.stem
    assert space.text == path.read_text()
    assert 1 <= space.planned_trials() <= space.trials
    # every sampled point builds a TrialConfig or is rejected with a one-line ConfigError
    sampler = space.make_sampler()
    study = optuna.create_study(directions=space.directions, sampler=sampler)
    for _ in range(5):
        trial = study.ask(space.distributions())
        try:
            config = space.trial_config(trial.params)
        except ConfigError as err:
            assert "\n" not in str(err)
        else:
            assert config.topology is not None
            assert set(config.flat_params()) >= {"model", "chips", "batch", "topology"}
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)


def test_quickstart_is_small_enough_for_two_cores():
    space = load_space(str(ROOT / "search_spaces" / "quickstart.yaml"))
    assert space.model.name == "tiny" and space.hardware.kind == "host"
    assert space.trials <= 24 and space.parallel == 2
    assert {p.name for p in space.params} >= {"batch", "chips"}
    assert max(next(p for p in space.params if p.name == "chips").choices) <= 4


def test_paper_540b_is_analytical_on_tpu_v4():
    space = load_space(str(ROOT / "search_spaces" / "paper-540b.yaml"))
    assert space.hardware.source == "analytical"
    assert space.hardware.load_profile().name == "tpu-v4"
    assert space.model.name.startswith("palm-540b")
    assert {p.name for p in space.params} >= {"batch", "chips", "weights"}


# ----------------------------------------------------------------------------- conversion


def test_params_become_optuna_distributions():
    space = load_space(minimal(chips=None, params={
        "chips": [1, 2, 4], "batch": {"low": 1, "high": 64, "log": True},
        "input_len": {"low": 16, "high": 64, "step": 16}, "decode_ffn": ["ws1d", "ws2d"]},
        batch=None))
    dists = space.distributions()
    assert dists["chips"] == optuna.distributions.CategoricalDistribution((1, 2, 4))
    assert dists["batch"] == optuna.distributions.IntDistribution(1, 64, log=True)
    assert dists["input_len"] == optuna.distributions.IntDistribution(16, 64, step=16)
    assert space.grid()["batch"] == [1, 2, 4, 8, 16, 32, 64]
    assert space.grid()["input_len"] == [16, 32, 48, 64]
    assert space.grid_size() == 3 * 7 * 4 * 2


def test_a_point_becomes_a_trial_config():
    space = load_space(minimal(chips=None, input_len=16, decode_steps=4,
                               prefill={"ffn": "wg_xyz"}, params={
                                   "chips": [4], "decode_attn": ["batch"], "weights": ["int8"]}))
    config = space.trial_config({"chips": 4, "decode_attn": "batch", "weights": "int8"})
    assert (config.chips, config.batch, config.input_len, config.decode_steps) == (4, 4, 16, 4)
    assert config.prefill == PhaseLayout("wg_xyz", "head")
    assert config.decode == PhaseLayout("ws2d", "batch")
    assert config.weights == "int8"
    assert config.topology == best_topology(config.model, 4)     # topology auto


def test_ffn_param_sets_both_phases():
    space = load_space(minimal(params={"ffn": ["ws1d", "ws2d"], "attn": ["batch"]}))
    config = space.trial_config({"ffn": "ws1d", "attn": "batch"})
    assert config.prefill == config.decode == PhaseLayout("ws1d", "batch")


def test_auto_topology_puts_mixed_ws1d_on_x_equal_1():
    space = load_space(minimal(chips=4, batch=8, params={"decode_ffn": ["ws1d", "ws2d"]}))
    mixed = space.trial_config({"decode_ffn": "ws1d"})
    assert mixed.topology[0] == 1 and mixed.prefill.ffn == "ws2d"
    model = space.model
    assert auto_topology(model, 4, PhaseLayout("ws2d"), PhaseLayout("ws2d"), 8) == best_topology(model, 4)


def test_explicit_topology_choice_and_auto():
    space = load_space(minimal(chips=4, params={"topology": ["auto", "1x2x2", [2, 2, 1]]}))
    assert space.params[0].choices == (AUTO_TOPOLOGY, "1x2x2", "2x2x1")
    assert space.trial_config({"topology": "2x2x1"}).topology == (2, 2, 1)


def test_a_point_that_cannot_run_raises_a_one_line_reason_without_file_name():
    space = load_space(minimal(chips=4, batch=2, params={"decode_attn": ["head", "batch"]}),
                       source="s.yaml")
    with pytest.raises(ConfigError) as info:
        space.trial_config({"decode_attn": "batch"})
    message = str(info.value)
    assert "batch" in message and "multiple of" in message and "s.yaml" not in message
    with pytest.raises(ConfigError, match="X\\*Y\\*Z equal to chips=4"):
        load_space(minimal(chips=4, params={"topology": ["2x2x2", "auto"]})).trial_config(
            {"topology": "2x2x2"})


def test_a_space_none_of_whose_points_can_run_is_rejected_at_load():
    err = error_of(minimal(chips=4, batch=2, params={"decode_attn": ["batch"]}))
    assert err.field == "batch" and "no point of this space can run" in str(err)
    assert str(err).startswith("space.yaml: ")
    err = error_of(minimal(chips=4, params={"topology": ["2x2x2"]}))
    assert err.field == "topology"


def test_flat_params_of_an_invalid_point_are_still_complete():
    space = load_space(minimal(chips=4, batch=2, params={"decode_attn": ["head", "batch"]}))
    flat = space.flat_params({"decode_attn": "batch"})
    assert flat["decode_attn"] == "batch" and flat["chips"] == 4 and flat["topology"] == "auto"


@pytest.mark.parametrize("kind, cls", [("tpe", "TPESampler"), ("nsga2", "NSGAIISampler"),
                                       ("random", "RandomSampler"), ("grid", "GridSampler")])
def test_samplers_are_built_from_the_space(kind, cls):
    data = minimal(batch=None, params={"batch": [4, 8]}, sampler={"type": kind, "seed": 3})
    assert isinstance(load_space(data).make_sampler(), getattr(optuna.samplers, cls))


def test_constraint_values_follow_optuna_convention():
    space = load_space(minimal(constraints=["decode_step_s <= 0.05", "prefill_mfu >= 0.1"]))
    low, high = space.constraints
    assert low.value({"decode_step_s": 0.04}) < 0 < low.value({"decode_step_s": 0.06})
    assert high.value({"prefill_mfu": 0.2}) < 0 < high.value({"prefill_mfu": 0.05})
    assert low.value({}) == float("inf")


def test_objectives_default_to_figure_1_axes():
    space = load_space(minimal())
    assert space.metric_names == ["decode_step_s", "decode_cost_chip_s_per_token"]
    assert space.directions == ["minimize", "minimize"]
    assert set(NUMERIC_METRICS) <= set(METRIC_NAMES)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("data, field, hint", [
    (minimal(bach=4), "bach", "did you mean 'batch'"),
    (minimal(params={"bacth": [1, 2]}), "params", "did you mean 'batch'"),
    (minimal(params={"decode_ffn": ["ws3d"]}), "params.decode_ffn.choices", "did you mean 'ws2d'"),
    (minimal(objectives=[{"metric": "decode_step"}]), "objectives[0].metric", "did you mean 'decode_step_s'"),
    (minimal(objectives=[{"metric": "prefill_s", "direction": "min"}]), "objectives[0].direction", "minimize"),
    (minimal(constraints=["decode_step_s < fast"]), "constraints[0].bound", "a number"),
    (minimal(constraints=["latency <= 1"]), "constraints[0].metric", "numeric Measurement field"),
    (minimal(constraints=["decode_step_s"]), "constraints[0]", "decode_step_s <= 0.05"),
    (minimal(sampler={"type": "tpee"}), "sampler.type", "did you mean 'tpe'"),
    (minimal(sampler={"type": "tpe", "options": {"n_startup": 3}}), "sampler.options.n_startup",
     "did you mean 'n_startup_trials'"),
    (minimal(hardware="analytical:tpu-v3"), "hardware", "did you mean 'tpu-v4'"),
    (minimal(hardware="hots"), "hardware", "did you mean 'host'"),
    (minimal(hardware="analytical"), "hardware", "analytical:<profile"),
    (minimal(model="tiyn"), "model", "did you mean 'tiny'"),
    (minimal(trials=0), "trials", "integer >= 1"),
    (minimal(parallel="two"), "parallel", "integer >= 1"),
    (minimal(timeout_s=-1), "timeout_s", "positive"),
    (minimal(memory_budget_bytes="lots"), "memory_budget_bytes", "32GiB"),
    (minimal(resources={"GPU": "one"}), "resources.GPU", "number"),
    (minimal(params={"batch": [4, 8]}), "params.batch", "not also fixed"),
    (minimal(prefill={"ffn": "ws2d"}, params={"prefill_ffn": ["wg_x"]}), "params.prefill_ffn", "not also fixed"),
    (minimal(params={"ffn": ["ws1d"], "decode_ffn": ["ws2d"]}), "params.ffn", "not both"),
    (minimal(params={"batch": {"low": 8, "high": 4}}, batch=None), "params.batch.high", ">= low=8"),
    (minimal(params={"weights": {"low": 1, "high": 2}}), "params.weights", "categorical"),
    (minimal(params={"chips": {"low": 1, "high": 8, "log": True, "step": 2}}, chips=None),
     "params.chips.step", "log ranges"),
    (minimal(params={"batch": []}, batch=None), "params.batch.choices", "non-empty"),
    (minimal(params={"batch": [4, 4]}, batch=None), "params.batch.choices", "without repeats"),
    (minimal(params={"topology": ["2x2"]}, chips=None), "params.topology.choices", "XxYxZ"),
    (minimal(objectives=["prefill_compute_s"]), "objectives[0].metric", "cost-model predictions"),
    (minimal(objectives=["decode_step_s", "decode_step_s"]), "objectives", "distinct"),
    (minimal(name="my sweep"), "name", "letters"),
])
def test_bad_input_is_one_line_naming_file_field_value_and_what_is_accepted(data, field, hint):
    err = error_of(data)
    message = str(err)
    assert err.field == field, message
    assert err.source == "space.yaml", message
    assert hint in message
    assert "\n" not in message and message.startswith("space.yaml: ")


def test_required_batch_and_chips():
    assert error_of(minimal(chips=None)).field == "chips"


def test_gp_sampler_without_torch_is_rejected_with_the_fix(monkeypatch):
    real = importlib.util.find_spec        # torch hidden, so the test runs where it is installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    err = error_of(minimal(sampler={"type": "gp"}))
    assert err.field == "sampler.type" and "pip install torch" in str(err)


def test_grid_caps_trials_at_grid_size():
    space = load_space(minimal(chips=None, params={"chips": [1, 2]}, trials=50,
                               sampler={"type": "grid"}))
    assert space.planned_trials() == 2


def test_model_and_hardware_yaml_are_found_next_to_the_space(tmp_path):
    (tmp_path / "mymodel.yaml").write_text(yaml.safe_dump(
        {"name": "mine", "d_model": 64, "d_ff": 256, "n_layers": 1, "n_heads": 4, "n_kv_heads": 1,
         "d_head": 16, "vocab": 128}))
    (tmp_path / "chip.yaml").write_text(yaml.safe_dump(
        {"name": "chip", "peak_flops": "100 TFLOP/s", "hbm_bandwidth": "1 TB/s", "hbm_bytes": "16GiB",
         "ici_bandwidth": "100 GB/s"}))
    space_file = tmp_path / "s.yaml"
    space_file.write_text(yaml.safe_dump(minimal(model="mymodel.yaml", hardware="analytical:chip.yaml")))
    space = load_space(str(space_file))
    assert space.model.name == "mine"
    assert space.hardware.load_profile().name == "chip"


def test_missing_file_and_bad_yaml(tmp_path):
    assert error_of(str(tmp_path / "nope.yaml"), source=None).field == "file"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    err = error_of(str(bad), source=None)
    assert "line" in err.field and str(bad) in str(err)


def test_every_searchable_name_is_documented_in_the_module():
    import sweeper.spec.space as module

    for name in PARAM_NAMES:
        assert name in module.__doc__


def test_cli_rejects_a_bad_space_with_exit_2_before_any_store_exists(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal(params={"decode_ffn": ["ws3d"]})))
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "run", str(bad)], capture_output=True,
                          text=True, env={**os.environ, "SWEEPER_HOME": str(home)}, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "params.decode_ffn.choices" in lines[0] and "ws2d" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not home.exists()      # no Optuna or MLflow store was created


def test_space_object_passes_through():
    space = load_space(minimal())
    assert load_space(space) is space and isinstance(space, SearchSpace)


def test_retry_oom_is_off_by_default_and_read_as_a_boolean():
    """The controller re-runs a worker the kernel killed for memory only when asked
    (sweeper/sweep/controller.py; docs/reliability.md)."""
    assert load_space(minimal()).retry_oom is False
    assert load_space(minimal(retry_oom=True)).retry_oom is True
    with pytest.raises(ConfigError, match="retry_oom.*true or false"):
        load_space(minimal(retry_oom="yes"))
