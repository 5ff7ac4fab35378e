"""Latency/cost Pareto frontiers of a sweep (paper §4.4, Figure 1) and their 2-D hypervolume.

What is on each axis, per phase (both minimised):

  decode:  x = `decode_step_s`  — latency per generated token (one decode step of the batch)
           y = `decode_cost_chip_s_per_token` — chip-seconds per generated token
  prefill: x = `prefill_s`      — latency of processing the whole prompt (time to first token),
                                  as in the paper's Figure 1 (right); a per-token prefill latency
                                  would reward long prompts for taking long
           y = `prefill_cost_chip_s_per_token` — chip-seconds per prompt token

`x="latency_per_token"` and `y="cost_chip_s_per_token"` are the phase-generic names of these
defaults; any other metric column (`prefill_mfu`, `total_s`, ...) can be used instead, with
`maximize` for metrics where more is better.

The frontier is computed on whatever DataFrame it is given; `load_points` reads it from
Optuna storage or from MLflow runs (`sweeper.tracking.results`) so both give the same answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from sweeper.paths import default_storage, default_tracking_uri
from sweeper.tracking import results
from sweeper.tracking.mlflow_log import KIND_TAG, SWEEP_KIND
from workloads.config import ConfigError
from workloads.validate import one_of

PHASES = ("prefill", "decode")
LATENCY_ALIAS = "latency_per_token"
COST_ALIAS = "cost_chip_s_per_token"
DEFAULT_AXES = {
    "decode": ("decode_step_s", "decode_cost_chip_s_per_token"),
    "prefill": ("prefill_s", "prefill_cost_chip_s_per_token"),
}
# Metrics where larger is better; every other metric is minimised.
MAXIMISED = ("prefill_mfu", "decode_mfu", "prefill_tokens_per_s", "decode_tokens_per_s")
# What a frontier row is labelled with (paper Figure 1 labels points with batch / chips / layout).
LABEL_COLUMNS = ("number", "model", "weights", "batch", "chips", "topology", "input_len",
                 "decode_steps")


def resolve_axes(phase: str, x: str | None = None, y: str | None = None) -> tuple[str, str]:
    """Phase-generic names -> the metric columns of that phase."""
    one_of("phase", phase, PHASES)
    default_x, default_y = DEFAULT_AXES[phase]
    x = default_x if x in (None, LATENCY_ALIAS) else x
    y = default_y if y in (None, COST_ALIAS) else y
    return x, y


def layout_columns(phase: str) -> tuple[str, str]:
    return f"{phase}_ffn", f"{phase}_attn"


def layout_label(row: pd.Series | dict, phase: str) -> str:
    """'ws2d/head' for the phase's FFN and attention layout."""
    ffn, attn = layout_columns(phase)
    return f"{row.get(ffn, '?')}/{row.get(attn, '?')}"


def point_label(row: pd.Series | dict, phase: str) -> str:
    """Figure 1 style annotation: batch / chips / layout (and int8 when quantised)."""
    text = f"B{int(row['batch'])}/{int(row['chips'])}c/{layout_label(row, phase)}"
    if row.get("weights") == "int8":
        text += "/int8"
    return text


def non_dominated_mask(xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """True where (x, y) is not dominated by another point; both minimised.

    q dominates p when q.x <= p.x and q.y <= p.y with one strict. Identical points do not
    dominate each other, so duplicates are all kept. O(n log n): sort by x then y and sweep.
    """
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    mask = np.zeros(len(xs), dtype=bool)
    order = np.lexsort((ys, xs))
    best_before = math.inf          # min y over points with strictly smaller x
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and xs[order[j]] == xs[order[i]]:
            j += 1
        group = order[i:j]          # equal x, sorted by y
        group_min = ys[group[0]]
        if group_min < best_before:
            mask[group[ys[group] == group_min]] = True
        best_before = min(best_before, group_min)
        i = j
    return mask


def pareto_front(df: pd.DataFrame, x: str | None = None, y: str | None = None,
                 phase: str = "decode", maximize: Iterable[str] = MAXIMISED) -> pd.DataFrame:
    """The non-dominated rows of `df` on (x, y), sorted by x; with a `label` column.

    Rows without a finite positive-or-zero value of x or y (failed or pruned trials) are
    ignored. Metrics named in `maximize` are maximised instead of minimised.
    """
    x, y = resolve_axes(phase, x, y)
    for col in (x, y):
        if col not in df.columns:
            accepted = sorted(c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]))
            raise ConfigError("metric", col, f"a metric column of the study {accepted}")
    points = df[np.isfinite(pd.to_numeric(df[x], errors="coerce"))
                & np.isfinite(pd.to_numeric(df[y], errors="coerce"))]
    if points.empty:
        return points.assign(label=pd.Series(dtype=str))
    sign_x = -1.0 if x in tuple(maximize) else 1.0
    sign_y = -1.0 if y in tuple(maximize) else 1.0
    mask = non_dominated_mask(sign_x * points[x].to_numpy(float), sign_y * points[y].to_numpy(float))
    front = points[mask].copy()
    sort_cols = [x, y] + (["number"] if "number" in front.columns else [])
    front = front.sort_values(sort_cols, ascending=[sign_x > 0, sign_y > 0] + [True] * (len(sort_cols) - 2))
    front["label"] = [point_label(row, phase) for _, row in front.iterrows()]
    return front.reset_index(drop=True)


