"""Pareto frontier and 2-D hypervolume on hand-built sets (pure functions, no storage)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from sweeper.analysis import pareto
from workloads.config import ConfigError


def _rows(points):
    """Trials with the study's column names; decode metrics set from (x, y)."""
    rows = []
    for number, (x, y) in enumerate(points):
        rows.append({"number": number, "state": "COMPLETE", "source": "measured", "model": "tiny",
                     "batch": 2 ** (number % 4), "chips": 4, "topology": "1x2x2", "weights": "bf16",
                     "decode_ffn": "ws2d", "decode_attn": "head", "prefill_ffn": "wg_x",
                     "prefill_attn": "batch", "decode_step_s": x,
                     "decode_cost_chip_s_per_token": y, "prefill_s": 2 * x,
                     "prefill_cost_chip_s_per_token": y / 3, "decode_mfu": 1 / y})
    return pd.DataFrame(rows)


def _brute_force(points):
    keep = []
    for i, p in enumerate(points):
        dominated = any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1])
                        for q in points)
        keep.append(not dominated)
    return np.array(keep)


def test_front_of_a_hand_built_set():
    # (1,5) (2,3) (4,1) are the frontier; (3,4) is dominated by (2,3); (4,2) by (4,1);
    # (5,1) by (4,1); (2,3) appears twice and both copies are kept.
    points = [(1, 5), (2, 3), (3, 4), (4, 1), (4, 2), (5, 1), (2, 3)]
    front = pareto.pareto_front(_rows(points), phase="decode")
    got = list(zip(front["decode_step_s"], front["decode_cost_chip_s_per_token"]))
    assert got == [(1, 5), (2, 3), (2, 3), (4, 1)]
    assert sorted(front["number"]) == [0, 1, 3, 6]
    assert front["label"][0] == "B1/4c/ws2d/head"


def test_prefill_axes_and_phase_label():
    points = [(1, 5), (2, 3), (3, 4)]
    front = pareto.pareto_front(_rows(points), x="latency_per_token", y="cost_chip_s_per_token",
                                phase="prefill")
    assert list(front["prefill_s"]) == [2, 4]
    assert front["label"][0].endswith("wg_x/batch")


def test_mask_matches_brute_force_on_random_sets_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        pts = rng.integers(0, 6, size=(rng.integers(1, 25), 2)).astype(float)
        assert (pareto.non_dominated_mask(pts[:, 0], pts[:, 1])
                == _brute_force([tuple(p) for p in pts])).all()


def test_maximised_metric_flips_direction():
    # x = decode_step_s (min), y = decode_mfu = 1/cost (max): same frontier as (x, cost).
    points = [(1, 5), (2, 3), (3, 4), (4, 1)]
    df = _rows(points)
    by_cost = pareto.pareto_front(df, phase="decode")
    by_mfu = pareto.pareto_front(df, y="decode_mfu", phase="decode")
    assert list(by_cost["number"]) == list(by_mfu["number"])


def test_failed_trials_and_nan_are_ignored():
    df = _rows([(1, 5), (0.5, 0.5), (2, 3)])
    df.loc[1, "state"] = "FAIL"
    df.loc[2, "decode_step_s"] = math.nan
    front = pareto.analyse(df, phase="decode").front
    assert list(front["number"]) == [0]


def test_unknown_metric_is_a_config_error():
    with pytest.raises(ConfigError, match="metric"):
        pareto.pareto_front(_rows([(1, 1)]), x="decode_latency")
    with pytest.raises(ConfigError, match="phase"):
        pareto.resolve_axes("generate")


def test_hypervolume_of_a_known_set():
    # Staircase (1,3) (2,2) (3,1) with reference (4,4), in vertical strips:
    # x in [1,2): height 4-3=1; [2,3): 4-2=2; [3,4): 4-1=3  -> 1 + 2 + 3 = 6.
    assert pareto.hypervolume([(1, 3), (2, 2), (3, 1)], (4, 4)) == pytest.approx(6.0)
    # Dominated points, duplicates and points outside the reference add nothing.
    assert pareto.hypervolume([(1, 3), (2, 2), (3, 1), (3, 3), (2, 2), (5, 0), (0, 5)],
                              (4, 4)) == pytest.approx(6.0)
    assert pareto.hypervolume([(1, 1)], (3, 2)) == pytest.approx(2.0)
    assert pareto.hypervolume([], (1, 1)) == 0.0


