"""Figures of a sweep, in the style of the paper's Figures 1, 6 and 7, as PNG bytes.

Matplotlib's object API only (no pyplot): nothing global is switched, no display needed.
Every axis label says where its numbers come from (`source_label`: "measured on this host
(emulated mesh)" or "analytical (tpu-v4)"), so emulated timings are never read as TPU numbers.
"""

from __future__ import annotations

import io
import textwrap

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure

from sweeper.analysis import pareto

PHASE_TITLES = {"prefill": "prefill (prompt processing)", "decode": "decode (generation)"}
_MARKERS = "osD^v<>Pp*hX"


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _log(ax, x: bool = True, y: bool = True, base: int = 10) -> None:
    """Log axes labelled at 1-2-5 steps as plain numbers (no overlapping minor labels)."""
    for on, axis, setter in ((x, ax.xaxis, ax.set_xscale), (y, ax.yaxis, ax.set_yscale)):
        if not on:
            continue
        setter("log", base=base)
        if base == 10:
            axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(ticker.NullFormatter())


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG. A figure with a layout engine (every `_figure`: constrained) is
    already fitted to its size, so it is drawn once; "tight" cropping would draw it twice."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi,
                bbox_inches=None if fig.get_layout_engine() is not None else "tight")
    return buf.getvalue()


