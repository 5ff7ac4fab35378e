"""Calibrating a stored study: read its trials, fit and hold out (sweeper/analysis/fit.py,
holdout.py), write the fitted profile and the error table, log them to the sweep's MLflow
parent run. `sweeper fit` (sweeper/cli/analysis.py) prints the result.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd
import yaml

from sweeper.analysis import plots
from sweeper.analysis.fit import CalibrationError, points_from_frame
from sweeper.analysis.holdout import HOLDOUT_TEXT, Calibration, calibrate
from sweeper.formatting import jsonable, percent_dash
from sweeper.paths import default_storage
from sweeper.tracking import results
from sweeper.tracking.study import load_study
from workloads.config import HardwareProfile
from workloads.hardware import load_hardware


# ----------------------------------------------------------------------------- studies


def study_base_profile(attrs: Mapping[str, Any]) -> HardwareProfile:
    """The profile the sweep predicted with: `host` (this host, measured and cached), a
    preset or a YAML (relative to the space file), from the study's `hardware` label.
    A study that stored the profile itself (user attr `hardware_profile`) gives that one."""
    if isinstance(attrs.get("hardware_profile"), Mapping):
        return HardwareProfile.from_dict(attrs["hardware_profile"], source="study user_attrs")
    label = str(attrs.get("hardware") or "host")
    kind, _, profile = label.partition(":")
    spec = profile or "host"
    if spec.endswith((".yaml", ".yml")) and not Path(spec).is_absolute() and attrs.get("space_file"):
        candidate = Path(str(attrs["space_file"])).parent / spec
        if candidate.is_file():
            spec = str(candidate)
    return load_hardware(spec, field="hardware")


@dataclass
class StudyData:
    """A study's trials as `sweeper.tracking.results` reads them, plus what calibration needs."""

    name: str
    storage: str
    frame: pd.DataFrame
    attrs: dict[str, Any]
    configs: dict[int, dict]

    @property
    def parent_run_id(self) -> str | None:
        return self.attrs.get("mlflow_parent_run_id")

    @property
    def tracking_uri(self) -> str | None:
        return self.attrs.get("tracking_uri")

    @property
    def source(self) -> str:
        return str(self.attrs.get("source") or "measured")


def load_study_data(study_name: str, storage: str | None = None) -> StudyData:
    """The study's table, user attrs and trial configs, from one open of its storage."""
    storage = storage or default_storage(create=False)
    study = load_study(study_name, storage)
    trials = study.get_trials(deepcopy=False)
    configs = {t.number: t.user_attrs["config"] for t in trials
               if isinstance(t.user_attrs.get("config"), Mapping)}
    return StudyData(study_name, storage, results.trials_frame(study, trials),
                     dict(study.user_attrs), configs)


def calibrate_study(data: StudyData, holdouts: Iterable[str] = ("kfold",),
                    start: HardwareProfile | None = None, loss: str = "linear",
                    terms: tuple[str, ...] | str = ()) -> Calibration:
    """Calibrate a study's measured trials. Each trial's share of the hardware is taken
    relative to the profile the sweep used; `start` only changes where the fit begins.
    `terms`: the extra terms freed (fit.EXTRA_TERMS), or holdout.SELECT to choose them by
    nested cross-validation (each held-out fold's on its own training points)."""
    if data.source != "measured":
        raise CalibrationError("study", data.name, "a study of measured trials (this one is "
                               f"{data.source}: the cost model fitted to itself says nothing)")
    swept = study_base_profile(data.attrs)
    points = points_from_frame(data.frame, swept, data.configs)
    result = calibrate(points, start or swept, holdouts, data.name, loss, terms=terms)
    result.parent_run_id, result.tracking_uri = data.parent_run_id, data.tracking_uri
    return result


# ----------------------------------------------------------------------------- outputs


