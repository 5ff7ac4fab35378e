"""Reading a user's CSV file (`sweeper fit --measurements`) with its limits checked first.

Before a row is parsed: the file exists and is at most MAX_BYTES; it is text (no NUL byte)
and UTF-8 (a UTF-8 byte-order mark, which spreadsheet programs write, is accepted and
dropped). While reading, rows are counted against MAX_ROWS, with a progress line on stderr
every PROGRESS_EVERY rows once a file is that long. Then the header (each column once) and
every cell of the numeric columns (a finite number: `inf`, `nan` and `1e999` are refused)
are checked. Every problem is a ConfigError: one line naming the file, the row (the file's
line number) and column, the value and what is accepted (the CLI prints it and exits 2).

Lines that are blank or start with `#` are comments; rows keep their line numbers.

    header, rows = read_csv(path, numeric={"latency_s", "mfu"})
    for line_number, row in rows: ...       # row: column -> stripped text
"""

from __future__ import annotations

import csv
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from workloads.config import ConfigError

MAX_BYTES = 64 * 2**20         # a measurements file is kilobytes; this is 1000x that
MAX_ROWS = 20_000             # published measurements are tens of rows; the fit is per row
PROGRESS_EVERY = 2_000         # rows between progress lines (only files this long print any)
BINARY_PROBE = 8192            # bytes looked at for a NUL byte


@dataclass(frozen=True)
class CsvLimits:
    max_bytes: int = MAX_BYTES
    max_rows: int = MAX_ROWS
    progress_every: int = PROGRESS_EVERY


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _text(path: Path, limits: CsvLimits, field: str) -> str:
    if not path.is_file():
        raise ConfigError(field, str(path), "an existing CSV file")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise ConfigError(field, str(path), f"a CSV file of at most {limits.max_bytes / 2**20:g} "
                          f"MiB (this one is {size / 2**20:.1f} MiB)")
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(field, str(path), "UTF-8 text (this file is UTF-16: save it as UTF-8)")
    nul = data.find(b"\0", 0, BINARY_PROBE)
    if nul >= 0:
        raise ConfigError(field, str(path), f"a text CSV file (a NUL byte at offset {nul}: "
                          "binary data)")
    try:
        return data.decode("utf-8-sig")      # drops a leading byte-order mark
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(field, str(path), f"UTF-8 text (byte 0x{data[err.start]:02x} at "
                          f"offset {err.start}, line {line}, is not UTF-8; save the file as "
                          "UTF-8)") from None


def _numbered(lines: Iterable[str], path: Path, limits: CsvLimits) -> Iterable[tuple[int, str]]:
    """(line number, line) of the header and data lines, counted against the row limit."""
    rows = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        rows += 1
        if rows - 1 > limits.max_rows:          # (the header is not a row)
            raise ConfigError("rows", f"more than {limits.max_rows}", f"at most "
                              f"{limits.max_rows} rows per file (split it)", str(path))
        yield number, line


def read_csv(path: str | Path, *, numeric: Iterable[str] = (), limits: CsvLimits = CsvLimits(),
             progress: Callable[[str], None] = _progress, field: str = "file"
             ) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """(header, [(line number, {column: text})]) of a checked CSV file; see the module doc."""
    path = Path(path)
    text = _text(path, limits, field)
    numbered = list(_numbered(io.StringIO(text, newline=""), path, limits))
    total = len(numbered) - 1
    if not numbered:
        raise ConfigError("header", None, "a header line naming the columns", str(path))
    reader = csv.reader(line for _, line in numbered)
    try:
        header = [name.strip() for name in next(reader)]
    except csv.Error as err:
        raise ConfigError("header", numbered[0][1].strip()[:200], f"a CSV header ({err})",
                          str(path)) from None
    seen: dict[str, int] = {}
    for index, name in enumerate(header, start=1):
        if name in seen:
            raise ConfigError("header", name, f"each column once ('{name}' is column "
                              f"{seen[name]} and column {index})", str(path))
        seen[name] = index
    numeric = set(numeric)
    rows: list[tuple[int, dict[str, str]]] = []
    for index, values in enumerate(_cells(reader, numbered, path), start=1):
        number = numbered[index][0]
        if len(values) != len(header):
            raise ConfigError(f"row {number}", ",".join(values)[:200], f"{len(header)} values "
                              f"(one per header column; it has {len(values)})", str(path))
        row = {name: value.strip() for name, value in zip(header, values)}
        for name in numeric & row.keys():
            _finite(row[name], number, name, path)
        rows.append((number, row))
        if total >= limits.progress_every and index % limits.progress_every == 0:
            progress(f"{path}: {index} of {total} rows checked")
    return header, rows


def _cells(reader, numbered, path: Path):
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            number = numbered[min(reader.line_num, len(numbered)) - 1][0]
            raise ConfigError(f"row {number}", numbered[reader.line_num - 1][1].strip()[:200],
                              f"a CSV row ({err})", str(path)) from None


def _finite(text: str, number: int, column: str, path: Path) -> None:
    if text == "":
        return                                   # (an optional cell left empty)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"row {number}, column {column}", text[:200], "a number",
                          str(path)) from None
    if not math.isfinite(value):
        raise ConfigError(f"row {number}, column {column}", text[:200], "a finite number "
                          "(inf and nan are not measurements)", str(path))
