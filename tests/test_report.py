"""The HTML report: every figure inlined, provenance labels, the tables; `summarize_sweep` on a
real (analytical) sweep and `sweeper report` on a measured study, both logged to MLflow."""

from __future__ import annotations

import base64
import re

import pytest

from sweeper.analysis import fit as calfit
from sweeper.analysis import holdout as calho
from sweeper.analysis import report
from sweeper.cli.run import format_sweep_summary
from synthetic import synthetic_trials

from test_calibrate import START, TRUTH, grid, store_measured_study

ANALYTICAL_SPACE = """
name: report-test
model: tiny
hardware: analytical:tpu-v4
input_len: 32
decode_steps: 8
params:
  batch: [8, 16]
  chips: [2, 4]
  decode_ffn: [ws1d, ws2d]
  decode_attn: [head, batch]
objectives:
  - {metric: decode_step_s, direction: minimize}
  - {metric: decode_cost_chip_s_per_token, direction: minimize}
sampler: {type: grid, seed: 0}
trials: 16
parallel: 1
"""


# Every figure of a report with a calibration section (Optuna's three views included).
ALL_FIGURES = {"fig-pareto", "fig-mfu", "fig-latency", "fig-importance", "fig-parallel",
               "fig-hypervolume", "fig-predicted"}


def images(html: str) -> dict[str, bytes]:
    """id -> PNG bytes of every inlined image."""
    found = re.findall(r'<img alt="[^"]*" id="([^"]+)" src="data:image/png;base64,([^"]+)"', html)
    return {name: base64.b64decode(data) for name, data in found}


@pytest.fixture(scope="module")
def synthetic_calibrated():
    configs = grid(chips=(2, 4, 8), batches=(4, 16))
    frame = synthetic_trials(configs, TRUTH, START, noise=0.02, seed=2)
    points = calfit.points_from_frame(frame, START)
    return frame, calho.calibrate(points, START, calho.HOLDOUTS, "synthetic")


def _without_stamp(html: str) -> str:
    return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "", html)


