"""Calibration on REAL measurements: the recorded calibration sweep (benchmarks/data/,
`search_spaces/calibration.yaml` measured on the development VM; benchmarks/calibration.py
--record wrote it). Covers the CI weighting, each hold-out scheme and the noise floor on data
no synthetic oracle produced (tests/test_calibrate.py covers the same code on synthetic data).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweeper.analysis import fit as calfit
from sweeper.analysis import holdout as calho
from workloads.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "benchmarks" / "data" / "calibration-trials.csv"
BASE = ROOT / "benchmarks" / "data" / "calibration-host.yaml"
CONFIG_COLUMNS = ["model", "chips", "batch", "input_len", "decode_steps", "topology", "weights",
                  "prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn"]


@pytest.fixture(scope="module")
def recorded():
    frame = pd.read_csv(CSV)
    base = load_hardware(str(BASE), field="hardware")
    points = calfit.points_from_frame(frame, base)
    assert len({p.trial for p in points}) >= calho.MIN_TRIALS
    return frame, base, points


def test_recorded_points_carry_their_measured_ci(recorded):
    frame, _, points = recorded
    done = frame[frame["state"] == "COMPLETE"].set_index("number")
    for p in points:
        assert p.ci_rel == pytest.approx(done.loc[p.trial, f"{p.phase}_ci_rel"], nan_ok=True)
        assert p.config.seed == done.loc[p.trial, "seed"]
    assert np.isfinite([p.ci_rel for p in points]).all()


def test_weights_follow_the_ci_and_are_equal_without_one(recorded):
    _, _, points = recorded
    w = calfit.point_weights(points)
    ci = np.array([p.ci_rel for p in points])
    assert w.mean() == pytest.approx(1.0)
    assert np.all(np.diff(w[np.argsort(ci)]) <= 1e-12)       # wider CI, smaller weight
    assert w.max() / w.min() > 1.5                            # the recorded CIs do differ
    blind = [calfit.Point(p.trial, p.phase, p.config, p.measured_s, p.scale) for p in points]
    assert np.all(calfit.point_weights(blind) == 1.0)


def test_the_weighted_fit_minimises_the_weighted_error(recorded):
    """Each fit is the optimum of its own objective: the weights reach the optimiser."""
    _, base, points = recorded
    space = calfit.default_space(points)
    measured = np.array([p.measured_s for p in points])
    w = calfit.point_weights(points)

    def errors(profile):
        return np.array([calfit.predict_point(p, profile) for p in points]) / measured - 1

    weighted = errors(calfit.fit_profile(points, base, space, weighted=True).profile)
    equal = errors(calfit.fit_profile(points, base, space, weighted=False).profile)
    assert np.sum((w * weighted) ** 2) <= np.sum((w * equal) ** 2) * 1.01
    assert np.sum(equal ** 2) <= np.sum(weighted ** 2) * 1.01
    assert not np.allclose(weighted, equal, rtol=1e-3)        # and the weights change the fit


@pytest.mark.parametrize("scheme", ["kfold", "layout", "chips"])
def test_each_scheme_holds_out_every_point_once_in_a_fold_disjoint_from_its_training_set(recorded, scheme):
    _, _, points = recorded
    parts = calho.splits(points, scheme)
    held = np.concatenate([test for _, test in parts])
    assert sorted(held.tolist()) == list(range(len(points)))
    for train, test in parts:
        assert not set(train.tolist()) & set(test.tolist())
        if scheme == "chips":
            assert len({points[i].config.chips for i in test}) == 1
        if scheme == "layout":
            assert len({points[i].layout_key for i in test}) == 1


def test_extrapolation_trains_on_half_the_chips_or_fewer(recorded):
    _, base, points = recorded
    parts = calho.splits(points, "extrapolation")
    assert parts, "the recorded sweep has chip counts >= 4"
    for train, test in parts:
        (n,) = {points[i].config.chips for i in test}
        assert n >= calho.EXTRAPOLATE_FROM
        assert max(points[i].config.chips for i in train) <= n / 2
        assert len({points[i].config.chips for i in train}) >= 2
    ho = calho.heldout(points, base, "extrapolation")
    assert not ho.skipped and len(ho.points) == sum(len(t) for _, t in parts)
    assert ho.points["chips"].min() >= calho.EXTRAPOLATE_FROM
    assert np.isfinite(ho.points["predicted_s"]).all() and math.isfinite(ho.mape)


def test_noise_floor_is_the_replicate_error_of_the_recorded_trials(recorded):
    """Recomputed from the CSV with pandas alone: configurations run with several seeds,
    each trial against the median of the others, divided by sqrt(1 + 1/(n-1)) so the floor
    is one measurement's error (a pair's error / sqrt 2), not two measurements' (issue 20)."""
    frame, _, points = recorded
    done = frame[frame["state"] == "COMPLETE"]
    expected = []
    for metric in ("prefill_s", "decode_step_s"):
        for _, grp in done.groupby(CONFIG_COLUMNS, dropna=False):
            values = grp[metric].to_numpy(float)
            for i, v in enumerate(values):
                if len(values) > 1:
                    expected.append(abs(np.median(np.delete(values, i)) - v) / v
                                    / math.sqrt(1 + 1 / (len(values) - 1)))
    floor = calho.noise_floor(points)
    assert floor.n_points == len(expected) and floor.n_points >= 2, "replicated configurations"
    assert floor.mape == pytest.approx(np.mean(expected))
    assert floor.median_ape == pytest.approx(np.median(expected))