def _finite(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    ok = np.ones(len(df), dtype=bool)
    for col in cols:
        if col not in df.columns:
            return df.iloc[0:0]
        ok &= np.isfinite(pd.to_numeric(df[col], errors="coerce").to_numpy(float))
    return df[ok]


def _empty(ax, text: str = "no finished trials") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def source_label(source: str, hardware: str | None) -> str:
    """How a figure says where its numbers come from."""
    hardware = hardware or "host"
    if source == "analytical":
        return f"analytical (cost model, {hardware.split(':', 1)[-1]})"
    if hardware.startswith("devices"):
        return f"measured on this machine's devices ({hardware})"
    return "measured on this host (emulated mesh)"


def source_label_of(df: pd.DataFrame) -> str:
    """`source_label` from a study table's `source` and `hardware` columns."""
    def first(col, default):
        values = df[col].dropna() if col in df else []
        return str(values.iloc[0]) if len(values) else default
    return source_label(first("source", "measured"), first("hardware", "host"))


def _pareto_axes(ax, df: pd.DataFrame, phase: str, x: str, y: str, source_label: str) -> None:
    pts = _finite(pareto.finished(df), x, y)
    if pts.empty:
        _empty(ax)
        return
    layouts = pts.apply(lambda r: pareto.layout_label(r, phase), axis=1)
    for i, layout in enumerate(sorted(layouts.unique())):
        sel = pts[layouts == layout]
        ax.scatter(sel[x], sel[y], s=22, alpha=0.45, marker=_MARKERS[i % len(_MARKERS)],
                   label=layout)
    front = pareto.pareto_front(pts, x, y, phase=phase)
    ax.plot(front[x], front[y], "-", color="black", lw=1.5, label="Pareto frontier")
    ax.scatter(front[x], front[y], s=40, facecolors="none", edgecolors="black")
    for _, row in front.iterrows():
        ax.annotate(row["label"], (row[x], row[y]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    _log(ax, x=bool((pts[x] > 0).all()), y=bool((pts[y] > 0).all()))
    default_x, default_y = pareto.DEFAULT_AXES[phase]
    unit = "per generated token" if phase == "decode" else "of the whole prompt"
    ax.set_xlabel(f"{x} [s] — latency {unit}" if x == default_x else x)
    ax.set_ylabel(f"{y} [chip·s/token]" if y == default_y else y)
    ax.set_title(f"{PHASE_TITLES[phase]}\n{source_label}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def pareto_figure(df: pd.DataFrame, source_label: str) -> Figure:
    """Figure 1 style: cost vs latency, log-log, one panel per phase; frontier points labelled."""
    fig = _figure(12, 5)
    for ax, phase in zip(fig.subplots(1, 2), pareto.PHASES):
        x, y = pareto.resolve_axes(phase)
        _pareto_axes(ax, df, phase, x, y, source_label)
    fig.suptitle("Latency vs cost Pareto frontier (paper Fig. 1 style)")
    return fig


def pareto_phase_figure(df: pd.DataFrame, phase: str, x: str, y: str, source_label: str) -> Figure:
    """One phase, any two metrics (`sweeper pareto --png`)."""
    fig = _figure(7, 5)
    _pareto_axes(fig.subplots(1, 1), df, phase, x, y, source_label)
    return fig


def tokens_per_batch(df: pd.DataFrame, phase: str) -> pd.Series:
    """Tokens one forward pass processes: B*L for prefill, B for a decode step."""
    batch = pd.to_numeric(df["batch"], errors="coerce")
    if phase == "prefill":
        return batch * pd.to_numeric(df["input_len"], errors="coerce")
    return batch


def mfu_figure(df: pd.DataFrame, source_label: str) -> Figure:
    """Figure 7 style: MFU against tokens per batch, one line per FFN layout (best config each)."""
    fig = _figure(12, 4.5)
    axes = fig.subplots(1, 2)
    done = pareto.finished(df)
    for ax, phase in zip(axes, pareto.PHASES):
        mfu, ffn = f"{phase}_mfu", f"{phase}_ffn"
        pts = _finite(done, mfu, "batch")
        if pts.empty or ffn not in pts.columns:
            _empty(ax)
            continue
        pts = pts.assign(tokens=tokens_per_batch(pts, phase))
        for i, (layout, sel) in enumerate(sorted(pts.groupby(ffn), key=lambda kv: str(kv[0]))):
            best = sel.groupby("tokens")[mfu].max().sort_index()
            ax.plot(best.index, best.to_numpy() * 100, marker=_MARKERS[i % len(_MARKERS)],
                    label=str(layout))
        _log(ax, x=True, y=False, base=2)
        ax.set_xlabel("tokens per batch (B·L prefill, B decode)")
        ax.set_ylabel("MFU [%] (best over chips, attention layout, topology)")
        ax.set_title(f"{PHASE_TITLES[phase]}\n{source_label}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, title="FFN layout", title_fontsize=8)
    fig.suptitle("MFU vs tokens per batch per FFN layout (paper Fig. 7 style)")
    return fig


def chips_batch(df: pd.DataFrame) -> int | None:
    """The batch size covered by the most chip counts (ties: the largest): Figure 6 fixes B."""
    pts = _finite(df, "batch", "chips")
    if pts.empty:
        return None
    coverage = pts.groupby("batch")["chips"].nunique()
    best = coverage[coverage == coverage.max()]
    return int(max(best.index))


def latency_figure(df: pd.DataFrame, source_label: str) -> Figure:
    """Figure 6 style: latency against chip count per layout, at one batch size."""
    fig = _figure(12, 4.5)
    axes = fig.subplots(1, 2)
    done = pareto.finished(df)
    batch = chips_batch(done)
    for ax, phase in zip(axes, pareto.PHASES):
        x, _ = pareto.resolve_axes(phase)
        pts = _finite(done, x, "chips")
        if batch is None or pts.empty:
            _empty(ax)
            continue
        pts = pts[pd.to_numeric(pts["batch"]) == batch]
        layouts = pts.apply(lambda r: pareto.layout_label(r, phase), axis=1)
        for i, layout in enumerate(sorted(layouts.unique())):
            best = pts[layouts == layout].groupby("chips")[x].min().sort_index()
            ax.plot(best.index, best.to_numpy() * 1e3, marker=_MARKERS[i % len(_MARKERS)],
                    label=layout)
        _log(ax, x=True, y=False, base=2)
        _log(ax, x=False, y=True)
        ax.set_xlabel("chips")
        ax.set_ylabel(f"{x} [ms] (best over topology)")
        ax.set_title(f"{PHASE_TITLES[phase]}, batch {batch}\n{source_label}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, title="FFN/attention layout", title_fontsize=8)
    fig.suptitle("Latency vs chip count per layout (paper Fig. 6 style)")
    return fig


def predicted_vs_measured_figure(points: pd.DataFrame, title: str) -> Figure:
    """Held-out prediction against measurement, log-log, with y = x and a ±10% band.

    `points`: columns phase, layout, measured_s, predicted_s (one row per held-out point).
    """
    fig = _figure(11, 5.5)
    axes = fig.subplots(1, 2)
    for ax, phase in zip(axes, pareto.PHASES):
        sel = points[points["phase"] == phase] if len(points) else points
        sel = _finite(sel, "measured_s", "predicted_s")
        if sel.empty:
            _empty(ax, "no points")
            continue
        for i, (layout, grp) in enumerate(sorted(sel.groupby("layout"), key=lambda kv: str(kv[0]))):
            ax.scatter(grp["measured_s"] * 1e3, grp["predicted_s"] * 1e3, s=22, alpha=0.75,
                       marker=_MARKERS[i % len(_MARKERS)], label=str(layout))
        lo = min(sel["measured_s"].min(), sel["predicted_s"].min()) * 1e3 / 1.3
        hi = max(sel["measured_s"].max(), sel["predicted_s"].max()) * 1e3 * 1.3
        line = np.geomspace(lo, hi, 50)
        ax.plot(line, line, "k-", lw=1, label="predicted = measured")
        ax.fill_between(line, line / 1.1, line * 1.1, color="grey", alpha=0.15, label="±10%")
        _log(ax)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        unit = "decode_step_s" if phase == "decode" else "prefill_s"
        ax.set_xlabel(f"measured {unit} [ms]")
        ax.set_ylabel(f"held-out prediction of {unit} [ms] (fitted model)")
        ax.set_title(PHASE_TITLES[phase], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    return fig