@pytest.mark.skipif(not report._can_fork(), reason="no fork start method or one core: drawn inline")
def test_figures_drawn_in_a_forked_process_are_the_inline_ones(synthetic_calibrated, monkeypatch):
    frame, calibration = synthetic_calibrated
    attrs = {"source": "measured", "hardware": "host"}
    label = report.plots.source_label("measured", "host")

    def render(figures):
        return report.render(frame, study="synthetic", attrs=attrs, calibration=calibration,
                             fit_error=None, figures=figures)

    inline_html, inline_pngs = render(None)
    forked = report.TableFigures(frame, label)
    assert forked._child is not None             # a child is drawing them
    html, pngs = render(forked)
    assert pngs == inline_pngs and _without_stamp(html) == _without_stamp(inline_html)
    # a child that dies without an answer: the figures are drawn here instead, the same
    monkeypatch.setattr(report, "_draw_in_child", lambda send, df, label, parts: report.os._exit(3))
    dead = report.TableFigures(frame, label)
    html, pngs = render(dead)
    assert dead._child is None and pngs == inline_pngs
    assert _without_stamp(html) == _without_stamp(inline_html)
    # a child that never answers (stuck on a lock held at the fork): stopped, drawn here
    monkeypatch.setattr(report, "CHILD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(report, "_draw_in_child", lambda send, df, label, parts: report.time.sleep(60))
    stuck = report.TableFigures(frame, label)
    process = stuck._child[0]
    html, pngs = render(stuck)
    assert not process.is_alive() and pngs == inline_pngs


def test_report_contains_every_figure_and_table(synthetic_calibrated):
    frame, calibration = synthetic_calibrated
    html, pngs = report.render(frame, study="synthetic", attrs={"source": "measured", "hardware": "host"},
                               calibration=calibration, fit_error=None)
    inlined = images(html)
    assert set(inlined) == ALL_FIGURES
    for blob in inlined.values():
        assert blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 10_000
    assert set(pngs) == set(report.FIGURES)
    # Self-contained: nothing fetched from elsewhere.
    assert not re.search(r'(src|href)="(http|//)', html)
    for section in ('id="pareto"', 'id="mfu"', 'id="latency"', 'id="calibration"', 'id="recommend"',
                    'id="importance"', 'id="parallel"', 'id="hypervolume"', 'class="importance-table"',
                    'class="error-table"', 'class="summary-table"', 'class="regime-table"',
                    'class="best-layout-table"', 'class="pareto-table"', 'class="fitted-table"'):
        assert section in html
    # Provenance: measured numbers say where they were measured; the model says analytical.
    assert "measured on <b>this host</b>" in html and "emulated mesh" in html
    assert 'class="tag analytical"' in html
    # The error table lists every (phase, layout) that was measured, with held-out numbers.
    for phase, layout in {(p.phase, p.layout_key) for p in calibration.points}:
        assert re.search(rf"<td class=\"text\">{phase}</td><td class=\"text\">{re.escape(layout)}</td>", html)
    assert "leave-one-chip-count-out" in html
    # Frontier points are labelled batch/chips/layout in the table.
    assert re.search(r"B\d+/\dc/ws[12]d/(head|batch)", html)


def test_regimes_come_from_the_frontier(synthetic_calibrated):
    frame, _ = synthetic_calibrated
    table = report.regimes_table(frame)
    decode = table[table["phase"] == "decode"].set_index("regime")
    assert (decode["latency metric"] == "decode_step_s").all()
    assert decode.loc["lowest latency", report.LATENCY_COL] == pytest.approx(frame["decode_step_s"].min())
    assert decode.loc["lowest cost", report.COST_COL] == pytest.approx(
        frame["decode_cost_chip_s_per_token"].min())
    knee = decode.loc["knee (min latency × cost)"]
    products = frame["decode_step_s"] * frame["decode_cost_chip_s_per_token"]
    assert knee[report.LATENCY_COL] * knee[report.COST_COL] == pytest.approx(products.min())


@pytest.fixture(scope="module")
def analytical_sweep(tmp_path_factory):
    from sweeper.sweep.controller import run_sweep

    root = tmp_path_factory.mktemp("analytical")
    space = root / "space.yaml"
    space.write_text(ANALYTICAL_SPACE)
    storage, tracking = f"sqlite:///{root}/optuna.db", f"sqlite:///{root}/mlflow.db"
    result = run_sweep(str(space), storage=storage, tracking_uri=tracking, study_name="an",
                       progress=False)
    assert result.counts["complete"] == 16
    return root, storage, tracking, result.parent_run_id


def test_summarize_sweep_on_an_analytical_sweep(analytical_sweep, monkeypatch):
    from mlflow.tracking import MlflowClient

    root, storage, tracking, parent = analytical_sweep
    monkeypatch.setenv("SWEEPER_HOME", str(root / "home"))
    summary = report.summarize_sweep("an", storage, tracking, root / "out")
    assert set(summary["pareto"]) == {"prefill", "decode"}
    assert summary["pareto"]["decode"]["n_points"] == 16 and summary["pareto"]["decode"]["front"]
    assert "measured" in summary["heldout"]["skipped"]           # nothing to calibrate against
    html = (root / "out" / "report.html").read_text()
    assert ALL_FIGURES - {"fig-predicted"} == set(images(html))
    assert re.search(r'id="pareto">Pareto frontier per phase <span class="tag analytical">analytical',
                     html)                                     # not labelled as measured
    assert 'class="tag measured"' not in html
    assert 'id="no-fit"' in html and "predictions of the analytical cost model" in html
    assert summary["logged_to_mlflow"]
    arts = {a.path for a in MlflowClient(tracking_uri=tracking).list_artifacts(parent, "report")}
    assert "report/report.html" in arts and "report/pareto.png" in arts
    text = format_sweep_summary(summary)
    assert "decode Pareto frontier" in text and "held-out prediction error: not computed" in text
    assert str(root / "out" / "report.html") in text


def test_report_cli_on_a_measured_study(tmp_path, capsys, monkeypatch):
    import json

    from sweeper.cli import main

    configs = grid(chips=(2, 4), batches=(4, 16))
    frame = synthetic_trials(configs, TRUTH, START, noise=0.02, seed=3)
    storage, tracking, parent = store_measured_study(tmp_path / "m", frame, configs, name="m")
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path / "home"))
    capsys.readouterr()
    assert main(["report", "--study", "m", "--storage", storage, "--out", str(tmp_path / "r"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibrated"] and out["logged_to_mlflow"]
    html = (tmp_path / "r" / "report.html").read_text()
    assert set(images(html)) == ALL_FIGURES
    assert (tmp_path / "r" / "calibration" / "errors.csv").is_file()
    assert main(["report", "--study", "missing", "--storage", storage, "--out", str(tmp_path)]) == 2


def test_best_layout_agreement_uses_the_formulas_ties():
    import pandas as pd

    df = pd.DataFrame([
        {"number": i, "state": "COMPLETE", "chips": 2, "batch": 8, "topology": "1x2x1",
         "decode_ffn": ffn, "decode_attn": "head", "decode_step_s": t,
         "decode_cost_chip_s_per_token": 2 * t / 8}
        for i, (ffn, t) in enumerate([("ws1d", 1.0), ("ws2d", 1.1), ("wg_x", 2.0)])])
    held = pd.DataFrame([
        {"phase": "decode", "chips": 2, "batch": 8, "topology": "1x2x1", "layout": f"{ffn}/head",
         "predicted_s": p, "tie_s": tie}
        for ffn, p, tie in [("ws1d", 1.01, 1.0), ("ws2d", 1.0, 1.0), ("wg_x", 3.0, 3.0)]])
    row = report.best_layouts_table(df, held).iloc[0]
    assert row["best layout (measured)"] == "ws1d/head@1x2x1"
    assert row["model's pick (held-out, analytical)"] == "ws2d/head@1x2x1"
    assert row["agree"] == "yes (tied with 1)"          # ws1d and ws2d: equal formulas here
    held.loc[held["layout"] == "ws1d/head", "tie_s"] = 1.2
    assert report.best_layouts_table(df, held).iloc[0]["agree"] == "no"


@pytest.mark.ci_slow     # a real host sweep, then fit, pareto, report: ~80 s on 2 loaded cores
def test_fit_pareto_report_on_a_real_host_sweep(tmp_path, monkeypatch, capsys):
    """The whole chain on measured trials: a small host sweep, then fit, pareto, report."""
    import json
    from pathlib import Path

    from sweeper.cli import main
    from sweeper.sweep.controller import run_sweep

    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path / "home"))
    space = Path(__file__).resolve().parents[1] / "search_spaces" / "quickstart.yaml"
    result = run_sweep(str(space), trials=8, parallel=1, study_name="qs", progress=False)
    assert result.counts["complete"] >= calho.MIN_TRIALS
    capsys.readouterr()
    assert main(["fit", "--study", "qs", "--holdout", "all", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["n_points"] == 2 * result.counts["complete"] and fit["mlflow_logged"]
    assert fit["mape_heldout"] is not None and fit["fitted"]["peak_flops"] > 0
    outputs = []
    for source in ("optuna", "mlflow"):
        assert main(["pareto", "--study", "qs", "--source", source, "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["front"])
    assert outputs[0] == outputs[1] and outputs[0]
    assert main(["report", "--study", "qs", "--out", str(tmp_path / "r")]) == 0
    html = (tmp_path / "r" / "report.html").read_text()
    assert set(images(html)) == ALL_FIGURES
    assert "measured on <b>this host</b>" in html


# ----------------------------------------------------------------------------- Optuna's views


def _one_factor_frame():
    """Decode latency set by batch alone (x1.0-1.05 noise); the FFN layout and seed do nothing."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    rows = []
    for i, (batch, ffn, seed) in enumerate((b, f, s) for b in (4, 8, 16, 32) for f in ("ws1d", "ws2d")
                                           for s in (0, 1)):
        step = batch * 1e-3 * (1 + 0.05 * rng.random())
        rows.append({"number": i, "state": "COMPLETE", "source": "measured", "hardware": "host",
                     "model": "tiny", "chips": 2, "batch": batch, "topology": "1x2x1", "weights": "bf16",
                     "prefill_ffn": "ws2d", "prefill_attn": "head", "decode_ffn": ffn,
                     "decode_attn": "head", "seed": seed, "decode_step_s": step,
                     "decode_cost_chip_s_per_token": 2 * step / batch})
    rows.append({"number": len(rows), "state": "PRUNED", "batch": 64, "chips": 2})
    return pd.DataFrame(rows)


def test_importance_finds_the_one_parameter_that_matters():
    from sweeper.analysis import optuna_views

    df = _one_factor_frame()
    decode = optuna_views.param_importance(df, "decode")
    assert decode.skipped is None and decode.n_trials == 16 and decode.evaluator == "fANOVA"
    assert set(decode.importances) == {"batch", "decode_ffn", "seed"}   # only what varies
    assert sum(decode.importances.values()) == pytest.approx(1.0)
    assert decode.importances["batch"] > 0.8
    prefill = optuna_views.param_importance(df, "prefill")   # no prefill_s in this table
    assert prefill.skipped and not prefill.importances


def test_hypervolume_history_ends_at_the_frontier_hypervolume():
    from sweeper.analysis import optuna_views, pareto

    df = _one_factor_frame()
    history = optuna_views.hypervolume_history(df)
    decode = history[history["phase"] == "decode"]
    assert list(decode["number"]) == list(df["number"])              # pruned trials included
    assert (decode["hypervolume"].diff().dropna() >= 0).all()       # never decreases
    assert decode["hypervolume"].iloc[-1] == pytest.approx(pareto.analyse(df, "decode").hypervolume)
    assert decode["hypervolume"].iloc[0] < decode["hypervolume"].iloc[-1]