def test_calibration_reports_the_noise_floor_beside_every_heldout_error(recorded):
    _, base, points = recorded
    result = calho.calibrate(points, base, calho.HOLDOUTS, "recorded")
    summary = result.summary()
    assert summary["noise_floor"]["n_points"] == result.noise.n_points
    for name, ho in summary["holdouts"].items():
        assert "noise_floor_mape" in ho and "caveats" in ho
        if not ho["skipped"] and ho["ranking_groups"] < calho.MIN_GROUPS:
            assert any("too few groups" in c for c in ho["caveats"])


def test_the_end_of_sweep_line_says_when_a_figure_is_not_a_verdict(recorded):
    from sweeper.cli.run import heldout_line

    _, base, points = recorded
    summary = calho.calibrate(points, base, ("kfold",), "recorded").summary()
    ho = dict(summary["holdouts"]["kfold"])
    line = heldout_line("kfold", ho)
    assert f"over {ho['ranking_groups']} groups" in line and "noise floor" in line
    few = dict(ho, ranking_groups=3, caveats=calho.caveats(0.30, None, 3))
    assert "too few groups to judge" in heldout_line("kfold", few)
    noisy = calho.NoiseFloor(0.2, 0.2, 10, 5)
    quiet = calho.NoiseFloor(0.01, 0.01, 10, 5)
    assert any("noise floor" in c for c in calho.caveats(0.25, noisy, 12))
    assert calho.caveats(0.25, quiet, 12) == []


