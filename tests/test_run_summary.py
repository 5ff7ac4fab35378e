"""`sweeper run`'s closing lines: a refused fit says it was refused and why, in one line,
never "fitted profile: None" (issue 20)."""

from __future__ import annotations

from sweeper.cli.run import format_sweep_summary

HOLDOUT = {"mape_heldout": 0.3, "median_ape_heldout": 0.1, "max_ape_heldout": 1.2,
           "top1_agreement": 1.0, "ranking_groups": 2, "noise_floor_mape": 0.05}


def summary(fitted_yaml, refused):
    return {"pareto": {}, "report": "out/report.html", "fitted_yaml": fitted_yaml,
            "heldout": {"holdouts": {"k-fold": HOLDOUT}, "refused": refused}}


def test_a_refused_fit_names_why_in_one_line():
    why = ("held-out fold 3 (trial 7, phase decode) is off by 120%,\n 8.0x the median fold's "
           "15% (limit 3x)")
    text = format_sweep_summary(summary(None, why))
    assert "None" not in text
    line = next(l for l in text.splitlines() if l.startswith("fitted profile:"))
    assert "refused" in line and "held-out fold 3" in line and "limit 3x" in line


def test_a_published_fit_names_its_file():
    text = format_sweep_summary(summary("out/calibration/host-fitted.yaml", None))
    assert "fitted profile: out/calibration/host-fitted.yaml" in text and "refused" not in text
