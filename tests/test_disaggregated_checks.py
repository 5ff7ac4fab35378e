"""A disaggregated serving trial is checked per slice (docs/space-files.md, "Serving trials"):
its prefill slice and its decode slice run on half the trial's chips each, so its layouts are
validated, its memory checked and its cost-model prediction recorded for those slices, never
for the whole mesh (which never runs). Aggregated trials are checked on the whole mesh as
before. Real space loading, the sweep's own pre-flight `check_point` and the cost model; the
numbers compared are analytical.
"""

from __future__ import annotations

import pytest
import yaml

from sweeper.sweep.preflight import check_point
from sweeper.spec.space import load_space
from test_bad_input import check_rejected, run_cli
from workloads.config import HARDWARE_PRESETS, ConfigError
from workloads.costmodel import bytes_text, predict, slice_predictions
from workloads.layouts import validate_layouts

PROFILE = HARDWARE_PRESETS["tpu-v4"]     # a host space's budget is memory_budget_bytes here
DISAGGREGATED = {"name": "d", "model": "tiny", "hardware": "host", "chips": 2, "batch": 1,
                 "serving_mode": "disaggregated",
                 "serving": {"rate": 40, "requests": 8, "input_len": 16, "output_len": 4}}


def aggregated(spec: dict) -> dict:
    return {**spec, "serving_mode": "aggregated"}


@pytest.mark.parametrize("layout", [{"decode": {"attn": "batch"}}, {"prefill": {"attn": "batch"}},
                                    {"batch": 3, "decode": {"attn": "batch"}}],
                         ids=["decode-batch-attn", "prefill-batch-attn", "odd-batch"])
def test_a_point_that_fits_each_half_but_not_the_whole_mesh_runs(layout):
    """Batch-sharded attention needs the batch (one prompt per prefill call, `batch` decode
    slots) to be a multiple of the chips it spans: 1 chip per slice takes any batch, the
    whole 2-chip mesh does not. Such a point used to be pruned; now it is a trial whose
    pre-flight finds no reason and predicts the two slices."""
    spec = {**DISAGGREGATED, **layout, "params": {"seed": [0, 1]}}
    trial = load_space(spec).trial_config({"seed": 0})
    with pytest.raises(ConfigError):      # the whole mesh refuses it: the case is real
        validate_layouts(trial.run_model, trial.mesh_shape, trial.prefill, trial.decode, 1)
    with pytest.raises(ConfigError, match="multiple of chips=2"):    # aggregated: unchanged
        load_space(aggregated(spec))
    reason, prediction = check_point(load_space(spec), trial, PROFILE)
    assert reason is None
    slices = trial.slice_trials()
    assert {phase: (part.chips, part.batch) for phase, part in slices.items()} == \
        {"prefill": (1, 1), "decode": (1, trial.batch)}
    # each phase's prediction is the slice that runs it: one prompt on the prefill slice,
    # `batch` slots on the decode slice
    assert prediction["prefill_s"] == predict(slices["prefill"], PROFILE).prefill_s
    assert prediction["decode_step_s"] == predict(slices["decode"], PROFILE).decode_step_s
    assert prediction["total_s"] == pytest.approx(
        prediction["prefill_s"] + trial.decode_steps * prediction["decode_step_s"])


def test_a_slices_layout_error_names_the_slice_and_exits_2(tmp_path):
    """4 chips: each slice has 2, so one decode slot cannot be split by batch-sharded
    attention; the error is about the decode slice, one line, exit 2 before anything runs."""
    spec = {**DISAGGREGATED, "chips": 4, "decode": {"attn": "batch"}}
    with pytest.raises(ConfigError) as err:
        load_space(spec)
    assert err.value.field == "batch" and "on the decode slice (2 of the 4 chips" in str(err.value)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(spec))
    home, imports = tmp_path / "home", tmp_path / "imports.json"
    check_rejected(run_cli(["run", str(path)], home, imports), home, imports,
                   ["batch", "got 1", "on the decode slice", "no point of this space can run"],
                   path.name)


@pytest.mark.parametrize("batch, budget, slice_name", [(2, "4MiB", "prefill"),
                                                       (16, "5MiB", "decode")])
