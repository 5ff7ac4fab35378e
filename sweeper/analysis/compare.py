"""Two studies side by side (`sweeper compare A B`): did my change help?

Per phase (axes as in sweeper/analysis/pareto.py):

- the two Pareto frontiers overlaid on one figure;
- the hypervolume of each against ONE reference point, 1.1 x the worst finished value on
  each axis over both studies together (two hypervolumes with different references are
  not comparable), and B - A (positive: B's frontier dominates more);
- per layout (the phase's `ffn/attn`), the median latency of the finished trials of each
  study and the relative change B / A - 1 (negative: B is faster). The median is over
  whatever shapes each study ran: compare studies of the same space for a like-for-like
  answer (`n` columns say how many trials each median has).

Measured and analytical studies are never compared (docs/architecture.md, "Honest labels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sweeper.analysis import pareto, plots
from workloads.config import ConfigError

REFERENCE_MARGIN = 1.1


@dataclass
class PhaseComparison:
    phase: str
    x: str
    y: str
    reference: tuple[float, float]
    a: pareto.ParetoResult
    b: pareto.ParetoResult
    layouts: pd.DataFrame    # layout, n_a, median_a, n_b, median_b, change

    @property
    def hypervolume_change(self) -> float:
        return self.b.hypervolume - self.a.hypervolume

    def to_dict(self) -> dict:
        return {"phase": self.phase, "x": self.x, "y": self.y,
                "reference": [pareto._plain(v) for v in self.reference],
                "hypervolume_a": pareto._plain(self.a.hypervolume),
                "hypervolume_b": pareto._plain(self.b.hypervolume),
                "hypervolume_change": pareto._plain(self.hypervolume_change),
                "front_a": len(self.a.front), "front_b": len(self.b.front),
                "points_a": self.a.n_points, "points_b": self.b.n_points,
                "layouts": [{k: pareto._plain(v) for k, v in row.items()}
                            for row in self.layouts.to_dict(orient="records")]}


@dataclass
class Comparison:
    study_a: str
    study_b: str
    source_label: str
    phases: dict[str, PhaseComparison] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"study_a": self.study_a, "study_b": self.study_b, "source": self.source_label,
                "phases": {p: c.to_dict() for p, c in self.phases.items()}}


def _sources(df: pd.DataFrame) -> set[str]:
    return {str(s) for s in pareto.finished(df)["source"].dropna().unique()} if "source" in df else set()


def shared_reference(a: pd.DataFrame, b: pd.DataFrame, x: str, y: str) -> tuple[float, float]:
    both = pd.concat([pareto.finished(a), pareto.finished(b)], ignore_index=True)
    return pareto.default_reference(both, x, y, REFERENCE_MARGIN)


def layout_medians(a: pd.DataFrame, b: pd.DataFrame, phase: str, metric: str) -> pd.DataFrame:
    """Median `metric` per layout of the phase in each study, and B / A - 1."""
    def medians(df: pd.DataFrame) -> pd.DataFrame:
        done = pareto.finished(df)
        values = pd.to_numeric(done[metric], errors="coerce") if metric in done else pd.Series(dtype=float)
        done = done.assign(layout=[pareto.layout_label(r, phase) for _, r in done.iterrows()],
                           value=values)
        done = done[np.isfinite(done["value"].to_numpy(float))]
        return done.groupby("layout")["value"].agg(["size", "median"])

    ma, mb = medians(a), medians(b)
    table = ma.merge(mb, how="outer", left_index=True, right_index=True,
                     suffixes=("_a", "_b")).rename_axis("layout").reset_index()
    table = table.rename(columns={"size_a": "n_a", "size_b": "n_b"})
    for col in ("n_a", "n_b"):
        table[col] = table[col].fillna(0).astype(int)
    table["change"] = table["median_b"] / table["median_a"] - 1.0
    return table[["layout", "n_a", "median_a", "n_b", "median_b", "change"]]


def compare(a: pd.DataFrame, b: pd.DataFrame, study_a: str, study_b: str) -> Comparison:
    """Frontiers, hypervolumes (one reference per phase) and layout medians of two studies."""
    src_a, src_b = _sources(a), _sources(b)
    if src_a and src_b and src_a != src_b:
        raise ConfigError("STUDY_B", study_b, f"a study with the same source as {study_a} "
                          f"({', '.join(sorted(src_a))}; {study_b} is {', '.join(sorted(src_b))}): "
                          "measured and analytical numbers are never compared")
    result = Comparison(study_a, study_b, plots.source_label_of(a))
    for phase in pareto.PHASES:
        x, y = pareto.resolve_axes(phase)
        if not len(plots._finite(pareto.finished(a), x, y)) or not len(plots._finite(pareto.finished(b), x, y)):
            continue      # a phase one study has no finished point of cannot be compared
        reference = shared_reference(a, b, x, y)
        result.phases[phase] = PhaseComparison(
            phase, x, y, reference, pareto.analyse(a, phase, x, y, reference),
            pareto.analyse(b, phase, x, y, reference), layout_medians(a, b, phase, x))
    if not result.phases:
        raise ConfigError("STUDY_A/STUDY_B", f"{study_a}, {study_b}", "two studies with finished "
                          "trials in the same phase")
    return result


def overlay_figure(phase: PhaseComparison, a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str],
                   source_label: str):
    """Both studies' finished points (faint) and frontiers (steps), log-log."""
    fig = plots._figure(6.4, 4.6)
    ax = fig.add_subplot()
    for df, res, name, colour, marker in ((a, phase.a, names[0], "tab:blue", "o"),
                                          (b, phase.b, names[1], "tab:orange", "s")):
        front = res.front
        pts = plots._finite(pareto.finished(df), phase.x, phase.y)
        ax.scatter(pts[phase.x], pts[phase.y], s=14, alpha=0.25, color=colour, marker=marker)
        if len(front):
            ax.step(front[phase.x], front[phase.y], where="post", color=colour, lw=1.6,
                    marker=marker, ms=5, label=f"{name}: {len(front)} on frontier, "
                    f"hypervolume {res.hypervolume:.3g}")
    ax.scatter([phase.reference[0]], [phase.reference[1]], marker="x", color="grey",
               label="hypervolume reference (shared)")
    plots._log(ax)
    ax.set_xlabel(f"{phase.x} — {source_label}")
    ax.set_ylabel(phase.y)
    ax.set_title(f"{plots.PHASE_TITLES[phase.phase]}: {names[0]} vs {names[1]}")
    ax.legend(fontsize=8)
    return fig


def write_figures(result: Comparison, a: pd.DataFrame, b: pd.DataFrame, out_dir) -> dict[str, str]:
    """`compare-<phase>.png` per phase in out_dir; phase -> path."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for phase, comp in result.phases.items():
        path = out / f"compare-{phase}.png"
        path.write_bytes(plots.png_bytes(overlay_figure(comp, a, b, (result.study_a, result.study_b),
                                                        result.source_label)))
        paths[phase] = str(path)
    return paths


def hypervolume_text(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else "—"