def hypervolume(points: Iterable[Sequence[float]], reference: Sequence[float]) -> float:
    """Area dominated by `points` and bounded by `reference` (2-D, both minimised).

    Points that do not strictly dominate the reference add nothing. A plain sweep over the
    non-dominated points sorted by x: each adds the strip between it and the next point's x.
    """
    pts = np.asarray(list(points), dtype=float).reshape(-1, 2)
    ref_x, ref_y = float(reference[0]), float(reference[1])
    pts = pts[(pts[:, 0] < ref_x) & (pts[:, 1] < ref_y)]
    if len(pts) == 0:
        return 0.0
    front = pts[non_dominated_mask(pts[:, 0], pts[:, 1])]
    front = np.unique(front, axis=0)                # sorted by x ascending; y then descends
    next_x = np.append(front[1:, 0], ref_x)
    return float(np.sum((next_x - front[:, 0]) * (ref_y - front[:, 1])))


def default_reference(df: pd.DataFrame, x: str, y: str, margin: float = 1.1) -> tuple[float, float]:
    """`margin` times the worst finished value on each axis (documented CLI default)."""
    xs = pd.to_numeric(df[x], errors="coerce")
    ys = pd.to_numeric(df[y], errors="coerce")
    ok = np.isfinite(xs) & np.isfinite(ys)
    return float(xs[ok].max() * margin), float(ys[ok].max() * margin)


@dataclass
class ParetoResult:
    """A frontier with its axes, reference and hypervolume: what the CLI prints."""

    phase: str
    x: str
    y: str
    front: pd.DataFrame
    n_points: int
    reference: tuple[float, float]
    hypervolume: float
    sources: list[str] = field(default_factory=list)

    def table(self) -> pd.DataFrame:
        ffn, attn = layout_columns(self.phase)
        cols = [c for c in LABEL_COLUMNS + (ffn, attn) if c in self.front.columns]
        return self.front[cols + [self.x, self.y, "label"]]

    def to_dict(self) -> dict:
        rows = self.table().to_dict(orient="records")
        return {
            "phase": self.phase, "x": self.x, "y": self.y, "n_points": self.n_points,
            "n_front": len(self.front), "reference": [_plain(v) for v in self.reference],
            "hypervolume": _plain(self.hypervolume), "sources": self.sources,
            "front": [{k: _plain(v) for k, v in row.items()} for row in rows],
        }


def _plain(value):
    """JSON-ready: numpy scalars to Python, NaN to None."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def finished(df: pd.DataFrame) -> pd.DataFrame:
    """Complete trials only (failed/pruned trials are data, but not frontier points)."""
    if "state" in df.columns:
        df = df[df["state"].astype(str).str.upper().str.endswith("COMPLETE")
                | df["state"].astype(str).str.upper().str.endswith("FINISHED")]
    return df


def analyse(df: pd.DataFrame, phase: str = "decode", x: str | None = None, y: str | None = None,
            reference: Sequence[float] | None = None) -> ParetoResult:
    """Frontier + hypervolume of the finished trials of one phase."""
    x, y = resolve_axes(phase, x, y)
    done = finished(df)
    front = pareto_front(done, x, y, phase)
    n_points = int((np.isfinite(pd.to_numeric(done.get(x), errors="coerce"))
                    & np.isfinite(pd.to_numeric(done.get(y), errors="coerce"))).sum()) if len(done) else 0
    if n_points == 0:
        return ParetoResult(phase, x, y, front, 0, (math.nan, math.nan), 0.0, [])
    ref = tuple(reference) if reference is not None else default_reference(done, x, y)
    signs = np.array([-1.0 if x in MAXIMISED else 1.0, -1.0 if y in MAXIMISED else 1.0])
    pts = front[[x, y]].to_numpy(float) * signs
    hv = hypervolume(pts, np.asarray(ref) * signs) if not (signs < 0).any() else math.nan
    sources = sorted(str(s) for s in done["source"].dropna().unique()) if "source" in done else []
    return ParetoResult(phase, x, y, front, n_points, ref, hv, sources)


# ----------------------------------------------------------------------------- reading a study


def mlflow_parent_run(study_name: str, tracking_uri: str) -> str:
    """The parent run of the sweep whose tag `study` is this name (newest if several)."""
    from mlflow.tracking import MlflowClient   # lazy: MLflow (~1 s) only when a store is read

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.study = '{study_name}' and "
                              f"tags.`{KIND_TAG}` = '{SWEEP_KIND}'",
                              order_by=["attributes.start_time DESC"], max_results=1) if experiments else []
    if not runs:
        raise ConfigError("--study", study_name, f"a sweep with MLflow runs in {tracking_uri}")
    return runs[0].info.run_id


def load_points(study_name: str, source: str = "optuna", storage: str | None = None,
                tracking_uri: str | None = None) -> pd.DataFrame:
    """A study's trials from Optuna storage or from its MLflow runs (same columns)."""
    if source == "optuna":
        return results.load_trials(study_name, storage or default_storage(create=False))
    if source == "mlflow":
        uri = tracking_uri or default_tracking_uri(create=False)
        return results.load_runs(uri, parent_run_id=mlflow_parent_run(study_name, uri))
    raise ConfigError("--source", source, "optuna or mlflow")