def write_profile(profile: HardwareProfile, path: str | Path, note: str | None = None) -> Path:
    """A hardware YAML that `--hardware` (HardwareProfile.from_dict) loads back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_dict()
    if not data.get("collective_latency_s_by_kind"):
        data.pop("collective_latency_s_by_kind", None)
    header = f"# {note}\n" if note else ""
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    HardwareProfile.from_dict(yaml.safe_load(path.read_text()), source=str(path))  # round-trips
    return path


def predicted_png(result: Calibration, source_label: str) -> bytes:
    """The held-out predicted-vs-measured figure as PNG, drawn once per calibration (the
    calibration folder and the report show the same figure)."""
    title = (f"study {result.study}: held-out predictions ({HOLDOUT_TEXT[result.headline]}): "
             f"analytical, fitted, against {source_label}; MAPE {percent_dash(result.main.mape)}")
    if title not in result.pngs:
        result.pngs[title] = plots.png_bytes(plots.predicted_vs_measured_figure(result.main.points, title))
    return result.pngs[title]


def write_outputs(result: Calibration, out_dir: str | Path, fitted_yaml: str | Path | None = None,
                  source_label: str = plots.source_label("measured", "host")) -> dict[str, str]:
    """errors.csv / errors.json / heldout_points.csv / predicted_vs_measured.png / fitted YAML.
    `source_label`: where the measured numbers come from (plots.source_label)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    tables = []
    for name, ho in result.holdouts.items():
        table = ho.errors.assign(holdout=name)
        tables.append(table)
    errors = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    errors.to_csv(out_dir / "errors.csv", index=False)
    files["errors_csv"] = str(out_dir / "errors.csv")
    (out_dir / "errors.json").write_text(json.dumps(jsonable(result.summary()), indent=2))
    files["errors_json"] = str(out_dir / "errors.json")
    pd.concat([ho.points.assign(holdout=n) for n, ho in result.holdouts.items()],
              ignore_index=True).to_csv(out_dir / "heldout_points.csv", index=False)
    files["heldout_points_csv"] = str(out_dir / "heldout_points.csv")
    (out_dir / "predicted_vs_measured.png").write_bytes(predicted_png(result, source_label))
    files["predicted_vs_measured_png"] = str(out_dir / "predicted_vs_measured.png")
    if result.refused:   # a blown-up held-out fold: the tables are written, the profile is not
        result.artifacts = files
        return files
    yaml_path = Path(fitted_yaml) if fitted_yaml else out_dir / f"{result.fitted.name}.yaml"
    write_profile(result.fitted, yaml_path,
                  note=f"fitted by `sweeper fit` to study {result.study} ({len(result.points)} "
                       f"points); held-out MAPE {percent_dash(result.main.mape)}")
    files["fitted_yaml"] = str(yaml_path)
    result.artifacts = files
    return files


def log_to_mlflow(result: Calibration, files: Mapping[str, str]) -> bool:
    """Metrics and artifacts on the sweep's parent run; False when there is none."""
    if not (result.parent_run_id and result.tracking_uri):
        return False
    from mlflow.entities import Metric   # lazy: MLflow (~1 s)
    from mlflow.tracking import MlflowClient   # lazy: MLflow (~1 s) only when a store is read

    client = MlflowClient(tracking_uri=result.tracking_uri)
    now = int(time.time() * 1000)
    metrics = []
    for name, ho in result.holdouts.items():
        for key, value in (("mape", ho.mape), ("median_ape", ho.median_ape), ("max_ape", ho.max_ape),
                           ("top1_agreement", ho.top1_agreement), ("kendall_tau", ho.kendall_tau)):
            if math.isfinite(value):
                metrics.append(Metric(f"heldout_{key}_{name}", float(value), now, 0))
                if name == result.headline:
                    metrics.append(Metric(f"heldout_{key}" if key != "top1_agreement"
                                          else "top1_agreement", float(value), now, 0))
    metrics.append(Metric("calibration_points", float(len(result.points)), now, 0))
    if result.noise is not None and math.isfinite(result.noise.mape):   # beside every error
        metrics.append(Metric("noise_floor_mape", float(result.noise.mape), now, 0))
        metrics.append(Metric("noise_floor_median_ape", float(result.noise.median_ape), now, 0))
    client.log_batch(result.parent_run_id, metrics=metrics)
    for path in files.values():
        client.log_artifact(result.parent_run_id, path, artifact_path="calibration")
    return True