def test_gather_residuals_split_the_prefill_error_by_weights_gathered(recorded):
    """benchmarks.calibration's cache check (issue 20): a device's gathered weights per layer
    are one layer's weights / the chips they stay split over (the cost model's weight-gathered
    read, less the unembedding, per layer); ws2d is the reference; a perfect prediction gives
    equal errors at equal bytes, so the verdict cannot reject the cache guess on it."""
    from benchmarks import calibration as bench
    from workloads import costmodel
    from workloads.layouts import split_axes

    _, base, points = recorded
    kfold = calho.heldout(points, base, "kfold").points
    g = bench.gather_residuals(kfold, points)
    model = next(p for p in points if p.phase == "prefill").calls[0].call.model
    cells = {(r["chips"], r["ffn"]): r for r in g["rows"]}
    assert set(cells) == {(c, f) for c in (2, 4, 8) for f in bench.GATHER_LAYOUTS}
    for (chips, ffn), r in cells.items():
        assert len(g["rows_md"]) == len(g["rows"])
        if ffn == "ws2d":
            assert r["gathered_per_device_layer_bytes"] == 0.0 and r["measured_above_ws2d_s"] == 0.0
            continue
        topology = tuple(int(a) for a in r["topology"].split("x"))
        rest = split_axes(ffn, topology)[3]
        unembedding = model.vocab * model.d_model * 2 / chips
        per_layer = (costmodel._gathered_weight_read_bytes(model, chips, "bf16", rest) - unembedding) \
            / model.n_layers
        assert r["gathered_per_device_layer_bytes"] == pytest.approx(per_layer)
        assert r["gathered_by_mesh_layer_bytes"] == pytest.approx(per_layer * chips)
        assert r["group"] * r["groups"] == chips and r["n"] > 0
    # the recording host's caches (its notes), not those of the host scoring it
    assert g["text"].startswith("Caches of the host that recorded the sweep")
    assert g["caches_bytes"] == json.loads(bench.RECORDED_META.read_text())["caches_bytes"]
    perfect = kfold.assign(predicted_s=kfold["measured_s"])
    ideal = bench.gather_residuals(perfect, points)
    assert all(r["signed_median"] == pytest.approx(0.0) for r in ideal["rows"])
    assert all(r["measured_above_ws2d_s"] == pytest.approx(r["predicted_above_ws2d_s"]) for r in ideal["rows"])
    assert ideal["cache_could_explain"] and "worth testing" in ideal["text"]


def test_quickstart_batch_slopes_show_the_per_sequence_cost_of_decode():
    """benchmarks.calibration's residual structure of the recorded quickstart (issue 20): each
    row's slopes are lines in batch through its chip count's trials; on one chip, with each
    trial's fastest run, a decode step costs about twice a prefill token per sequence while
    the paper's model (the same FLOPs per token) gives about 1: the cost attention_half_rows
    models (docs/calibration.md)."""
    from benchmarks import calibration as bench

    frame = pd.read_csv(bench.QUICKSTART)
    base = load_hardware(str(bench.QUICKSTART_BASE), field="hardware")
    rows = {(r["statistic"], r["chips"]): r for r in bench.batch_slopes(frame, base)}
    one = rows[("min", 1)]
    cell = frame[frame["chips"] == 1]
    decode = np.polyfit(cell["batch"], cell["decode_step_s_min"], 1)[0]
    prefill = np.polyfit(cell["batch"] * cell["input_len"], cell["prefill_s_min"], 1)[0]
    assert one["trials"] == len(cell)
    assert one["decode_s_per_sequence"] == pytest.approx(decode)
    assert one["ratio"] == pytest.approx(decode / prefill)
    assert one["model_ratio"] < 1.2 and one["ratio"] > 1.5 * one["model_ratio"]


def test_multigroup_gathers_holds_out_without_exactly_the_multi_group_weight_gathers(recorded):
    """benchmarks.calibration's attribution (issue 20): the points left out are the prefill
    points whose weight-gathered program has more than one gather group (the weights left split
    over the other axes: wg_xy on 1x2x2 and 1x4x2), and the 'all points' row is the plain
    hold-out with the same terms."""
    from benchmarks import calibration as bench
    from benchmarks.render import calibration as render
    from workloads.layouts import split_axes

    frame, base, points = recorded
    m = bench.multigroup_gathers(points, base, (), frame)
    multi = [p for p in points if p.phase == "prefill" and p.calls[0].call.layout.ffn.startswith("wg")
             and split_axes(p.calls[0].call.layout.ffn, tuple(p.calls[0].call.topology))[3] > 1]
    assert m["excluded_points"] == len(multi) == 32
    assert m["excluded_cells"] == ["wg_xy x4", "wg_xy x8"]
    kfold = calho.heldout(points, base, "kfold", terms=())
    assert m["fits"]["all points"]["kfold"]["mape_vs_mean"] == pytest.approx(
        float(kfold.replicate_means["ape"].mean()))
    assert set(m["fits"]["without multi-group gathers"]) == set(calho.HOLDOUTS)
    without = m["fits"]["without multi-group gathers"]["kfold"]["cells"]
    assert set(without) == {f"{ph} x{c}" for ph in ("decode", "prefill") for c in (1, 2, 4, 8)}
    assert m["hlo_comm_bytes_per_chip"]["wg_xyz x8"] > m["hlo_comm_bytes_per_chip"]["wg_xy x8"] > 0
    assert any("more than one group" in line for line in render._multigroup_lines(m))


