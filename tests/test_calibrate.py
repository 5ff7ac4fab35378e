"""Calibration: the fit recovers known constants from noisy synthetic data, held-out error
is computed on held-out points only, the fitted YAML loads back, `sweeper fit` works on a
real Optuna study and logs to its MLflow parent run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest

from sweeper.analysis import calibrate as cal
from sweeper.analysis import fit as calfit
from sweeper.analysis import holdout as calho
from synthetic import synthetic_trials
from workloads import costmodel
from workloads.config import COLLECTIVE_KINDS, HardwareProfile, load_hardware
from workloads.trial import TrialConfig

TRUTH = HardwareProfile(
    "truth", peak_flops=4e11, hbm_bandwidth=2e10, hbm_bytes=16e9, ici_bandwidth=4e9,
    op_overhead_s=3e-5, overlap=0.3,
    collective_latency_s_by_kind={"all-gather": 2e-5, "reduce-scatter": 3e-5,
                                  "all-reduce": 4e-5, "all-to-all": 6e-5})
START = HardwareProfile("start", peak_flops=1e12, hbm_bandwidth=5e10, hbm_bytes=16e9,
                        ici_bandwidth=1e10)
PREFILL = [("ws2d", "head"), ("wg_xy", "head"), ("ws2d", "batch")]
DECODE = [("ws2d", "head"), ("ws2d", "batch"), ("ws1d", "head")]


def grid(chips=(2, 4, 8), batches=(4, 16), prefill=PREFILL, decode=DECODE, input_len=64):
    out = []
    for c, b, (pf, pa), (df, da) in itertools.product(chips, batches, prefill, decode):
        try:
            out.append(TrialConfig.from_dict({
                "model": "tiny", "chips": c, "batch": b, "input_len": input_len,
                "decode_steps": 8, "prefill": {"ffn": pf, "attn": pa},
                "decode": {"ffn": df, "attn": da}}))
        except Exception:   # a layout that cannot run for this shape is not a data point
            continue
    return out


@pytest.fixture(scope="module")
def synthetic():
    frame = synthetic_trials(grid(), TRUTH, START, noise=0.02, seed=0)
    return frame, calfit.points_from_frame(frame, START)


def test_phase_predictions_are_the_cost_models(synthetic):
    """calibrate predicts a point exactly as costmodel.predict does for that trial."""
    _, points = synthetic
    for point in points[::7]:
        whole = costmodel.predict(point.config, TRUTH)
        expected = whole.prefill_s if point.phase == "prefill" else whole.decode_step_s
        assert calfit.predict_point(point, TRUTH) == pytest.approx(expected, rel=1e-12)


def test_fast_terms_match_predict_phase_for_random_profiles(synthetic):
    _, points = synthetic
    space = calfit.default_space(points, calfit.EXTRA_TERMS)
    terms = calfit.PhaseTerms.of(points, space.kinds)
    rng = np.random.default_rng(3)
    lows, highs = space.bounds(START)
    for _ in range(5):
        theta = rng.uniform(np.maximum(lows, -20), np.minimum(highs, 40))
        theta[3:-1] = rng.uniform(math.log(1e-7), math.log(1e-3), len(theta) - 4)
        profile = space.profile(theta, START)
        slow = np.array([calfit.predict_point(p, profile) for p in points])
        assert np.allclose(terms.latency(theta, space), slow, rtol=1e-9)


def test_analytic_jacobian_matches_finite_differences(synthetic):
    from scipy.optimize._numdiff import approx_derivative

    _, points = synthetic
    space = calfit.default_space(points, calfit.EXTRA_TERMS)
    terms = calfit.PhaseTerms.of(points, space.kinds)
    rng = np.random.default_rng(4)
    for _ in range(3):
        theta = space.start(START, 1e-5, 0.5) + rng.normal(0, 0.5, len(space.names))
        latency, jac = terms.latency_and_jacobian(theta, space)
        numeric = approx_derivative(lambda t: terms.latency(t, space), theta, method="3-point")
        assert np.allclose(latency, terms.latency(theta, space), rtol=1e-12)
        assert np.abs(jac - numeric).max() <= 1e-6 * np.abs(numeric).max()


def test_term_selection_ties_go_to_fewer_terms():
    a, ab = ("launch_overhead_s",), ("launch_overhead_s", "device_overhead_s")
    # within SELECT_TIE: the extra term has not earned its place, whichever scored lower
    assert calho.fewest_within_tie([(0.2, a), (0.2 - calho.SELECT_TIE / 10, ab)]) == a
    # beyond it: the better score wins, more terms or not
    assert calho.fewest_within_tie([(0.2, a), (0.2 - 10 * calho.SELECT_TIE, ab), (0.3, ())]) == ab


def test_fit_recovers_known_constants_from_noisy_data(synthetic):
    _, points = synthetic
    fit = calfit.fit_profile(points, START)
    got = fit.profile
    assert got.peak_flops == pytest.approx(TRUTH.peak_flops, rel=0.15)
    assert got.ici_bandwidth == pytest.approx(TRUTH.ici_bandwidth, rel=0.15)
    assert got.op_overhead_s == pytest.approx(TRUTH.op_overhead_s, rel=0.25)
    assert got.overlap == pytest.approx(TRUTH.overlap, abs=0.1)
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert got.collective_latency_s_by_kind[kind] == pytest.approx(
            TRUTH.collective_latency_s_by_kind[kind], rel=0.3)
    # The starting profile was off by 2.5x: it predicts badly, the fit does not.
    start_err = np.mean([abs(calfit.predict_point(p, START) / p.measured_s - 1) for p in points])
    fit_err = np.mean([abs(calfit.predict_point(p, got) / p.measured_s - 1) for p in points])
    assert start_err > 0.3 and fit_err < 0.03


def test_heldout_error_is_small_and_from_heldout_points_only(synthetic):
    _, points = synthetic
    result = calho.calibrate(points, START, ("kfold", "chips"), "synthetic")
    kfold = result.holdouts["kfold"]
    assert kfold.mape < 0.05 and kfold.max_ape < 0.15
    assert kfold.top1_within_tolerance >= 0.9 and kfold.kendall_tau > 0.5
    assert (kfold.points["fold"] >= 0).all() and len(kfold.points) == len(points)
    # Each held-out prediction comes from a fit that did not see the point: it differs from
    # the in-sample prediction of the fit on everything.
    assert not np.allclose(kfold.points["predicted_s"], result.insample["predicted_s"], rtol=1e-6)
    summary = result.summary()
    for key in ("mape_heldout", "median_ape_heldout", "max_ape_heldout", "top1_agreement",
                "kendall_tau", "n_points", "fitted"):
        assert key in summary
    assert summary["n_points"] == len(points)


def test_folds_hold_each_point_out_once_and_keep_trials_together(synthetic):
    _, points = synthetic
    for scheme in ("kfold", "layout", "chips"):
        splits = calho.folds(points, scheme)
        held = np.concatenate(splits)
        assert sorted(held.tolist()) == list(range(len(points)))
    for test in calho.folds(points, "kfold"):
        trials = {points[i].trial for i in test}
        assert all(p.trial not in trials for j, p in enumerate(points) if j not in set(test))
    for test in calho.folds(points, "layout"):
        assert len({points[i].layout_key for i in test}) == 1


def test_leave_one_layout_out_with_a_single_layout_is_skipped():
    frame = synthetic_trials(grid(prefill=[("ws2d", "head")], decode=[("ws2d", "head")],
                                      chips=(2, 4, 8), batches=(2, 4, 8)), TRUTH, START)
    points = [p for p in calfit.points_from_frame(frame, START) if p.phase == "decode"]
    ho = calho.heldout(points, START, "layout")
    assert ho.skipped and math.isnan(ho.mape)


def test_ranking_agreement_on_a_hand_built_table():
    rows = []
    # group 1: model picks the measured best; group 2: it picks the worst of three.
    for batch, layouts in ((4, [("a", 1.0, 1.0), ("b", 2.0, 2.0)]),
                           (8, [("a", 1.0, 3.0), ("b", 2.0, 2.0), ("c", 3.0, 1.0)])):
        for layout, measured, predicted in layouts:
            rows.append({"model": "m", "weights": "bf16", "input_len": 8, "decode_steps": 2,
                         "batch": batch, "chips": 4, "phase": "decode", "layout": layout,
                         "topology": "1x2x2", "measured_s": measured, "predicted_s": predicted})
    top1, near, tau, groups = calho.ranking_agreement(pd.DataFrame(rows))
    assert (top1, near, groups) == (0.5, 0.5, 2)
    assert tau == pytest.approx((1.0 + -1.0) / 2)


def test_too_few_trials_is_a_clear_error():
    frame = synthetic_trials(grid()[:3], TRUTH, START)
    points = calfit.points_from_frame(frame, START)
    with pytest.raises(calfit.CalibrationError, match="at least 6 complete measured trials"):
        calho.calibrate(points, START, study="tiny-study")


def test_fitted_yaml_loads_with_hardware_and_predicts_the_same(tmp_path, synthetic):
    _, points = synthetic
    fitted = calfit.fit_profile(points[:40], START, name="fitted").profile
    path = cal.write_profile(fitted, tmp_path / "fitted.yaml", note="test")
    loaded = load_hardware(str(path))
    assert loaded == fitted
    assert calfit.predict_point(points[0], loaded) == calfit.predict_point(points[0], fitted)


def test_host_share_is_recovered_from_the_stored_prediction():
    """A host trial's virtual chip gets the host / chips: calibration fits the whole host."""
    configs = grid(chips=(2, 4, 8), batches=(4,))
    frame = synthetic_trials(configs, TRUTH, dataclasses.replace(START, measured=True),
                             scale_of=lambda c: 1.0 / c.chips)
    points = calfit.points_from_frame(frame, dataclasses.replace(START, measured=True))
    assert {round(p.scale * p.config.chips, 9) for p in points} == {1.0}
    fit = calfit.fit_profile(points, START)
    assert fit.profile.peak_flops == pytest.approx(TRUTH.peak_flops, rel=0.2)


