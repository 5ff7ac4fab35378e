"""Every figure with a unit in README.md and docs/*.md is generated, marked or code
(benchmarks/figures.py, run by `python -m benchmarks.readme_numbers --check` in `make test`;
issue 37): a figure planted in a copy of the pages fails the check, naming file and line;
every unit is caught, and code, markers, facts and shapes are not; each page stays a manual of
at most about 25 KB."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import common, figures, readme_numbers

ROOT = Path(__file__).resolve().parents[1]
PAGE_LIMIT_BYTES = 25 * 1024


def _copy_pages(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    for page in (ROOT / "docs").glob("*.md"):
        shutil.copy(page, root / "docs" / page.name)
    return root


def _check(root: Path) -> list[str]:
    problems: list[str] = []
    for path in readme_numbers.documents(root):
        where = str(path.relative_to(root))
        found = figures.bare_figures(path.read_text(), where, readme_numbers.BLOCK,
                                     readme_numbers.SPAN, readme=where == "README.md")
        if where not in figures.PENDING:
            problems += found
    return problems


def _flagged(text: str, where: str = "docs/x.md") -> list[str]:
    found = figures.bare_figures(text, where, readme_numbers.BLOCK, readme_numbers.SPAN,
                                 readme=where == "README.md")
    return [re.search(r"'([^']*)' is typed", line)[1] for line in found if "typed by hand" in line]


def test_a_figure_planted_in_a_copy_of_the_pages_fails_the_check(tmp_path, capsys):
    """The committed pages pass; the stale handover figure of issue 37, typed into a copy of
    docs/serving.md, fails `--check` with its file and line."""
    root = _copy_pages(tmp_path)
    argv = ["--results", str(common.RESULTS), "--root", str(root), "--check"]
    assert readme_numbers.main(argv) == 0, capsys.readouterr().err
    page = root / "docs" / "serving.md"
    lines = page.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("## Serving host costs")) + 2
    lines.insert(at, "A handover costs ~9-12 ms on this host.\n")
    page.write_text("".join(lines))
    capsys.readouterr()
    assert readme_numbers.main(argv) == 1
    err = capsys.readouterr().err
    assert f"docs/serving.md:{at + 1}: '~9-12 ms' is typed by hand" in err
    assert len([line for line in err.splitlines() if "is typed by hand" in line
                and not line.lstrip().startswith("pending")]) == 1


@pytest.mark.parametrize("sentence, figure", [
    ("p50 within target in 18/24 cases", "18/24"),
    ("an error of 6.5% here", "6.5%"),
    ("a drop of -29% at load", "-29%"),
    ("it took 27.5 s end to end", "27.5 s"),
    ("a step of 4.83 ms", "4.83 ms"),
    ("a handover of ~9-12 ms", "~9-12 ms"),
    ("about 208us a step", "208us"),
    ("one op in 71.9 µs", "71.9 µs"),
    ("decode at 2.91× its bound", "2.91×"),
    ("decode at 18x its bound", "18x"),
    ("a peak of 401 GFLOP/s", "401 GFLOP/s"),
    ("a peak of 275 TFLOP/s", "275 TFLOP/s"),
    ("read at 24.9 GB/s", "24.9 GB/s"),
    ("400 Gb/s per GPU", "400 Gb/s"),
    ("0.888 tok/s per chip", "0.888 tok/s"),
    ("at 100 req/s", "100 req/s"),
    ("requests at 40/s", "40/s"),
    ("weights of 503 GiB", "503 GiB"),
    ("a list price of $3.22 an hour", "$3.22"),
    ("a sweep of 18.7 minutes", "18.7 minutes"),
    ("| agg | 85% | 38.74 ms |", "85%"),
])
def test_every_unit_is_caught(sentence, figure):
    assert figure in _flagged(sentence + "\n")


def test_code_markers_facts_shapes_and_conventions_are_not_figures():
    text = "\n".join([
        "topology 2x2x1, a batch of 8 x 64 tokens, bf16×bf16 dots, PaLM 540B, Llama-2-70B,",
        "chips 1/2/4/8, a 95% CI and a 90% band, Python 3.11, paper §4.4, Table 2,",
        "`--ttft 0.05` and `a 30 s timeout` in code, [a link](results/x.md#a-1-5-s), p99,",
        "<!-- n:engine_efficiency:host_profile.peak_flops:gflops -->401 GFLOP/s<!-- /n -->,",
        "<!-- fact:paper §4.4 -->28.5 ms<!-- /fact --> per token, a bound of 1e-12 in the code,",
        "```", "decode 13.3 ms, MFU 29.8%, 3/20", "```",
        "<!-- generated:calibration -->", "| kfold | 6.6% |", "<!-- /generated:calibration -->",
    ])
    assert _flagged(text) == []


def test_a_fact_needs_its_source():
    found = figures.bare_figures("the paper's <!-- fact: -->28.5 ms<!-- /fact --> per token\n",
                                 "docs/x.md", readme_numbers.BLOCK, readme_numbers.SPAN)
    assert found and "a fact marker needs its source" in found[0]


def test_an_output_in_the_readme_must_come_from_a_recorded_run():
    """A fenced block with a figure is an output; in README.md outside a generated block it
    fails (it was pasted by hand), inside an example's generated block it passes; a command
    alone passes."""
    pasted = "```\n$ sweeper plan\nTTFT p99 475.6 ms\n```\n"
    command = "```\nsweeper plan --rate 1 --ttft 1 --tpot 0.03\n```\n"
    generated = ("<!-- generated:example-plan-llama -->\n" + pasted
                 + "<!-- /generated:example-plan-llama -->\n")
    found = figures.bare_figures(pasted, "README.md", readme_numbers.BLOCK, readme_numbers.SPAN,
                                 readme=True)
    assert len(found) == 1 and found[0].startswith("README.md:1: a code block shows '475.6 ms'")
    assert figures.bare_figures(command + generated, "README.md", readme_numbers.BLOCK,
                                readme_numbers.SPAN, readme=True) == []
    # in docs/ a code example is exempt
    assert figures.bare_figures(pasted, "docs/x.md", readme_numbers.BLOCK, readme_numbers.SPAN) == []


def test_every_committed_page_passes_and_pending_pages_are_still_pending(tmp_path):
    """The committed pages carry no figure typed by hand (outside `PENDING`), and a page in
    `PENDING` still has some: once its figures are quoted or marked, remove it there."""
    assert _check(_copy_pages(tmp_path)) == []
    for where in figures.PENDING:
        path = ROOT / where
        assert path.is_file(), f"figures.PENDING lists {where}, which does not exist: remove it"
        assert figures.bare_figures(path.read_text(), where, readme_numbers.BLOCK,
                                    readme_numbers.SPAN), \
            f"{where} has no figure typed by hand left: remove it from figures.PENDING"


def test_every_page_is_a_manual_of_at_most_about_25_kb():
    """Each docs page (generated blocks included) at most 25 KiB: a run history or a per-run
    table belongs in a results file, not in a manual (docs/development.md)."""
    sizes = {page.name: page.stat().st_size for page in (ROOT / "docs").glob("*.md")}
    sizes["README.md"] = (ROOT / "README.md").stat().st_size
    assert {name: size for name, size in sizes.items() if size > PAGE_LIMIT_BYTES} == {}