def test_without_one_chip_points_the_per_layer_cost_stays_where_a_one_chip_step_has_it():
    """Issue 20, the held-out 1-chip decode of leave-one-chip-count-out: fitted on 2-8 chips
    (every decode step has the same collectives per layer) with the fold's terms, each per-op
    collective latency stays within fit.HOST_COLLECTIVE_LATENCY_MAX_S, so the per-layer fixed
    cost stays in op_overhead_s and the unseen 1-chip decode is predicted within 15% (without
    the bound: op_overhead_s 0, a reduce-scatter 2.4 ms, the 1-chip decode -37%)."""
    frame = pd.read_csv(CSV)
    base = load_hardware(str(BASE), field="hardware")
    points = calfit.points_from_frame(frame, base, statistic="min")
    train = [p for p in points if p.chips != 1]
    terms = ("collective_rendezvous_s", "attention_half_rows")   # what the fold's selection kept
    fitted = calfit.fit_profile(train, base, calfit.default_space(train, terms)).profile
    assert max(fitted.collective_latency_s_by_kind.values()) <= calfit.HOST_COLLECTIVE_LATENCY_MAX_S * (1 + 1e-9)
    assert fitted.op_overhead_s > 1e-4
    one = [calfit.predict_point(p, fitted) / p.measured - 1
           for p in points if p.chips == 1 and p.phase == "decode"]
    assert abs(float(np.median(one))) < 0.15


def test_the_committed_one_chip_fold_table_is_what_its_json_renders():
    """benchmarks/results/calibration.{json,md}: the 1-chip fold's rows (each latency bound,
    the fold and every point) render as committed, constants at their 0 bound read 0."""
    import json

    from benchmarks import calibration as bench
    from benchmarks.render import calibration as render

    result = json.loads((bench.common.RESULTS / "calibration.json").read_text())
    fold = result["one_chip_fold"]
    assert fold["cap_s"] == calfit.HOST_COLLECTIVE_LATENCY_MAX_S
    assert len(fold["rows"]) == 2 * (1 + len(bench.ONE_CHIP_CAPS))
    lines = render._one_chip_lines(fold)
    assert "\n".join(lines) in (bench.common.RESULTS / "calibration.md").read_text()
    assert "1e-09 ms" not in "\n".join(lines)


def test_the_second_hosts_recording_renders_beside_the_targets(tmp_path):
    """benchmarks.calibration `second_host`: the calibration sweep recorded on another VM
    (benchmarks/data/calibration-host2-*), scored by the same pipeline; its section names the
    CPU and every scheme's error against its own floor. Absent data: no section."""
    from benchmarks import calibration as bench
    from benchmarks.render import calibration as render

    assert bench.second_host(tmp_path / "missing.csv") is None
    assert render._second_host_lines(None) == []
    meta = json.loads(bench.SECOND_HOST_META.read_text())
    assert meta["cpu"] and meta["study"]
    committed = json.loads((ROOT / "benchmarks" / "results" / "calibration.json").read_text())["second_host"]
    assert committed["recorded"]["study"] == meta["study"]
    assert set(committed["holdouts"]) == set(bench.TARGET_SCHEMES)
    text = "\n".join(render._second_host_lines(committed))
    assert meta["cpu"] in text and "## The same sweep on a second host" in text
    for name, t in committed["holdouts"].items():
        assert f"| {name} | {t['configurations']} |" in text
