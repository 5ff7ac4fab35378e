"""Calibrating to measurements taken elsewhere (a CSV of published numbers,
workloads/measurements.py): the CSV source of the one pipeline.

Each row becomes an `observations.Observation` (`observations.from_measurements`); the fit
(fit.fit_profile) and the hold-out (holdout.calibrate, schemes `loo` and `kfold`) are the
study's own, so `--json` prints the same keys as a study's fit.

MFU rows: MFU is relative to the chip's published peak (paper §4: 275 TFLOP/s for TPU v4),
so it is read against the STARTING profile's peak (`--hardware`), never the fitted
effective peak: predicted MFU = model FLOPs / (chips x published peak x predicted latency).
Every residual is the relative error of the published metric (latency or MFU).

Hold-out: `loo` predicts each row from a fit on the others, holding out with it every row
measured on the same configuration (a table's latency and MFU of one run are one
measurement: leaving one in would leak it); `kfold` does the same over K_FOLDS folds of
configurations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sweeper.analysis.fit import CalibrationError
from sweeper.analysis.holdout import K_FOLDS, Calibration, calibrate, point_frame
from sweeper.analysis.observations import from_measurements, predict_latency
from workloads.config import ConfigError, HardwareProfile
from workloads.measurements import load_measurements

EXTERNAL_HOLDOUTS = ("loo", "kfold")
EXTERNAL_HOLDOUT_TEXT = {
    "loo": "leave-one-out (each row held out with the rows of its configuration)",
    "kfold": f"{K_FOLDS}-fold over configurations",
}
MIN_CONFIGURATIONS = 4       # enough to hold one out and still fit


def observations_of(path: str | Path, base: HardwareProfile):
    """The CSV's rows as observations, MFU read against `base`'s (published) peak."""
    return from_measurements(load_measurements(path), base.peak_flops)


def calibrate_measurements(path: str | Path, base: HardwareProfile, holdouts=("loo",),
                           loss: str = "linear", terms: tuple[str, ...] | str = (),
                           candidates: tuple[str, ...] | None = None) -> Calibration:
    """Fit `base`'s constants to every row of the CSV and evaluate each hold-out scheme.
    `terms`: the extra terms freed (fit.EXTRA_TERMS), or holdout.SELECT to choose them among
    `candidates` by nested cross-validation."""
    holdouts = tuple(holdouts)
    for scheme in holdouts:
        if scheme not in EXTERNAL_HOLDOUTS:
            raise ConfigError("--holdout", scheme, f"one of {list(EXTERNAL_HOLDOUTS)} (with --measurements)")
    observations = observations_of(path, base)
    configs = len({o.group for o in observations})
    if configs < MIN_CONFIGURATIONS:
        raise CalibrationError("measurements", str(path), f"at least {MIN_CONFIGURATIONS} distinct "
                               f"configurations to fit and hold out (it has {configs})")
    return calibrate(observations, base, holdouts, Path(path).name, loss, min_trials=0,
                     weighted=False, terms=terms, candidates=candidates)


def unfitted_frame(result: Calibration) -> pd.DataFrame:
    """The starting (peak) profile's predictions of every row, for the comparison table."""
    latency = np.array([predict_latency(o, result.base) for o in result.points])
    return point_frame(result.points, latency)
