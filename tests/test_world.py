"""Published serving measurements (benchmarks/data/published-serving.csv), their columns
(workloads/measurements.py), the fit across a family's chips (sweeper/analysis/external.py)
and the benchmark that scores the presets and writes the fitted ones (benchmarks/world.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from benchmarks import world
from sweeper.analysis import external
from sweeper.analysis.observations import predict_latency
from workloads.config import (HARDWARE_PRESETS, WORLD_CALIBRATION, WORLD_PRESETS_FILE, ConfigError,
                              load_hardware)
from workloads.measurements import (NEEDS, load_measurements, predict_point,
                                    published_from_latency)

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "benchmarks" / "data" / "published-serving.csv"
HEADER = ("source_id,model,hardware,tp,pp,chips,precision,framework,batch,input_len,output_len,"
          "metric,value,unit,from_figure,needs,source,url,note")
GOOD = dict(source_id="s", model="llama2-70b", hardware="a100-80g", tp="4", pp="1", chips="",
            precision="fp16", framework="an engine", batch="8", input_len="128", output_len="20",
            metric="e2e", value="250", unit="ms", from_figure="no", needs="", source="a table",
            url="https://example.org", note="")


def row(**changes) -> str:
    return ",".join({**GOOD, **changes}[c] for c in HEADER.split(","))


def write(tmp_path, *rows) -> Path:
    path = tmp_path / "serving.csv"
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


@pytest.fixture(scope="module")
def results():
    """(the results, the shipped presets): the harness's measure -> analyse."""
    raw = world.measure()
    return world.analyse(raw), raw["presets"]


def test_the_published_set_is_complete_and_from_several_sources():
    """Issue 38: >= 40 rows, >= 4 independent sources, >= 3 chips; every row names its
    configuration, its metric and where it is published."""
    rows = world.load_rows()
    assert len(rows) >= 40
    assert len({p.source_id for p in rows}) >= 4
    assert len({p.hardware for p in rows}) >= 3
    for p in load_measurements(SERVING):
        assert p.hardware and p.tp and p.precision and p.framework and p.output_len, p.row
        assert p.published_metric in ("ttft", "tpot", "e2e", "throughput"), p.row
        assert p.published_unit and p.published_value > 0 and p.url.startswith("https://"), p.row
        assert p.from_figure is not None and p.source, p.row


def test_each_row_is_the_latency_its_number_implies():
    """A row's latency turned back into its metric is the published number (round trip), and
    the conversions are the documented ones on one row of each metric."""
    points = load_measurements(SERVING)
    for p in points:
        assert published_from_latency(p, p.latency_s) == pytest.approx(p.published_value, rel=1e-12)
    tput = next(p for p in points if p.published_unit == "tok/s/chip" and p.tp == 4)
    assert tput.latency_s == pytest.approx(tput.batch * tput.output_len / (tput.published_value * 4))
    tpot = next(p for p in points if p.published_metric == "tpot")
    assert (tpot.phase, tpot.decode_steps) == ("decode", tpot.output_len - 1)
    assert tpot.latency_s == pytest.approx(tpot.published_value * (tpot.output_len - 1))
    ttft = next(p for p in points if p.published_metric == "ttft" and p.published_unit == "ms")
    assert (ttft.phase, ttft.latency_s) == ("prefill", pytest.approx(ttft.published_value / 1e3))


def test_tensor_parallel_rows_run_megatrons_layout_and_fp8_needs_a_missing_behaviour(tmp_path):
    path = write(tmp_path, row(), row(precision="fp8"), row(pp="2"), row(needs="chunked-prefill"))
    plain, fp8, pipelined, chunked = load_measurements(path)
    assert (plain.ffn, plain.attn, plain.topology, plain.chips, plain.weights) == \
        ("ws1d", "head", (1, 4, 1), 4, "bf16")
    assert plain.needs == () and fp8.weights == "int8" and fp8.needs == ("fp8",)
    assert pipelined.chips == 8 and pipelined.needs == ("pipeline-stages",)
    assert chunked.needs == ("chunked-prefill",)
    assert set(NEEDS) >= {"fp8", "chunked-prefill", "prefix-caching", "pipeline-stages"}


