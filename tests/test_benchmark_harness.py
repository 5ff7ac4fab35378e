"""The benchmarks' one harness (benchmarks/harness.py: run -> analyse -> render; issue 37):
every committed results file renders again to its committed Markdown without measuring,
bulky raw logs live beside a results file small enough to read and come back whole, and the
benchmark code keeps its house rules (no function over ~150 lines, no issue numbers in names)."""

from __future__ import annotations

import ast
import gzip
import importlib
import json
import re
from pathlib import Path

import pytest

from benchmarks import common, harness

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("calibration", "collectives", "engine_efficiency", "examples", "paper_fit",
              "plan_speed", "profile_predict", "search_efficiency", "serving_validation",
              "sweep_overhead", "world")
# every committed results file: (benchmark, folder)
COMMITTED = [(name, common.RESULTS) for name in BENCHMARKS] + [
    ("engine_efficiency", common.RESULTS / "second-host"),
    ("engine_efficiency", common.RESULTS / "second-host" / "run2"),
    ("serving_validation", common.RESULTS / "second-host"),
    ("idle_wake", common.RESULTS / "xeon-host")]


def _bench(name: str) -> harness.Benchmark:
    return importlib.import_module(f"benchmarks.{name}").BENCHMARK


@pytest.mark.parametrize("name, folder", COMMITTED,
                         ids=[f"{n}@{f.relative_to(common.RESULTS)}" for n, f in COMMITTED])
def test_every_committed_results_file_renders_to_its_committed_markdown(name, folder):
    """`python -m benchmarks.NAME --render` measures nothing and must reproduce every figure
    of the committed Markdown from the committed JSON (here: the whole text)."""
    bench = _bench(name)
    assert bench.name == name
    result = harness.load(name, folder, bench.raw_keys)
    assert result is not None, f"no {name}.json in {folder}"
    assert harness.markdown(name, result) == (folder / f"{name}.md").read_text()


def test_render_only_writes_the_markdown_and_nothing_else(tmp_path):
    for f in ("plan_speed.json", "plan_speed.md"):
        (tmp_path / f).write_text((common.RESULTS / f).read_text())
    (tmp_path / "plan_speed.md").write_text("stale\n")
    before = (tmp_path / "plan_speed.json").read_text()
    assert harness.main(_bench("plan_speed"), ["--render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "plan_speed.md").read_text() == (common.RESULTS / "plan_speed.md").read_text()
    assert (tmp_path / "plan_speed.json").read_text() == before
    assert harness.main(_bench("plan_speed"), ["--render", "--out", str(tmp_path / "none")]) == 2


def test_raw_logs_go_beside_the_results_and_come_back_whole(tmp_path):
    """Entries under a raw key that are logs (dicts or lists) go to NAME.raw.json.gz; a count
    named alike stays; loading puts every log back; the same logs give the same bytes."""
    result = {"runs": [{"rows": [{"calls": {"w0": [[1, 2], [3, 4]]}, "host_costs": {
        "step_s": 0.001, "detail": {"blocks": [0.1, 0.2]}}}],
        "durations": [{"kinds": {"decode_step": {"calls": 12}}}]}]}
    files = harness.write_json("x", result, tmp_path, ("calls", "detail"))
    assert [f.name for f in files] == ["x.json", "x.raw.json.gz"]
    stored = json.loads(files[0].read_text())
    row = stored["runs"][0]["rows"][0]
    assert set(row["calls"]) == {"raw"} and set(row["host_costs"]["detail"]) == {"raw"}
    assert stored["runs"][0]["durations"][0]["kinds"]["decode_step"]["calls"] == 12
    assert harness.load("x", tmp_path, ("calls", "detail")) == result
    first = files[1].read_bytes()
    harness.write_json("x", result, tmp_path, ("calls", "detail"))
    assert files[1].read_bytes() == first
    with gzip.open(files[1]) as f:
        assert len(json.loads(f.read())) == 2


def test_the_serving_validation_results_are_small_enough_to_read():
    """The per-request call logs and closed-loop blocks (7.4 MB of the JSON before) are in
    the compressed raw file; the results file keeps the figures and the analysis."""
    path = common.RESULTS / "serving_validation.json"
    assert path.stat().st_size < 1_000_000
    data = json.loads(path.read_text())
    row = data["runs"][0]["rows"][0]
    assert set(row["calls"]) == {"raw"} and "durations" in data["runs"][0]
    assert (common.RESULTS / "serving_validation.raw.json.gz").is_file()


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_in_benchmarks_is_over_150_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for path in (ROOT / "benchmarks").rglob("*.py") for node in _functions(path)
            if node.end_lineno - node.lineno + 1 > 150]
    assert long == []


def test_no_issue_numbers_in_the_benchmarks_names():
    """Names say what things are (`sweep_verdicts`, not `issue22_targets`): in the code and
    in the results files' keys."""
    pattern = re.compile(r"issue_?\d+", re.I)
    names = []
    for path in (ROOT / "benchmarks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "name", None) or getattr(node, "id", None) or getattr(node, "attr", None)
            if isinstance(name, str) and pattern.search(name):
                names.append(f"{path.relative_to(ROOT)}: {name}")

    def keys(value, where):
        if isinstance(value, dict):
            for k, v in value.items():
                if pattern.search(str(k)):
                    names.append(f"{where}: key {k}")
                keys(v, where)
        elif isinstance(value, list):
            for v in value:
                keys(v, where)

    for path in common.RESULTS.rglob("*.json"):
        keys(json.loads(path.read_text()), str(path.relative_to(ROOT)))
    assert names == []


def test_each_benchmark_is_its_measurement_and_its_targets():
    """A benchmark module declares its harness entry and no Markdown of its own: the
    Markdown is its render module's (benchmarks/render/<name>.py)."""
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        assert isinstance(module.BENCHMARK, harness.Benchmark)
        assert not hasattr(module, "markdown") and not hasattr(module, "render")
        assert callable(importlib.import_module(f"benchmarks.render.{name}").markdown)
