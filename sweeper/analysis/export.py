"""`sweeper export`: a study's whole trial table as a file (the columns of `results.load_trials`).

CSV for anything; Parquet keeps the column types (nullable integers, floats, strings)
and needs pyarrow, which MLflow already depends on.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pandas as pd

from workloads.config import ConfigError
from workloads.validate import one_of

FORMATS = ("csv", "parquet")
STDOUT = "-"


def default_path(study: str, fmt: str) -> str:
    return f"{study}.{fmt}"


def table_bytes(df: pd.DataFrame, fmt: str) -> bytes:
    """The table encoded as CSV (UTF-8, no index) or Parquet."""
    one_of("--format", fmt, FORMATS)
    if fmt == "csv":
        return df.to_csv(index=False).encode()
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401   # lazy: only Parquet needs it (an MLflow dependency)
        except ImportError:
            raise ConfigError("--format", fmt, "csv (Parquet needs pyarrow: pip install pyarrow)") from None
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def write_table(df: pd.DataFrame, fmt: str, out: str) -> str | None:
    """Write to `out` (a path, or `-` for stdout: CSV only); the path written, None for stdout."""
    if out == STDOUT and fmt != "csv":
        raise ConfigError("--out", out, "a file path (Parquet is binary: stdout takes csv only)")
    data = table_bytes(df, fmt)
    if out == STDOUT:
        sys.stdout.write(data.decode())
        return None
    path = Path(out)
    if path.parent and not path.parent.is_dir():
        raise ConfigError("--out", out, "a path in an existing folder")
    try:
        path.write_bytes(data)
    except OSError as err:     # /dev/full, a full disk, a folder or read-only file at --out
        raise ConfigError("--out", out, f"a file that can be written ({err.strerror or err}; "
                          "the study is unchanged)") from None
    return str(path)
