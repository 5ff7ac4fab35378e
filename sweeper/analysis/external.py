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

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from sweeper.analysis.fit import CalibrationError, default_space, fit_profile
from sweeper.analysis.holdout import K_FOLDS, Calibration, calibrate, point_frame
from sweeper.analysis.observations import from_measurements, predict_latency
from workloads.config import WORLD_CALIBRATION, ConfigError, HardwareProfile
from workloads.measurements import load_measurements, row_calls

EXTERNAL_HOLDOUTS = ("loo", "kfold")
EXTERNAL_HOLDOUT_TEXT = {
    "loo": "leave-one-out (each row held out with the rows of its configuration)",
    "kfold": f"{K_FOLDS}-fold over configurations",
}
MIN_CONFIGURATIONS = 4       # enough to hold one out and still fit


def observations_of(path: str | Path, base: HardwareProfile):
    """The CSV's rows as observations, MFU read against `base`'s (published) peak. A row
    that names its chip (`hardware`) is kept only on `base`'s chip (its name, or the datasheet
    of a preset fitted to published rows), and a row that needs a behaviour the model lacks
    (`needs`) never: neither can calibrate `base`."""
    chips = {base.name, WORLD_CALIBRATION.get(base.name, {}).get("datasheet")}
    rows = load_measurements(path)
    kept = [p for p in rows if (p.hardware is None or p.hardware in chips) and not p.needs]
    if not kept:
        raise CalibrationError("measurements", str(path), f"rows measured on {base.name} that "
                               f"need no behaviour the model lacks (its {len(rows)} rows are "
                               f"on {sorted({p.hardware for p in rows if p.hardware})})")
    return from_measurements(kept, base.peak_flops)


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


# ----------------------------------------------------------------------------- the world
#
# Published serving measurements of real engines on several chips (benchmarks/world.py,
# docs/world.md). A profile of chip H is fitted to rows measured on H and on other chips of
# its family: a row measured on chip G enters H's fit as an observation whose rates are G's
# sheet over H's (Observation.scale per rate), so what the fit learns of G's rows is an
# efficiency of the sheet and a fixed cost, shared by the family's chips. Its held-out
# error is leave-one-source-out: every row of one source predicted by a fit on the other
# sources' rows (of the family; of every chip when the family has no other source). Rows
# that need a behaviour the model lacks (MeasuredPoint.needs) are predicted, never fitted.

WORLD_LOSS = "soft_l1"           # one doubtful row counts linearly, not squared (paper_fit's choice)
# The one extra term freed (fit.EXTRA_TERMS): a fixed cost per engine call (kernel launches,
# the host's step bookkeeping), which a GPU's small-batch decode step is made of.
WORLD_TERMS = ("launch_overhead_s",)
FAMILIES = ("gpu", "tpu")


def family(hardware: str) -> str:
    """A chip's family: its engines share a software stack (CUDA and NCCL; XLA on TPUs)."""
    return "tpu" if hardware.startswith("tpu") else "gpu"


def sheet_ratios(sheet: HardwareProfile, target: HardwareProfile) -> tuple[float, float, float]:
    """(peak, HBM, interconnect) of `sheet` over `target`: a row measured on `sheet`'s chip
    predicted with a profile of `target`'s."""
    return (sheet.peak_flops / target.peak_flops, sheet.hbm_bandwidth / target.hbm_bandwidth,
            sheet.ici_bandwidth / target.ici_bandwidth)


def world_observation(point, sheets: dict[str, HardwareProfile], target: HardwareProfile):
    """A published row as an observation of `target`'s profile (module section above): its
    group is its source (leave-one-source-out), MFU read against its own chip's sheet."""
    sheet = sheets[point.hardware]
    (obs,) = from_measurements([point], sheet.peak_flops)
    info = {**obs.info, "hardware": point.hardware, "source_id": point.source_id,
            "needs": ";".join(point.needs)}
    return dataclasses.replace(obs, group=point.source_id, trial=point.row,
                               scale=sheet_ratios(sheet, target), info=info)


def fit_world(points, target: HardwareProfile, sheets: dict[str, HardwareProfile],
              loss: str = WORLD_LOSS, terms: tuple[str, ...] = WORLD_TERMS, name: str | None = None):
    """`target`'s constants fitted to the rows (those needing no missing behaviour)."""
    obs = [world_observation(p, sheets, target) for p in points if not p.needs]
    if not obs:
        raise CalibrationError("rows", 0, "at least one row to fit (rows that need a missing "
                               "behaviour are never fitted)")
    return fit_profile(obs, target, default_space(obs, terms), loss, name=name, weighted=False)


def training_rows(points, held_source: str, hardware: str) -> tuple[list, str]:
    """The rows a held-out source's rows on `hardware` are predicted from, and which: the
    other sources' rows of the chip's family, or of every chip when the family has none."""
    others = [p for p in points if p.source_id != held_source and not p.needs]
    same = [p for p in others if family(p.hardware) == family(hardware)]
    if same:
        return same, f"{family(hardware)} rows of other sources"
    return others, "every other source's rows (none of its family)"


def leave_one_source_out(points, sheets: dict[str, HardwareProfile], loss: str = WORLD_LOSS,
                         terms: tuple[str, ...] = WORLD_TERMS) -> list[dict]:
    """Every row predicted by a fit that saw none of its source's rows (module section):
    per row the held-out latency, the fold's training rows and its fitted profile."""
    out = []
    for source in sorted({p.source_id for p in points}):
        for hardware in sorted({p.hardware for p in points if p.source_id == source}):
            train, what = training_rows(points, source, hardware)
            fold = fit_world(train, sheets[hardware], sheets, loss, terms).profile
            for p in points:
                if p.source_id == source and p.hardware == hardware:
                    obs = world_observation(p, sheets, sheets[hardware])
                    out.append({"row": p, "latency_s": predict_latency(obs, fold),
                                "training": what, "training_rows": len(train), "profile": fold})
    return out


def residual_phase(point, profile: HardwareProfile) -> str:
    """The phase a row's error is a step-time error of: its own, or for a prefill + decode
    row the one that takes most of its predicted time (an error band scales one phase)."""
    if point.phase in ("prefill", "decode"):
        return point.phase
    time = {"prefill": 0.0, "decode": 0.0}
    for weight, variant, call in row_calls(point):
        if variant == 0:
            time[call.phase] += weight * call.predict(profile).latency_s
    return max(time, key=time.get)