def test_a_recorded_hardware_share_is_read_not_recovered():
    """Trials record the share they ran with (`hardware_share`); older studies lack it."""
    configs = grid(chips=(2, 4), batches=(4,))
    measured_start = dataclasses.replace(START, measured=True)
    # a worker owning a third of the host: the prediction alone would say 1/chips
    frame = synthetic_trials(configs, TRUTH, measured_start, scale_of=lambda c: 1.0 / (3 * c.chips))
    old = calfit.points_from_frame(frame, measured_start)
    frame["hardware_share"] = [1.0 / (3 * c.chips) for c in configs]
    frame.loc[0, "pred_prefill_compute_s"] = frame.loc[0, "pred_decode_compute_s"] = float("nan")
    new = calfit.points_from_frame(frame, measured_start)
    assert [p.scale for p in new] == pytest.approx([p.scale for p in old])
    assert {round(p.scale * p.config.chips * 3, 9) for p in new} == {1.0}


# ----------------------------------------------------------------------------- the CLI on a real study


def store_measured_study(root, frame: pd.DataFrame, configs, name: str = "synthetic",
                         start: HardwareProfile = START, source: str = "measured"):
    """Write a study table into real Optuna (SQLite) and MLflow stores the way `sweeper run`
    records trials (user_attrs config/flat_params/measurement/prediction, a parent run)."""
    import optuna
    from mlflow.tracking import MlflowClient

    from sweeper.tracking import results
    from sweeper.tracking.mlflow_log import KIND_TAG, SWEEP_KIND

    root.mkdir(parents=True, exist_ok=True)
    storage, tracking = f"sqlite:///{root}/optuna.db", f"sqlite:///{root}/mlflow.db"
    start_yaml = cal.write_profile(start, root / "start.yaml")
    client = MlflowClient(tracking_uri=tracking)
    exp = client.create_experiment(f"sweeper/{name}", artifact_location=(root / "art").as_uri())
    parent = client.create_run(exp, tags={KIND_TAG: SWEEP_KIND, "study": name}).info.run_id
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=name, directions=["minimize", "minimize"])
    for key, value in {"hardware": f"devices:{start_yaml}", "source": source,
                       "mlflow_parent_run_id": parent, "tracking_uri": tracking}.items():
        study.set_user_attr(key, value)
    for (_, row), config in zip(frame.iterrows(), configs):
        measurement = {m: float(row[m]) for m in results.METRIC_COLUMNS if math.isfinite(row[m])}
        prediction = {m: float(row["pred_" + m]) for m in results.METRIC_COLUMNS
                      if math.isfinite(row["pred_" + m])}
        study.add_trial(optuna.trial.create_trial(
            values=[measurement["decode_step_s"], measurement["decode_cost_chip_s_per_token"]],
            params={}, distributions={},
            user_attrs={"config": config.resolved().to_dict(), "flat_params": config.flat_params(),
                        "measurement": measurement, "prediction": prediction, "source": source,
                        "hardware": f"devices:{start_yaml}"}))
    return storage, tracking, parent


