"""The measurements CSV (benchmarks/data/paper-tpu-v4.csv and its format): every shipped row
loads and predicts; a bad row is one clear line naming file, row, column, value, accepted."""

import subprocess
import sys
from pathlib import Path

import pytest

from workloads.config import HARDWARE_PRESETS, ConfigError
from workloads.measurements import (COLUMNS, MeasuredPoint, load_measurements, predict_point,
                                    prediction_errors)

PAPER = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "paper-tpu-v4.csv"
TPU_V4 = HARDWARE_PRESETS["tpu-v4"]
HEADER = ",".join(COLUMNS)
GOOD_VALUES = dict(model="palm-540b", chips="64", batch="1", phase="prefill", input_len="2048",
                   ffn="ws2d", attn="head", weights="int8", source="paper", topology="4x4x4",
                   context="2048", decode_steps="", block="", pad_heads="64", latency_s="0.29", mfu="")
GOOD = ",".join(GOOD_VALUES[c] for c in COLUMNS)


def good(**changes) -> str:
    return ",".join({**GOOD_VALUES, **changes}[c] for c in COLUMNS)


def test_the_paper_file_loads_and_every_row_predicts():
    points = load_measurements(PAPER)
    assert len(points) >= 30
    sources = " ".join(p.source for p in points)
    for needed in ("Table 2", "Figure 7", "Figure 8", "Section 4.4", "Table D.3"):
        assert needed in sources, needed
    for p in points:
        assert isinstance(p, MeasuredPoint) and p.row > 1
        value = predict_point(p, TPU_V4)
        assert value > 0 and (p.metric == "latency_s" or value <= 1.0), (p.row, value)


def test_headline_rows_are_the_papers_configuration():
    points = load_measurements(PAPER)
    decode = next(p for p in points if p.source.startswith("Table 2 low-latency decode latency"))
    assert (decode.model, decode.chips, decode.batch, decode.ffn, decode.attn, decode.weights,
            decode.decode_steps, decode.latency_s) == ("palm-540b", 64, 64, "ws2d", "batch", "int8", 64, 1.82)
    errors = prediction_errors(points, TPU_V4)
    assert len(errors) == len(points)
    # peak numbers bound the latency from below for the headline decode (28.5 ms measured)
    row = next(e for e in errors if e["row"] == decode.row)
    assert row["predicted"] < row["measured"]


def test_figure_8_rows_run_the_8_layer_model_the_reference_names(tmp_path, monkeypatch):
    """Section 4.2: Figure 8 benchmarks "an 8-layer version of PaLM 540B on 64 chips with batch
    size 256"; its rows name the 8-layer YAMLs beside the CSV, found from any folder."""
    from workloads.measurements import point_model

    monkeypatch.chdir(tmp_path)
    points = [p for p in load_measurements(PAPER) if "Figure 8" in p.source]
    assert len(points) == 7
    for p in points:
        model = point_model(p)
        assert (model.n_layers, p.chips, p.batch, p.phase) == (8, 64, 256, "decode"), p.source
        assert model.d_model == 18432 and model.d_ff == 73728


def test_mfu_rows_count_the_unpadded_model():
    """Padding (pad_heads 64) costs the prediction MFU: the paper's convention."""
    points = load_measurements(PAPER)
    p = next(p for p in points if p.source.startswith("Table 2 high-throughput prefill MFU"))
    from dataclasses import replace
    assert predict_point(p, TPU_V4) < predict_point(replace(p, pad_heads="none"), TPU_V4)


def write(tmp_path, *rows, header=HEADER):
    path = tmp_path / "m.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_a_good_row_with_comments_keeps_its_line_number(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text(f"# a comment\n{HEADER}\n\n{GOOD}\n")
    (point,) = load_measurements(path)
    assert point.row == 4 and point.topology == (4, 4, 4) and point.pad_heads == 64


@pytest.mark.parametrize("row,column,accepted", [
    (good(model="palm-9000b"), "column model", "preset"),
    (good(chips="sixty"), "column chips", "an integer >= 1"),
    (good(phase="generate"), "column phase", "['prefill', 'decode', 'total']"),
    (good(ffn="ws3d"), "column ffn", "'wg'"),
    (good(attn="heads"), "column attn", "['head', 'batch']"),
    (good(weights="int4"), "column weights", "['bf16', 'int8', 'fp8']"),
    (good(topology="4x4x2"), "column topology", "chips=64"),
    (good(latency_s="-1"), "column latency_s", "a positive number"),
    (good(mfu="0.4"), "column mfu", "exactly one of latency_s and mfu"),
    (good(latency_s="", mfu="1.5"), "column mfu", "a fraction in (0, 1]"),
    (good(pad_heads="lots"), "column pad_heads", "auto, none"),
    (good(source=""), "column source", "where the number is published"),
    (good(pad_heads="none"), "column ffn/attn", "n_heads"),
    (good(batch="3", attn="batch"), "column ffn/attn", "batch"),
    (good(block="sequential"), "column block", "['parallel', 'serial']"),
])
def test_a_bad_row_is_one_line_naming_file_row_column_value(tmp_path, row, column, accepted):
    path = write(tmp_path, GOOD, row)
    with pytest.raises(ConfigError) as err:
        load_measurements(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row 3, {column}: got "), message
    assert accepted in message, message


@pytest.mark.parametrize("header,accepted", [
    (HEADER.replace("batch", "sequences"), "one of the columns"),
    (HEADER.replace(",source", ""), "a column 'source'"),
    (HEADER.replace(",latency_s,mfu", ""), "a latency_s or an mfu column"),
])
def test_a_bad_header_is_rejected(tmp_path, header, accepted):
    with pytest.raises(ConfigError, match="header") as err:
        load_measurements(write(tmp_path, header=header))
    assert accepted in str(err.value)


def test_a_row_with_too_many_values_and_an_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="row 2: got"):
        load_measurements(write(tmp_path, GOOD + ",extra"))
    with pytest.raises(ConfigError, match="at least one measurement row"):
        load_measurements(write(tmp_path))
    with pytest.raises(ConfigError, match="an existing CSV file"):
        load_measurements(tmp_path / "missing.csv")


def test_the_loader_error_is_one_line_from_a_subprocess(tmp_path):
    """As the CLI will see it: no traceback (the CLI maps ConfigError to exit 2)."""
    path = write(tmp_path, good(weights="int4"))
    code = ("import sys\nfrom workloads.config import ConfigError\nfrom workloads.measurements import "
            f"load_measurements\ntry:\n    load_measurements({str(path)!r})\nexcept ConfigError as e:\n"
            "    print(e, file=sys.stderr); sys.exit(2)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
