"""The README's performance tables are generated from benchmarks/results/*.json (issue 14:
one source for every published number): the committed README must match the committed
results, and the generated text must carry the results' numbers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import common, readme_numbers

ROOT = Path(__file__).resolve().parents[1]


def test_readme_performance_section_matches_the_results_files(capsys):
    assert readme_numbers.main(["--check"]) == 0, capsys.readouterr().err


def test_generated_text_quotes_the_results_and_only_their_verdicts(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    engine = json.loads((common.RESULTS / "engine_efficiency.json").read_text())
    (results / "engine_efficiency.json").write_text(json.dumps(engine))
    text = readme_numbers.generate(results)
    assert common.pct(engine["single_chip_prefill_mfu"]) in text
    assert f"{engine['worst_decode_ratio']:.2f}×" in text
    assert "**met**" not in text or any(engine[k] for k in engine if k.startswith("meets_"))
    assert "sweep_overhead**: no results file" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{readme_numbers.BEGIN}\nold\n{readme_numbers.END}\nafter\n")
    assert readme_numbers.main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert readme_numbers.main(["--results", str(results), "--readme", str(readme)]) == 0
    new = readme.read_text()
    assert new.startswith("before\n") and new.endswith(f"{readme_numbers.END}\nafter\n")
    assert "old" not in new and common.pct(engine["single_chip_prefill_mfu"]) in new