def test_a_point_whose_whole_mesh_fits_but_a_slice_does_not_is_pruned_naming_it(
        batch, budget, slice_name):
    """A slice holds all the weights on half the chips, so its memory per chip is larger
    than the whole mesh's: the whole-mesh check accepts a point whose slices will not fit.
    It is pruned, the reason naming the slice with the larger peak (the worse one decides)."""
    spec = {**DISAGGREGATED, "model": "small", "batch": batch, "memory_budget_bytes": budget,
            "params": {"seed": [0, 1]}}
    space = load_space(spec)
    trial = space.trial_config({"seed": 0})
    whole_space = load_space(aggregated(spec))
    whole = whole_space.trial_config({"seed": 0})
    assert predict(whole, PROFILE).peak_bytes_per_chip < space.memory_budget_bytes
    assert check_point(whole_space, whole, PROFILE)[0] is None      # aggregated: fits
    reason, prediction = check_point(space, trial, PROFILE)
    peaks = {phase: m.peak_bytes_per_chip for phase, m in slice_predictions(trial, PROFILE).items()}
    assert max(peaks, key=peaks.get) == slice_name
    assert reason.startswith(f"memory: {slice_name} slice (1 chip, topology 1x1x1)"), reason
    assert (f"= {bytes_text(peaks[slice_name])} per chip exceeds the budget of "
            f"{bytes_text(space.memory_budget_bytes)}") in reason
    assert prediction["peak_bytes_per_chip"] == peaks[slice_name] > space.memory_budget_bytes
    assert prediction["fits"] == 1.0     # the tpu-v4 profile's HBM holds it: only the budget refuses


def test_a_point_whose_slices_fit_but_whose_whole_mesh_does_not_runs():
    """The other direction: the whole mesh counts a prefill of `batch` prompts and both
    phases' working sets; the slices prefill one prompt per call and the decode slice only
    decodes, so 64 slots fit a budget the whole-mesh check refused."""
    spec = {**DISAGGREGATED, "batch": 64, "memory_budget_bytes": "2MiB",
            "serving": {**DISAGGREGATED["serving"], "output_len": 64}, "params": {"seed": [0, 1]}}
    space, whole_space = load_space(spec), load_space(aggregated(spec))
    whole = whole_space.trial_config({"seed": 0})
    assert check_point(whole_space, whole, PROFILE)[0].startswith("memory:")
    reason, prediction = check_point(space, space.trial_config({"seed": 0}), PROFILE)
    assert reason is None
    assert prediction["peak_bytes_per_chip"] <= space.memory_budget_bytes


def test_an_aggregated_serving_trial_is_checked_on_the_whole_mesh_with_one_prompt_per_prefill():
    """Aggregated: the whole mesh, as every other trial; its recorded prediction prefills one
    prompt per call as the serving loop does (`costmodel.predict_trial`), decode `batch`
    slots as `predict` does."""
    import dataclasses

    spec = {**aggregated(DISAGGREGATED), "chips": 2, "batch": 2, "memory_budget_bytes": "1GiB",
            "params": {"seed": [0, 1]}}
    space = load_space(spec)
    trial = space.trial_config({"seed": 0})
    assert not trial.disaggregated
    reason, prediction = check_point(space, trial, PROFILE)
    whole = predict(trial, PROFILE).metrics()
    one = predict(dataclasses.replace(trial, batch=1, decode=trial.prefill), PROFILE).metrics()
    assert reason is None
    assert prediction["prefill_s"] == one["prefill_s"] < whole["prefill_s"]
    assert prediction["decode_step_s"] == whole["decode_step_s"]
    assert prediction["total_s"] == pytest.approx(one["prefill_s"]
                                                  + trial.decode_steps * whole["decode_step_s"])


def test_a_host_space_whose_slices_do_not_fit_in_memory_is_refused_before_ray(monkeypatch):
    """`sweeper run`'s memory check of a `host` space (before Ray starts) checks the slices
    too, each in a process of its own on half the chips: on a host of 0.8 GiB + 18 MiB
    (the host's size is what is set here), one slice has (0.4 GiB + 9 MiB - 0.4 GiB per
    process) / 2 for XLA CPU = 4.5 MiB per chip, less than the 5.4 MiB the prefill slice
    needs; the aggregated trial of the same point (one process, 2 chips) fits."""
    from sweeper.sweep import preflight

    monkeypatch.setattr(preflight, "physical_memory_bytes", lambda: 0.8 * 2**30 + 18 * 2**20)
    spec = {**DISAGGREGATED, "model": "small", "batch": 2, "params": {"seed": [0, 1]}}
    preflight.check_memory_fits(load_space(aggregated(spec)))
    with pytest.raises(ConfigError, match="none does, e.g. memory: prefill slice"):
        preflight.check_memory_fits(load_space(spec))
