"""Readable terminal output shared by the commands: human units and aligned tables.

Plain text only (no colour, no terminal-width tricks) so the output pastes cleanly into
issues and READMEs. `--json` output never goes through here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Sequence

_DECIMAL = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
_BINARY = [(2**50, "Pi"), (2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def human_bytes(value: Any, binary: bool = True, digits: int = 3) -> str:
    """12884901888 -> '12.0 GiB' (binary=False: '12.9 GB')."""
    if not _finite(value):
        return "-"
    for scale, prefix in (_BINARY if binary else _DECIMAL):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}B"
    return f"{value:.{digits}g} B"


def human_seconds(value: Any, digits: int = 3) -> str:
    """0.00254 -> '2.54 ms'; 3725 -> '1.03 h'."""
    if not _finite(value):
        return "-"
    magnitude = abs(value)
    if magnitude == 0:
        return "0 s"
    if magnitude < 1e-6:
        return f"{value * 1e9:.{digits}g} ns"
    if magnitude < 1e-3:
        return f"{value * 1e6:.{digits}g} µs"
    if magnitude < 1:
        return f"{value * 1e3:.{digits}g} ms"
    if magnitude < 120:
        return f"{value:.{digits}g} s"
    if magnitude < 7200:
        return f"{value / 60:.{digits}g} min"
    return f"{value / 3600:.{digits}g} h"


def percent(value: Any, digits: int = 1, missing: str = "-") -> str:
    return f"{value * 100:.{digits}f}%" if _finite(value) else missing


def format_value(value: Any) -> str:
    """Default cell text: short floats, 'yes'/'no' for booleans, XxYxZ for 3-tuples of ints."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, int) for v in value):
        return "x".join(str(v) for v in value)
    return str(value)


def _is_numeric_text(text: str) -> bool:
    head = text.split(" ")[0].rstrip("%")
    try:
        float(head)
        return True
    except ValueError:
        return False


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 headers: Mapping[str, str] | None = None, title: str | None = None,
                 formats: Mapping[str, Callable[[Any], str]] | None = None) -> str:
    """Rows of dicts -> an aligned text table. Numbers right-aligned, text left-aligned.

    columns: which keys, in order (default: the first row's keys); headers: display names;
    formats: per-column formatter (default format_value)."""
    columns = list(columns if columns is not None else (rows[0].keys() if rows else []))
    headers = dict(headers or {})
    formats = dict(formats or {})
    cells = [[formats.get(c, format_value)(row.get(c)) for c in columns] for row in rows]
    names = [headers.get(c, c) for c in columns]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    right = [bool(cells) and all(_is_numeric_text(r[i]) or r[i] == "-" for r in cells)
             for i in range(len(columns))]

    def line(values: Iterable[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return "  ".join(parts).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(names))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def format_fields(items: Mapping[str, Any] | Sequence[tuple[str, Any]], title: str | None = None) -> str:
    """Label/value pairs, one per line, labels aligned: for a single result."""
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    width = max((len(k) for k, _ in pairs), default=0)
    out = [title] if title else []
    out.extend(f"  {k.ljust(width)}  {v if isinstance(v, str) else format_value(v)}" for k, v in pairs)
    return "\n".join(out)


def metric_text(metric: str, value: float) -> str:
    """Seconds as s/ms/us, bytes as GiB/MiB/KiB, the rest with 4 significant digits."""
    if metric.endswith("_s") or "_s_" in metric:
        if abs(value) >= 1:
            return f"{value:.3g}s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.3g}ms"
        return f"{value * 1e6:.3g}us"
    if metric.endswith("_bytes_per_chip"):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.3g}{unit}"
        return f"{value:.0f}B"
    return f"{value:.4g}"


def one_line(err: BaseException) -> str:
    """An exception as one line (type and message), for logs and one-line error reports."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:2000]


def jsonable(obj: Any) -> Any:
    """Plain JSON values: NaN/inf become null, numpy scalars become Python numbers
    (numpy registers its scalar types with the `numbers` ABCs: no numpy import here)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, bool) or not isinstance(obj, numbers.Real):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    return None if not math.isfinite(float(obj)) else float(obj)


def percent_dash(value: Any) -> str:
    """Percent with one decimal for reports and fit tables; an em dash when missing."""
    return percent(value, missing="—")


def short_number(value: Any) -> str:
    """Four significant digits for report cells; an em dash for None / NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def fixed_bytes(value: float) -> str:
    """Bytes with two decimals in the largest binary unit (`1.50 GiB`); '-' when missing."""
    if not math.isfinite(value):
        return "-"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"