@pytest.mark.parametrize("bad,column,accepted", [
    (row(metric="latency"), "metric", "['ttft', 'tpot', 'e2e', 'throughput']"),
    (row(unit="tok/s"), "unit", "['s', 'ms']"),
    (row(metric="tpot", output_len=""), "output_len", "needed by metric tpot"),
    (row(value="-3"), "value", "a positive number"),
    (row(needs="warp-drive"), "needs", "'fp8'"),
    (row(hardware="h900"), "hardware", "preset"),
    (row(precision="fp4"), "precision", "'bf16'"),
    (row(tp="three"), "tp", "an integer >= 1"),
    (row(tp="3"), "ffn/attn", "a layout that runs this row"),
    (row(chips="8"), "chips", "tp x pp = 4"),
])
def test_a_bad_serving_row_is_one_line_naming_row_column_and_accepted(tmp_path, bad, column, accepted):
    path = write(tmp_path, row(), bad)
    with pytest.raises(ConfigError) as err:
        load_measurements(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: row 3, column {column}: got "), message
    assert accepted in message, message


def test_a_row_measured_on_another_chip_is_that_chips_sheet_in_the_fit():
    """Observation.scale per rate: an A100 row predicted with the H100 sheet and the A100/H100
    sheet ratios is the A100 sheet's prediction (the fixed costs are 0 on a sheet)."""
    points = [p for p in load_measurements(SERVING) if p.hardware == "a100-80g"][:5]
    sheets = {"a100-80g": load_hardware("a100-80g"), "h100": load_hardware("h100")}
    for p in points:
        obs = external.world_observation(p, sheets, sheets["h100"])
        assert obs.scale == external.sheet_ratios(sheets["a100-80g"], sheets["h100"])
        assert predict_latency(obs, sheets["h100"]) == pytest.approx(predict_point(p, sheets["a100-80g"]))


def test_a_held_out_source_never_trains_its_own_prediction():
    rows = world.load_rows()
    for source in {p.source_id for p in rows}:
        for chip in {p.hardware for p in rows if p.source_id == source}:
            train, what = external.training_rows(rows, source, chip)
            assert train and all(p.source_id != source and not p.needs for p in train)
            if what.startswith("every"):
                assert not [p for p in rows if p.source_id != source and not p.needs
                            and external.family(p.hardware) == external.family(chip)]


def test_the_results_and_the_shipped_presets_are_what_the_benchmark_computes(results):
    """The committed results file and workloads/presets/world.yaml come from this code."""
    data, presets = results
    committed = json.loads((ROOT / "benchmarks" / "results" / "world.json").read_text())
    for key in ("targets", "by_metric", "by_hardware_metric", "physical", "presets"):
        assert_close(committed[key], json.loads(json.dumps(data[key])), key)
    assert_close(yaml.safe_load(WORLD_PRESETS_FILE.read_text()),
                 yaml.safe_load(world.presets_yaml(presets)), "presets")


def assert_close(a, b, where: str) -> None:
    """Equal, floats to 1e-6 (a fit's last digits may differ between BLAS builds)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-12), where
    else:
        assert a == b, where


def test_fitted_presets_stay_under_their_datasheet_and_carry_residuals(results):
    data, presets = results
    assert data["physical"]["met"]
    for name, entry in presets.items():
        shipped, sheet = HARDWARE_PRESETS[name], HARDWARE_PRESETS[entry["datasheet"]]
        for rate in world.RATES:
            assert getattr(shipped, rate) <= getattr(sheet, rate)
        assert sum(map(len, shipped.heldout_residuals.values())) == WORLD_CALIBRATION[name]["points"]
        assert shipped.price_per_chip_hour == sheet.price_per_chip_hour
        assert WORLD_CALIBRATION[name]["sources"] == entry["sources"]


def test_rows_needing_a_missing_behaviour_are_scored_apart_and_never_fitted(results):
    data, _ = results
    flagged = [r for r in data["rows"] if r["needs"]]
    assert flagged and all("fp8" in r["needs"] for r in flagged)
    assert all(not s["needs_missing_behaviour"] for s in data["by_metric"] if s["metric"] in data["targets"]
               and data["targets"][s["metric"]]["n"] == s["n"])
    rows = world.load_rows()
    usable = [p for p in rows if not p.needs]
    sheets = {c: load_hardware(c) for c in {p.hardware for p in rows}}
    fitted = external.fit_world(rows, sheets["h100"], sheets).profile
    assert fitted == external.fit_world(usable, sheets["h100"], sheets).profile


def test_the_measurements_fit_keeps_only_its_chips_rows(tmp_path):
    from sweeper.analysis.fit import CalibrationError

    mixed = write(tmp_path, row(), row(hardware="h100"), row(precision="fp8"))
    kept = external.observations_of(mixed, load_hardware("a100-80g"))
    assert len(kept) == 1
    assert len(external.observations_of(mixed, load_hardware("a100-80g-world"))) == 1
    with pytest.raises(CalibrationError, match="rows measured on tpu-v5e"):
        external.observations_of(mixed, load_hardware("tpu-v5e"))
    data = yaml.safe_load(WORLD_PRESETS_FILE.read_text())
    assert set(data) == set(WORLD_CALIBRATION)
    assert dataclasses.asdict(HARDWARE_PRESETS["a100-80g-world"])["name"] == "a100-80g-world"


def test_the_docs_block_is_the_results_up_to_every_row():
    from benchmarks import readme_numbers
    from benchmarks.render import world as shown

    results = ROOT / "benchmarks" / "results"
    block = readme_numbers.BLOCKS["world"](results)
    assert "fitted, source held out" in block and shown.EVERY_ROW not in block
    assert (results / "world.md").read_text().startswith(block.rstrip())


def test_world_is_on_the_harness(results, tmp_path):
    """`python -m benchmarks.world` measures, analyses, writes world.{json,md} and the
    presets file it is told (`--presets`); `--render` gives the same Markdown again from the
    JSON (the committed files: tests/test_benchmark_harness.py)."""
    from benchmarks import harness
    from benchmarks.render import world as shown

    assert world.BENCHMARK.name == "world" and world.BENCHMARK.log
    data, presets = results
    raw = {"presets": presets}
    args = harness.parser_for(world.BENCHMARK).parse_args(
        ["--out", str(tmp_path), "--presets", str(tmp_path / "presets" / "world.yaml")])
    assert world.write_presets(raw, args) == [tmp_path / "presets" / "world.yaml"]
    assert (tmp_path / "presets" / "world.yaml").read_text() == world.presets_yaml(presets)
    harness.write("world", data, shown.markdown(data), tmp_path)
    first = (tmp_path / "world.md").read_text()
    (tmp_path / "world.md").write_text("stale\n")
    assert harness.main(world.BENCHMARK, ["--render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "world.md").read_text() == first
    metrics = world.metrics(data)
    assert set(metrics) >= {f"{m}_heldout_median" for m in world.TARGETS} | {"physical_met"}
