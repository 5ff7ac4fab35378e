"""Hostile CSV inputs (issue 23 item 6, workloads/csv_input.py): each is one ConfigError
line naming the file, row/column, value and what is accepted; nothing is a traceback."""

from __future__ import annotations

import pytest

from workloads.config import ConfigError
from workloads.csv_input import CsvLimits, read_csv

GOOD = "model,chips,latency_s\n# a comment\ntiny,4,0.5\n\ntiny,8,0.25\n"


def write(tmp_path, data, name="m.csv"):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def error(path, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        read_csv(path, numeric={"chips", "latency_s"}, **kwargs)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


def test_a_good_file_keeps_its_line_numbers(tmp_path):
    header, rows = read_csv(write(tmp_path, GOOD), numeric={"latency_s"})
    assert header == ["model", "chips", "latency_s"]
    assert rows == [(3, {"model": "tiny", "chips": "4", "latency_s": "0.5"}),
                    (5, {"model": "tiny", "chips": "8", "latency_s": "0.25"})]


def test_a_utf8_bom_header_is_accepted(tmp_path):
    header, rows = read_csv(write(tmp_path, b"\xef\xbb\xbf" + GOOD.encode()))
    assert header[0] == "model" and len(rows) == 2


def test_binary_and_non_utf8_files(tmp_path):
    assert "NUL byte" in error(write(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"))
    text = error(write(tmp_path, "model,chips\ncaf\xe9,4\n".encode("latin-1")))
    assert "UTF-8" in text and "0xe9" in text and "line 2" in text
    assert "UTF-8" in error(write(tmp_path, "model,chips\n".encode("utf-16")))


def test_a_duplicated_column_is_refused(tmp_path):
    text = error(write(tmp_path, "model,chips,latency_s,chips\ntiny,4,0.5,8\n"))
    assert "'chips' is column 2 and column 4" in text


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN", "1e999", "Infinity"])
def test_non_finite_numbers_are_refused(tmp_path, value):
    text = error(write(tmp_path, f"model,chips,latency_s\ntiny,4,0.5\ntiny,4,{value}\n"))
    assert "row 3, column latency_s" in text and "a finite number" in text


def test_a_cell_that_is_not_a_number_and_a_short_row(tmp_path):
    assert "row 2, column chips" in error(write(tmp_path, "model,chips\ntiny,four\n"))
    assert "2 values" in error(write(tmp_path, "model,chips\ntiny\n"))


def test_size_and_row_limits_are_checked_before_parsing(tmp_path, capsys):
    big = write(tmp_path, "model,chips\n" + "tiny,4\n" * 2000, "big.csv")
    assert "at most" in error(big, limits=CsvLimits(max_bytes=1000))
    text = error(big, limits=CsvLimits(max_rows=1500))
    assert "rows" in text and "at most 1500 rows" in text
    # long files print progress (on stderr), short ones do not
    lines = []
    read_csv(big, limits=CsvLimits(progress_every=500), progress=lines.append)
    assert lines == [f"{big}: {n} of 2000 rows checked" for n in (500, 1000, 1500, 2000)]
    lines.clear()
    read_csv(write(tmp_path, GOOD), limits=CsvLimits(progress_every=500), progress=lines.append)
    assert lines == []


def test_missing_and_empty_files(tmp_path):
    assert "an existing CSV file" in error(tmp_path / "nope.csv")
    with pytest.raises(ConfigError, match="header"):
        read_csv(write(tmp_path, "# only a comment\n\n"))


# ----------------------------------------------------------------------------- the CLI

PAPER = "benchmarks/data/paper-tpu-v4.csv"


def paper_rows(tmp_path, transform, name="paper.csv"):
    """The shipped measurements file, changed by `transform(text) -> bytes`."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / PAPER).read_text()
    return write(tmp_path, transform(text), name)


def fit(path, capsys) -> tuple[int, str]:
    from sweeper.cli import main

    code = main(["fit", "--measurements", str(path), "--hardware", "tpu-v4", "--json"])
    return code, capsys.readouterr().err.strip()


def _first_latency(text: str, value: str) -> str:
    lines = text.splitlines()
    header_at = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
    columns = lines[header_at].split(",")
    at = columns.index("latency_s")
    for i in range(header_at + 1, len(lines)):
        cells = lines[i].split(",")
        if len(cells) == len(columns) and cells[at]:
            cells[at] = value
            lines[i] = ",".join(cells)
            break
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("transform, expect", [
    (lambda t: b"\x00\x01binary" * 10, "NUL byte"),
    (lambda t: t.replace("model", "modèle", 1).encode("latin-1"), "UTF-8"),
    (lambda t: _first_latency(t, "inf").encode(), "a finite number"),
    (lambda t: _first_latency(t, "nan").encode(), "a finite number"),
    (lambda t: t.replace(",source", ",chips", 1).encode(), "each column once"),
])
def test_fit_measurements_hostile_files_are_one_line_exit_2(tmp_path, capsys, transform, expect):
    code, err = fit(paper_rows(tmp_path, transform), capsys)
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert "Traceback" not in err


def test_fit_measurements_accepts_a_utf8_bom(tmp_path, capsys):
    """The file with a BOM fits exactly as the file without (whatever the fit concludes)."""
    plain = fit(paper_rows(tmp_path, lambda t: t.encode(), "plain.csv"), capsys)
    bom = fit(paper_rows(tmp_path, lambda t: b"\xef\xbb\xbf" + t.encode(), "bom.csv"), capsys)
    assert "header" not in bom[1] and "ufeff" not in bom[1]
    assert bom[0] == plain[0] and bom[1].replace("bom.csv", "plain.csv") == plain[1]