@pytest.fixture(scope="module")
def measured_study(tmp_path_factory):
    configs = grid(chips=(2, 4), batches=(4, 16))
    frame = synthetic_trials(configs, TRUTH, START, noise=0.02, seed=1)
    root = tmp_path_factory.mktemp("measured")
    storage, tracking, parent = store_measured_study(root, frame, configs)
    return root, storage, tracking, parent


def test_fit_cli_writes_yaml_prints_json_and_logs_to_the_parent_run(measured_study, capsys,
                                                                     monkeypatch):
    from mlflow.tracking import MlflowClient

    from sweeper.cli import main

    root, storage, tracking, parent = measured_study
    monkeypatch.setenv("SWEEPER_HOME", str(root / "home"))
    out = root / "fitted.yaml"
    assert main(["fit", "--study", "synthetic", "--storage", storage, "--json", "--out", str(out),
                 "--holdout", "all"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("mape_heldout", "median_ape_heldout", "max_ape_heldout", "top1_agreement",
                "kendall_tau", "n_points", "fitted"):
        assert key in summary
    assert summary["mape_heldout"] < 0.05 and summary["holdout"] == "kfold"
    assert set(summary["holdouts"]) == set(calho.HOLDOUTS)
    # the extra terms freed by default: fit.STUDY_TERMS
    assert summary["terms"] == list(calfit.STUDY_TERMS)
    fitted = load_hardware(str(out))
    assert fitted.peak_flops == pytest.approx(summary["fitted"]["peak_flops"])
    run = MlflowClient(tracking_uri=tracking).get_run(parent)
    assert run.data.metrics["heldout_mape"] == pytest.approx(summary["mape_heldout"])
    assert "heldout_mape_chips" in run.data.metrics
    names = {a.path for a in MlflowClient(tracking_uri=tracking).list_artifacts(parent, "calibration")}
    assert {"calibration/errors.csv", "calibration/predicted_vs_measured.png",
            f"calibration/{out.name}"} <= names


def test_fit_cli_too_few_trials_and_analytical_studies_exit_2(tmp_path, capsys):
    from sweeper.cli import main

    configs = grid()[:3]
    frame = synthetic_trials(configs, TRUTH, START)
    storage, _, _ = store_measured_study(tmp_path / "few", frame, configs, name="few")
    capsys.readouterr()   # the stores' own set-up logs
    assert main(["fit", "--study", "few", "--storage", storage, "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "at least 6" in err and "it has 3" in err
    storage, _, _ = store_measured_study(tmp_path / "an", frame, configs, name="an",
                                         source="analytical")
    assert main(["fit", "--study", "an", "--storage", storage, "--no-mlflow"]) == 2
    assert "measured trials" in capsys.readouterr().err
    assert main(["fit", "--study", "nope", "--storage", storage]) == 2


@pytest.mark.parametrize("terms,needle", [("lots", "none, select or a comma list"),
                                          ("launch_overhead_s,warp_s", "--terms: got")])
def test_fit_cli_bad_terms_exit_2_before_reading_the_study(tmp_path, capsys, terms, needle):
    from sweeper.cli import main

    assert main(["fit", "--study", "nope", "--storage", f"sqlite:///{tmp_path}/none.db",
                 "--terms", terms]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_fit_cli_terms_named_are_the_terms_freed(measured_study, capsys, monkeypatch):
    from sweeper.cli import main

    root, storage, _, _ = measured_study
    monkeypatch.setenv("SWEEPER_HOME", str(root / "home"))
    for terms, freed in (("none", []), ("launch_overhead_s,device_overhead_s",
                                        ["launch_overhead_s", "device_overhead_s"])):
        assert main(["fit", "--study", "synthetic", "--storage", storage, "--json", "--no-mlflow",
                     "--terms", terms]) == 0
        assert json.loads(capsys.readouterr().out)["terms"] == freed


def test_fit_cli_on_a_measured_host_applies_no_other_hosts_bound_or_price(tmp_path, capsys, monkeypatch):
    """Issue 35: `sweeper fit --study` of a sweep whose measured host profile carries no
    collective latency bound and no multi-group gather price fits the per-op latencies within
    LATENCY_BOUNDS alone (a 2 ms all-gather start-up, above the 1.05 ms another host measured,
    is recovered) and writes a profile that carries neither field."""
    from sweeper.cli import main

    host_start = dataclasses.replace(START, name="host", measured=True)
    truth = dataclasses.replace(TRUTH, measured=True, collective_latency_s_by_kind={
        **TRUTH.collective_latency_s_by_kind, "all-gather": 2e-3})
    configs = grid(chips=(2, 4), batches=(4, 16))
    frame = synthetic_trials(configs, truth, host_start, noise=0.01, seed=3,
                             scale_of=lambda c: 1.0 / c.chips)
    storage, _, _ = store_measured_study(tmp_path / "host", frame, configs, name="host",
                                         start=host_start)
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path / "home"))
    out = tmp_path / "fitted.yaml"
    assert main(["fit", "--study", "host", "--storage", storage, "--json", "--no-mlflow",
                 "--terms", "none", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    fitted = load_hardware(str(out))
    assert fitted.measured and calfit.collective_latency_max_s(fitted) == calfit.LATENCY_BOUNDS[1]
    assert (fitted.collective_latency_max_s, fitted.multigroup_gather_scale) == (0.0, 1.0)
    assert fitted.collective_latency_s_by_kind["all-gather"] == pytest.approx(2e-3, rel=0.2)
    assert summary["mape_heldout"] < 0.05


def test_extra_terms_are_recovered_when_the_data_has_them():
    """A truth with a per-device collective latency: the fit that frees it predicts held-out
    points better than the paper's constants alone, and finds its value."""
    truth = dataclasses.replace(TRUTH, collective_latency_s_per_device=5e-5)
    frame = synthetic_trials(grid(chips=(2, 4, 8), batches=(4, 8, 16)), truth, START, noise=0.01, seed=2)
    points = calfit.points_from_frame(frame, START)
    terms = ("collective_latency_s_per_device",)
    fit = calfit.fit_profile(points, START, calfit.default_space(points, terms))
    assert fit.profile.collective_latency_s_per_device == pytest.approx(5e-5, rel=0.3)
    with_term = calho.heldout(points, START, "chips", terms=terms)
    without = calho.heldout(points, START, "chips", terms=())
    assert with_term.mape < without.mape


def test_attention_half_rows_is_recovered_and_a_selection_candidate():
    """A truth whose attention runs below peak at small shapes (attention_half_rows, issue 20):
    the fit that frees it finds its value and predicts held-out chip counts better than the
    paper's constants; nested cross-validation may choose it."""
    assert costmodel.ATTENTION_HALF_ROWS in calfit.SELECT_CANDIDATES
    truth = dataclasses.replace(TRUTH, **{costmodel.ATTENTION_HALF_ROWS: 400.0})
    frame = synthetic_trials(grid(chips=(2, 4, 8), batches=(4, 8, 16)), truth, START, noise=0.01, seed=2)
    points = calfit.points_from_frame(frame, START)
    terms = (costmodel.ATTENTION_HALF_ROWS,)
    fit = calfit.fit_profile(points, START, calfit.default_space(points, terms))
    assert getattr(fit.profile, costmodel.ATTENTION_HALF_ROWS) == pytest.approx(400.0, rel=0.3)
    assert calho.heldout(points, START, "chips", terms=terms).mape \
        < calho.heldout(points, START, "chips", terms=()).mape


def test_a_start_profile_with_group_measurements_keeps_the_fast_path(synthetic):
    """`sweeper profile`'s by-group fields override the fitted constants for the collectives
    they price, so the fit starts from the profile without them: the fast path (PhaseTerms)
    still agrees with predict_phase, and the fit is the one from the scalar constants."""
    _, points = synthetic
    profiled = dataclasses.replace(
        START, collective_latency_s_by_group={k: {2: 1e-4, 4: 2e-4} for k in COLLECTIVE_KINDS},
        collective_bandwidth_by_group={k: {2: 1e9, 4: 2e9} for k in COLLECTIVE_KINDS})
    # the by-group fields do change the prediction (so dropping them is a real choice)
    assert calfit.predict_point(points[0], profiled) != calfit.predict_point(points[0], START)
    stripped = calfit.without_group_measurements(profiled)
    space = calfit.default_space(points)
    terms = calfit.PhaseTerms.of(points, space.kinds)
    assert calfit._fast_path_agrees(points, terms, space, space.start(stripped, 1e-5, 0.5), stripped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the slow-path warning would fail the test
        fit = calfit.fit_profile(points[:40], profiled)
    assert fit.profile.collective_bandwidth_by_group == {}
    assert fit.profile.peak_flops == pytest.approx(calfit.fit_profile(points[:40], START).profile.peak_flops)


def test_collective_latencies_are_bounded_by_a_whole_collective_only_where_one_was_measured():
    """A profile that carries a measured `collective_latency_max_s` (one whole small collective
    on its host) bounds every per-op collective latency by it; a measured host profile without
    the field and a sheet profile keep LATENCY_BOUNDS (no other host's bound applies);
    op_overhead_s keeps LATENCY_BOUNDS on all."""
    space = calfit.ParamSpace(("all-gather", "reduce-scatter"), ("launch_overhead_s",))
    host = dataclasses.replace(START, measured=True)
    bounded = dataclasses.replace(host, collective_latency_max_s=1.05e-3)
    for base, cap in ((bounded, 1.05e-3), (host, calfit.LATENCY_BOUNDS[1]),
                      (START, calfit.LATENCY_BOUNDS[1])):
        assert calfit.collective_latency_max_s(base) == cap
        _, highs = space.bounds(base)
        assert np.exp(highs[3:5]) == pytest.approx([cap, cap])
        assert np.exp(highs[-2]) == pytest.approx(calfit.LATENCY_BOUNDS[1])     # op_overhead_s