def test_hypervolume_agrees_with_inclusion_exclusion_on_random_sets():
    rng = np.random.default_rng(1)
    for _ in range(20):
        pts = rng.random((rng.integers(1, 7), 2))
        ref = (1.0, 1.0)
        # Exact union area of boxes [p, ref] by inclusion-exclusion.
        total = 0.0
        for r in range(1, len(pts) + 1):
            for subset in itertools.combinations(pts, r):
                corner = np.max(subset, axis=0)
                total += (-1) ** (r + 1) * (ref[0] - corner[0]) * (ref[1] - corner[1])
        assert pareto.hypervolume(pts, ref) == pytest.approx(total)


def test_analyse_reports_reference_and_hypervolume():
    df = _rows([(1, 3), (2, 2), (3, 1), (3, 3)])
    result = pareto.analyse(df, phase="decode", reference=(4, 4))
    assert result.n_points == 4 and len(result.front) == 3
    assert result.hypervolume == pytest.approx(6.0)
    default = pareto.analyse(df, phase="decode")
    assert default.reference == pytest.approx((3.3, 3.3))
    as_dict = result.to_dict()
    assert as_dict["n_front"] == 3 and as_dict["front"][0]["label"].startswith("B")


# ----------------------------------------------------------------------------- a real sweep

SPACE = """
name: pareto-test
model: tiny
hardware: analytical:tpu-v4
input_len: 32
decode_steps: 8
params:
  batch: [4, 16]
  chips: [2, 4]
  prefill_ffn: [ws2d, wg_xyz]
  decode_ffn: [ws2d]
  decode_attn: [head, batch]
objectives:
  - {metric: decode_step_s, direction: minimize}
  - {metric: decode_cost_chip_s_per_token, direction: minimize}
sampler: {type: grid, seed: 0}
trials: 16
parallel: 1
"""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from sweeper.sweep.controller import run_sweep

    root = tmp_path_factory.mktemp("pareto")
    (root / "space.yaml").write_text(SPACE)
    storage, tracking = f"sqlite:///{root}/optuna.db", f"sqlite:///{root}/mlflow.db"
    result = run_sweep(str(root / "space.yaml"), storage=storage, tracking_uri=tracking,
                       study_name="p", progress=False)
    assert result.counts["complete"] == 16
    return root, storage, tracking, result


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_same_front_from_optuna_and_from_mlflow(sweep, phase):
    _, storage, tracking, _ = sweep
    from_optuna = pareto.analyse(pareto.load_points("p", "optuna", storage, tracking), phase)
    from_mlflow = pareto.analyse(pareto.load_points("p", "mlflow", storage, tracking), phase)
    assert from_optuna.n_points == from_mlflow.n_points == 16
    assert len(from_optuna.front) >= 2
    pd.testing.assert_frame_equal(from_optuna.table().reset_index(drop=True),
                                  from_mlflow.table().reset_index(drop=True), check_dtype=False)
    assert from_optuna.hypervolume == pytest.approx(from_mlflow.hypervolume, rel=1e-12)
    assert from_optuna.hypervolume > 0


def test_front_matches_the_controllers_pareto_rows(sweep):
    _, storage, tracking, result = sweep
    front = pareto.analyse(pareto.load_points("p", "optuna", storage), "decode").front
    assert sorted(front["number"]) == sorted(r["number"] for r in result.pareto)


def test_pareto_cli_json_csv_png_and_errors(sweep, capsys):
    import json

    from sweeper.cli import main

    root, storage, tracking, _ = sweep
    capsys.readouterr()
    outputs = {}
    for source in ("optuna", "mlflow"):
        assert main(["pareto", "--study", "p", "--storage", storage, "--tracking-uri", tracking,
                     "--source", source, "--phase", "prefill", "--json"]) == 0
        outputs[source] = json.loads(capsys.readouterr().out)
    assert outputs["optuna"]["front"] == outputs["mlflow"]["front"]
    assert outputs["optuna"]["x"] == "prefill_s"
    csv, png = root / "front.csv", root / "front.png"
    assert main(["pareto", "--study", "p", "--storage", storage, "--csv", str(csv),
                 "--png", str(png), "--y", "decode_mfu"]) == 0
    assert "decode_mfu" in capsys.readouterr().out
    assert pd.read_csv(csv)["label"].str.match(r"B\d+/\dc/").all()
    assert png.read_bytes().startswith(b"\x89PNG")
    assert main(["pareto", "--study", "p", "--storage", storage, "--x", "latency"]) == 2
    assert "metric" in capsys.readouterr().err
    assert main(["pareto", "--study", "nope", "--storage", storage]) == 2
