"""The blind validation benchmark (benchmarks/blind.py): its draws never repeat a calibration
probe, its space files are valid sweeps, its scoring, the fit on at most 12 points, the
serving cases and band coverage, the verdicts, the Markdown; and once, at a tiny size, the
whole measured path (`sweeper calibrate --quick`, one model's sweep and replicates)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import blind, harness, readme_numbers
from benchmarks.render import blind as render
from sweeper.analysis.observations import from_config, predict_latency
from sweeper.spec.space import load_space
from workloads import probes
from workloads.config import HardwareProfile
from workloads.trial import TrialConfig

ROOT = Path(__file__).resolve().parents[1]
COSTS = {"launch": 2e-4, "layer_device": 3e-5, "collective_op": 5e-5, "matmul_flops": 2e-11,
         "memory_bytes": 1e-10, "gather_bytes": 1e-10}
PROFILE = HardwareProfile(
    name="host", peak_flops=1e11, hbm_bandwidth=1e10, hbm_bytes=2**34, ici_bandwidth=1e10,
    measured=True, calibration={"host_key": "test|cpus=2", "probe_seed": probes.CALIBRATION_SEED,
                                "probe_models": 4, "calibrated_at": "2026-12-05 08:00"},
    host_model={"share": 0.5, "cache_bytes": 0.0, "costs": {"prefill": COSTS, "decode": COSTS}})


# ----------------------------------------------------------------------------- seeds and draws


def test_fresh_seed_is_never_the_calibration_or_a_development_seed():
    assert blind.fresh_seed(123_456_789_000) == 123_456_789
    for now in (1000 * probes.CALIBRATION_SEED, 1000 * 2, 0, 1000 * blind.SPENT_SEEDS[-1]):
        seed = blind.fresh_seed(now)
        assert seed != probes.CALIBRATION_SEED and seed not in blind.DEV_SEEDS + blind.SPENT_SEEDS


def test_draw_avoids_every_calibration_probe_and_refuses_the_calibration_seed():
    avoid = blind.calibration_keys(PROFILE.calibration)
    # the full calibration's 12 random probe models, whatever the quick one drew, and the
    # ladder's two depths of one model
    assert len(avoid) == 14
    assert {probes.model_key(m) for m in probes.ladder(probes.CALIBRATION_SEED).models} <= avoid
    first = probes.draw_models(probes.CALIBRATION_SEED, 1, "probe")[0]
    assert probes.model_key(first) in avoid
    # a calibration made with another probe seed: its probes and ladder, and the default's
    other = blind.calibration_keys({"probe_seed": 99, "probe_models": 3})
    assert avoid <= other and len(other) == 14 + 12 + 2
    assert {probes.model_key(m) for m in probes.ladder(99).models} <= other
    for seed in (1, 2, 3, 77):
        drawn = blind.draw(seed, 3, avoid)
        assert len(drawn) == 3 and not {probes.model_key(m) for m in drawn} & avoid
    # a probe's shape is skipped: the draw moves on to the next model of the seed
    plain = blind.draw(77, 2, set())
    skipped = blind.draw(77, 1, {probes.model_key(plain[0])})
    assert probes.model_key(skipped[0]) == probes.model_key(plain[1])
    with pytest.raises(ValueError):
        blind.draw(probes.CALIBRATION_SEED, 1, avoid)


def test_space_is_a_valid_sweep_of_the_model_on_host(tmp_path):
    model = blind.draw(77, 1, set())[0]
    data = blind.space_for(model, 77, 0, trials=12)
    space = load_space(data, "blind space")
    assert space.hardware.kind == "host" and space.trials == 12 and space.parallel == 2
    assert data["sampler"] == {"type": "random", "seed": 7700}
    assert {"batch", "chips", "weights", "prefill_ffn", "decode_attn"} <= set(data["params"])
    assert data["model"]["d_model"] == model.d_model and data["repeats"] == 3
    # a clock seed (up to 2**31) still gives a sampler seed Optuna takes
    big = blind.space_for(model, 2**31 - 2, 1)
    assert 0 <= big["sampler"]["seed"] < 2**32
    load_space(big, "blind space")


def test_fit_trials_draws_at_most_six_with_the_seed_and_keeps_two_to_score():
    trials = list(range(12))
    chosen = blind.fit_trials(trials, 5, 0)
    assert len(chosen) == 6 and chosen == blind.fit_trials(reversed(trials), 5, 0)
    assert chosen != blind.fit_trials(trials, 6, 0)
    assert len(blind.fit_trials(range(5), 5, 0)) == 3
    assert blind.fit_trials(range(2), 5, 0) == []


def test_replicate_count_covers_the_first_complete_trials():
    states = [(0, "PRUNED"), (1, "COMPLETE"), (2, "PRUNED"), (3, "COMPLETE"), (4, "COMPLETE")]
    assert blind.replicate_count(states, 2) == 4
    assert blind.replicate_count(states, 9) == 5


# ----------------------------------------------------------------------------- scoring


def test_error_stats_and_score_per_phase_and_chips():
    s = blind.error_stats([0.1, -0.2, 0.3, None, math.nan])
    assert s["n"] == 3 and s["mape"] == pytest.approx(0.2) and s["median"] == pytest.approx(0.2)
    assert s["worst"] == pytest.approx(0.3) and s["worst_signed"] == pytest.approx(0.3)
    assert s["median_signed"] == pytest.approx(0.1)
    points = [{"phase": "prefill", "chips": 1, "measured_s": 1.0, "predicted_s": 1.1},
              {"phase": "prefill", "chips": 2, "measured_s": 2.0, "predicted_s": 1.0},
              {"phase": "decode", "chips": 1, "measured_s": 1.0, "predicted_s": 1.0}]
    out = blind.score(points)
    assert out["prefill"]["n"] == 2 and out["prefill"]["mape"] == pytest.approx(0.3)
    assert out["prefill"]["by_chips"]["2"]["worst_signed"] == pytest.approx(-0.5)
    assert out["decode"]["mape"] == 0.0
    assert blind.error_stats([])["mape"] is None


def test_mape_ci_resamples_models_not_points():
    """A model's points err together: the MAPE's CI is bootstrapped over models, so it
    brackets the pooled MAPE within the models' own MAPEs, widens with their spread, and is
    not given for one model however many points it has."""
    def points(per_model):
        return [{"model": f"m{i}", "phase": "decode", "chips": 1, "measured_s": 1.0,
                 "predicted_s": 1.0 + e} for i, e in enumerate(per_model) for _ in range(10)]

    close = blind.mape_ci(points([0.19, 0.2, 0.21, 0.2]))
    spread = blind.mape_ci(points([0.05, 0.2, 0.35, 0.2]))
    assert 0.19 <= close[0] < 0.2 < close[1] <= 0.21
    assert 0.05 <= spread[0] < close[0] and close[1] < spread[1] <= 0.35
    assert blind.mape_ci(points([0.2])) is None
    scored = blind.score(points([0.05, 0.2, 0.35, 0.2]))["decode"]
    assert scored["mape_ci95"] == spread and scored["models"] == 4
    assert scored["by_chips"]["1"]["mape_ci95"] == spread


def _trial(model, chips, batch, ffn="ws2d"):
    return TrialConfig.from_dict(dict(model=model.to_dict(), chips=chips, batch=batch, input_len=32,
                                      decode_steps=8, prefill=dict(ffn=ffn, attn="head"),
                                      decode=dict(ffn=ffn, attn="head"))).resolved().validate()


def test_fit_on_at_most_twelve_points_learns_a_slowdown_and_scores_the_rest():
    model = blind.draw(3, 1, set())[0]
    obs, number = [], 0
    for chips in (1, 2, 4):
        for batch in (4, 8, 16):
            config = _trial(model, chips, batch)
            for phase in ("prefill", "decode"):
                o = from_config(config, phase, 1.0, trial=number, scale=0.5 / chips)
                # measured: the profile's prediction x 1.4 (the compute x 1.8, the rest as priced)
                terms = blind.term_seconds(o, PROFILE)
                assert sum(terms.values()) == pytest.approx(predict_latency(o, PROFILE))
                o.measured = sum(v * (1.8 if t == "matmul_flops" else 1.0) for t, v in terms.items())
                obs.append(o)
            number += 1
    # draw 1 of seed 3 trains on every chip count: trained on 2- and 4-chip trials only, the
    # fit cannot tell a slowdown of every chip count from one of meshes (hostfit.py)
    out = blind.fit_model(obs, PROFILE, 3, 1)
    assert out["train_points"] == 12 and out["test_points"] == len(obs) - 12
    assert {p["trial"] for p in out["points"]}.isdisjoint(out["train_trials"])
    fit = blind.score(out["points"], "fit_s")
    alone = blind.score(out["points"], "profile_s")
    for phase in ("prefill", "decode"):
        assert alone[phase]["median_signed"] < -0.05                 # the profile is too fast
        assert fit[phase]["mape"] < 0.5 * alone[phase]["mape"]       # the fit learns it
    assert out["corrections"]["prefill"]["compute"] > 1.2
    diag = blind.diagnose(obs, PROFILE)
    group = blind.responsible_group(diag, "prefill")
    assert group["group"] == "compute" and "matmul_flops" in group["terms"]


# ----------------------------------------------------------------------------- serving


def _served(measured: dict, predicted: dict) -> dict:
    return {"measured": {**measured, "completed": 40}, "predicted": predicted,
            "calibrated": measured, "replayed": measured}


def test_case_errors_and_band_coverage():
    measured = {"ttft_p50_s": 0.010, "ttft_p99_s": 0.030, "tpot_p50_s": 0.002, "tpot_p99_s": 0.004}
    predicted = {"ttft_p50_s": 0.011, "ttft_p99_s": 0.050, "tpot_p50_s": 0.002, "tpot_p99_s": 0.004}
    plan = {"json": {"best": {"mode": "aggregated", **predicted, "bands_s": {
        "ttft_p50": [0.008, 0.012], "ttft_p99": [0.040, 0.060], "tpot_p50": [0.001, 0.003],
        "tpot_p99": [0.003, 0.005]}}}}
    case = blind.case_of(plan, _served(measured, predicted), 0.35, {"served_rps": 10.0}, 3.5)
    assert case["error"]["ttft_p50_s"] == pytest.approx(0.1)
    assert case["error"]["ttft_p99_s"] == pytest.approx(2 / 3)
    assert case["inside_band"] == {"ttft_p50_s": True, "ttft_p99_s": False, "tpot_p50_s": True,
                                   "tpot_p99_s": True}
    counts = blind.serving_counts([case])
    assert counts["p50"] == {"target": 0.2, "cases": 2, "within": 2, "median_abs_error": pytest.approx(0.05),
                             "worst_abs_error": pytest.approx(0.1)}
    assert counts["p99"]["within"] == 1
    cov = blind.band_coverage([case])
    assert (cov["n"], cov["inside"], cov["coverage"]) == (4, 3, 0.75)
    why, band = blind.serving_responsible([case])
    assert "0 misses within target once" in why and "1 where the warm-up model" in why
    assert "1 below the band, 0 above" in band
    # the host drifted since the calibration (`sweeper calibrate --check`): measured TTFT p99
    # 0.030 s against 0.050 s predicted is within target once prefill runs x0.7 of then
    drift = {"prefill": 0.7, "decode": 1.1}
    drifted = blind.case_of(plan, _served(measured, predicted), 0.35, {}, 3.5, drift)
    assert drifted["error_host"]["ttft_p99_s"] == pytest.approx(0.050 * 0.7 / 0.030 - 1)
    assert drifted["error_host"]["tpot_p50_s"] == pytest.approx(0.1)
    assert drifted["error"] == case["error"]              # the headline is not scaled
    why, band = blind.serving_responsible([drifted])
    assert "1 misses within target once" in why and "0 where the warm-up model" in why
    assert "1 of 1 inside the band scaled by the host's drift" in band
    assert blind.drift_of({"ratio": {"prefill": {"median": 0.7}, "decode": {"median": 1.1}}}) == drift
    assert blind.drift_of({"skipped": "exit 2"}) is None
    # an uncalibrated plan states no band: nothing to cover
    plan["json"]["best"].pop("bands_s")
    assert blind.band_coverage([blind.case_of(plan, _served(measured, predicted), 0.35, {}, 3.5)])["n"] == 0


def test_last_json_reads_the_object_after_other_output():
    assert blind.last_json('note: something\n{"a": {"b": 1}}\n') == {"a": {"b": 1}}
    assert blind.last_json("no json here") is None


# ----------------------------------------------------------------------------- verdicts, Markdown


def _result(profile_mape: float, fit_mape: float, coverage_inside: int, rerun: float | None = None,
            drift: dict | None = None) -> dict:
    point = lambda model, trial, phase, measured, predicted: {  # noqa: E731
        "model": model, "trial": trial, "phase": phase, "chips": 1, "measured_s": measured,
        "predicted_s": predicted, "ci_rel": 0.02, "config": "1 chips b4", "terms_s": {"launch": 0.001}}
    drawn = probes.draw_models(9, 1, "blind")[0]
    points = [point(drawn.name, t, ph, 1.0, 1.0 + profile_mape) for t in range(4) for ph in ("prefill", "decode")]
    fit_points = [{"trial": t, "phase": ph, "chips": 1, "measured_s": 1.0, "profile_s": 1.0 + profile_mape,
                   "fit_s": 1.0 + fit_mape} for t in range(2) for ph in ("prefill", "decode")]
    inside = {k: i < coverage_inside for i, k in enumerate(blind.SERVE_METRICS)}
    case = {"load": 0.35, "rate_rps": 2.0, "measured": {k: 0.01 for k in blind.SERVE_METRICS},
            "predicted": {k: 0.011 for k in blind.SERVE_METRICS},
            "error": {k: 0.1 for k in blind.SERVE_METRICS}, "error_plan": {k: 0.1 for k in blind.SERVE_METRICS},
            "error_warmup": {k: 0.0 for k in blind.SERVE_METRICS}, "error_replay": {k: 0.0 for k in blind.SERVE_METRICS},
            "inside_band": inside, "bands_s": {k[:-2]: [0.0, 0.005] for k in blind.SERVE_METRICS},
            "deployment": {}}
    model = {"index": 0, "model": dict(drawn.to_dict()), "points": points,
             "trials": [{"host_steal_frac": 0.01, "host_load_avg_1m": 1.5}], "profile_check": {"ok": True},
             "counts": {"COMPLETE": 4}, "fit": {"points": fit_points},
             "replicates": {"pairs": [{"phase": "prefill", "chips": 1, "first_s": 1.0, "again_s": 1.02}]},
             "serving": {"modes": {"aggregated": {"cases": [case]}}}}
    if drift is not None:     # `sweeper calibrate --check` before the mode's serves
        mode = model["serving"]["modes"]["aggregated"]
        mode["host_check"] = {"ratio": {ph: {"median": r} for ph, r in drift.items()}}
        case.update(host_drift=drift, error_host={k: 0.11 for k in blind.SERVE_METRICS})
    if rerun is not None:     # the later measurement `rerun` x the first, ten minutes on
        model["rerun"] = {"after_s": 600.0, "pairs": [
            {"phase": ph, "chips": 1, "first_s": 1.0, "again_s": 1.0 + rerun} for ph in ("prefill", "decode")]}
    raw = {"command": "python -m benchmarks.blind", "git": {"commit": "abc", "dirty": False},
           "context": {"cpus": 2, "load_average": [1, 1, 1]}, "context_end": {"steal_pct": 1.0},
           "calibration": {"elapsed_s": 250.0, "how": "run", "describe": "host, calibrated"},
           "seeds": [{"seed": 77, "label": "blind", "models": [model]},
                     {"seed": 1, "label": "development", "models": [model]}],
           "quickstart": {"noise_floor": 0.02, "noise_floor_points": 8,
                          "schemes": {"kfold": {"mape": 0.03, "ratio": 1.5}, "chips": {"mape": 0.05, "ratio": 2.5}}},
           "wall_s": 60.0}
    return blind.analyse(raw)


def test_verdicts_met_and_missed_with_what_is_responsible():
    good = {v["target"]: v for v in _result(0.05, 0.02, 4)["verdicts"]}
    assert all(v["met"] for k, v in good.items() if "MAPE" in k or "coverage" in k or "served" in k)
    assert good["`sweeper calibrate` <= 5 minutes"]["met"] is True
    quick = good["quickstart's closing analysis: every scheme within 2x its noise floor"]
    assert quick["met"] is False and "chips" in quick["responsible"]
    bad = {v["target"]: v for v in _result(0.30, 0.12, 2)["verdicts"]}
    prefill = bad["calibrated profile alone, prefill MAPE <= 15.0%"]
    assert prefill["met"] is False and prefill["measured"] == "30.0%" and "largest term launch" in prefill["responsible"]
    fit = bad["after a fit on <= 12 points, decode MAPE on the rest <= 8.0%"]
    assert fit["met"] is False and fit["responsible"].startswith("the profile alone on the same points: 30.0%")
    assert "12.0% off, largest term launch" in fit["responsible"]
    cover = bad["band coverage >= 85.0% (item 5)"]
    assert cover["met"] is False and cover["measured"].startswith("2/4") and "above" in cover["responsible"]


def test_run_to_run_drift_is_scored_and_named_first_where_it_is_half_the_error():
    drifting = _result(0.20, 0.02, 4, rerun=-0.15)
    noise = drifting["summary"]["blind"]["noise"]
    assert noise["rerun"]["prefill"]["n"] == 1 and noise["rerun_after_s"] == 600.0
    assert noise["rerun"]["prefill"]["mape"] == pytest.approx(0.15)
    assert noise["rerun"]["decode"]["median_signed"] == pytest.approx(-0.15)
    prefill = "calibrated profile alone, prefill MAPE <= 15.0%"
    why = {v["target"]: v for v in drifting["verdicts"]}[prefill]["responsible"]
    assert why.startswith("run-to-run drift: the same trials re-measured 10 min later are 15.0% "
                          "from their first measurement (median signed -15.0%, n=1)")
    assert "largest term launch" in why
    # a drift under half the error follows what the terms say; no rerun, no clause
    steady = {v["target"]: v for v in _result(0.40, 0.02, 4, rerun=0.05)["verdicts"]}[prefill]
    assert steady["responsible"].startswith("worst trial") and "re-measured 10 min later are 5.0%" in steady["responsible"]
    none = _result(0.40, 0.02, 4)
    assert none["summary"]["blind"]["noise"]["rerun"]["prefill"]["n"] == 0
    assert "drift" not in {v["target"]: v for v in none["verdicts"]}[prefill]["responsible"]
    assert ("Run-to-run drift (each model's sweep run again at the end, a median 10 min after its "
            "first" in render.markdown(drifting))
    assert "Run-to-run drift" not in render.markdown(none)


def test_the_host_drift_diagnostic_is_counted_and_rendered_beside_the_headline():
    drifted = _result(0.05, 0.02, 4, drift={"prefill": 0.9, "decode": 1.05})
    serving = drifted["summary"]["blind"]["serving"]
    assert serving["host_checks"] == [{"prefill": 0.9, "decode": 1.05}]
    assert serving["host_counts"]["p50"]["cases"] == 2
    assert serving["counts"] == _result(0.05, 0.02, 4)["summary"]["blind"]["serving"]["counts"]
    text = render.markdown(drifted)
    assert "scaled by the host's drift since the calibration" in text
    assert "1 checks, prefill x0.90, decode x1.05" in text
    assert "host's drift" not in render.markdown(_result(0.05, 0.02, 4))


def test_markdown_renders_both_labels_and_the_doc_block_is_registered(tmp_path):
    result = _result(0.05, 0.02, 4)
    text = render.markdown(result)
    assert "| development | prefill |" in text and "| blind | decode |" in text
    assert "Consistency check, not a prediction" in text and "**met**" in text
    assert "blind" in readme_numbers.DOC_BLOCKS
    harness.write(blind.NAME, result, text, tmp_path, blind.RAW_KEYS)
    loaded = harness.load(blind.NAME, tmp_path, blind.RAW_KEYS)
    assert render.markdown(json.loads(json.dumps(loaded))) == text
    assert readme_numbers.doc_block("blind")(tmp_path) == render.doc_block(result)


def test_bad_flags_exit_2_in_one_line_before_any_work():
    for argv in (["--models", "0"], ["--seed", str(probes.CALIBRATION_SEED)], ["--seed", "2"],
                 ["--seed", str(blind.SPENT_SEEDS[0])],
                 ["--requests", "1"]):
        done = subprocess.run([sys.executable, "-m", "benchmarks.blind", *argv, "--out", "/nonexistent/x"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("blind: --")


# ----------------------------------------------------------------------------- the real path


@pytest.mark.slow
@pytest.mark.ci_slow    # `sweeper calibrate --quick` and a 4-trial sweep: minutes on 2 cores
def test_tiny_blind_run_end_to_end(tmp_path):
    """The measured path at its smallest: a quick calibration made here as a user makes it,
    the benchmark on it (`--skip-calibrate`, the same SWEEPER_HOME), one model's sweep and a
    replicate; then the scoring and the Markdown on those real outputs."""
    out, home = tmp_path / "out", tmp_path / "home"
    env = {**os.environ, "SWEEPER_HOME": str(home)}
    cal = subprocess.run([str(Path(sys.executable).parent / "sweeper"), "calibrate", "--quick"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert cal.returncode == 0, cal.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "benchmarks.blind", "--skip-calibrate", "--seed", "4221",
                           "--models", "1", "--trials", "4", "--replicates", "1", "--no-serve",
                           "--no-quickstart", "--out", str(out), "--home", str(home)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = harness.load(blind.NAME, out, blind.RAW_KEYS)
    entry = result["seeds"][0]
    model = entry["models"][0]
    assert (entry["seed"], entry["label"]) == (4221, "blind")
    # the trials' predictions were made from the calibrated profile, and recompute from it
    assert model["profile_check"]["ok"], model["profile_check"]
    assert model["counts"]["COMPLETE"] >= 1
    points = model["points"]
    assert points and all(p["predicted_s"] > 0 and p["measured_s"] > 0 and p["terms_s"] for p in points)
    assert {p["phase"] for p in points} == {"prefill", "decode"}
    # the scores are those of the points themselves
    blind_summary = result["summary"]["blind"]
    for phase in ("prefill", "decode"):
        errs = [abs(p["predicted_s"] / p["measured_s"] - 1) for p in points if p["phase"] == phase]
        assert blind_summary["profile"][phase]["n"] == len(errs)
        assert blind_summary["profile"][phase]["mape"] == pytest.approx(sum(errs) / len(errs))
    assert model["replicates"]["matched"] >= 1 and model["replicates"]["pairs"]
    # the run-to-run drift: the same sweep again at the end, its trials paired with the first
    assert model["rerun"]["sweep"]["returncode"] == 0 and model["rerun"]["pairs"]
    assert blind_summary["noise"]["rerun"]["prefill"]["n"] >= 1
    assert result["calibration"]["quick"] is True and "skipped" in result["calibration"]["how"]
    assert result["git"]["commit"] and result["context"] and result["wall_s"] > 0
    verdicts = {v["target"]: v for v in result["verdicts"]}
    assert verdicts["`sweeper calibrate` <= 5 minutes"]["met"] is None    # a quick one is not judged
    assert verdicts["band coverage >= 85.0% (item 5)"]["met"] is None      # nothing served
    text = (out / "blind.md").read_text()
    assert text.startswith("# Blind validation") and "4221" in text
    # --render gives the same page from the results file alone; the docs' block reads it
    again = subprocess.run([sys.executable, "-m", "benchmarks.blind", "--render", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "blind.md").read_text() == text
    assert "4221" in readme_numbers.doc_block("blind")(out)


def test_quickstart_with_a_floor_over_half_is_not_judged():
    """A quickstart whose replicates disagree by more than JUDGEABLE_FLOOR would pass any
    error at 2x its floor: the verdict is left undecided, with the reason."""
    raw = _result(0.05, 0.02, 4)
    raw["quickstart"] = {**raw["quickstart"], "noise_floor": 1.22,
                         "schemes": {"chips": {"mape": 0.39, "ratio": 0.32}}}
    target = "quickstart's closing analysis: every scheme within 2x its noise floor"
    noisy = {v["target"]: v for v in blind.analyse(raw)["verdicts"]}[target]
    assert noisy["met"] is None and "not judged" in noisy["responsible"]
    raw["quickstart"]["noise_floor"] = 0.4
    assert {v["target"]: v for v in blind.analyse(raw)["verdicts"]}[target]["met"] is True
