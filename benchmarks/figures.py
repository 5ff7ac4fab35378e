"""Every figure with a unit in README.md and docs/*.md is generated, marked or code.

`python -m benchmarks.readme_numbers --check` (run by `make test`) fails on a figure typed by
hand: a number with a unit in prose or in a table of any page that is not

- in a generated block (`<!-- generated:NAME -->` ... `<!-- /generated:NAME -->`) or an
  `n:` marker (`<!-- n:FILE:PATH:FORMAT -->TEXT<!-- /n -->`): a measurement, quoted from its
  results file by `benchmarks.readme_numbers`;
- a marked figure, `<!-- fact:SOURCE -->TEXT<!-- /fact -->`: a figure that is a fact, not a
  measurement of this project, with where it comes from (a datasheet, the paper's table, a
  formula's constant, a default in the code): `<!-- fact:paper Table 2 -->28.4 ms<!-- /fact -->`.
  SOURCE may not be empty;
- code: a fenced block or an inline `code span` (a command, a flag's value, a config). In
  README.md a fenced block that shows a figure must be an output, and outputs there come from
  a real run by a script (`benchmarks.examples`) through a generated block: a fenced block
  with a figure outside one fails.

A confidence level before what it qualifies ("a 95% CI", "a 90% band") is a definition, not a
figure.

Units (FIGURE below): percent; s, ms, us, ns, minutes; a ratio `2x`/`2×` (not a shape like
`2x2x1` or a product `8 x 64`); bytes (KB ... TiB, not a bare `B`, which is a parameter count
as in `540B`) and bytes per second; FLOP/s; tok/s, req/s and any `N/s`; GHz; a dollar amount;
and a count of a total, `k/N` (`18/24`), except in paths (`1/2/4/8`). A range (`9-12 ms`)
is one figure. The comments do not show in rendered Markdown.
"""

from __future__ import annotations

import re

# Pages whose bare figures are listed (as warnings) but do not fail the check yet, each with
# why: remove a page here once its figures are quoted or marked (tests/test_figures.py fails
# on a page listed here that has none left).
PENDING: dict[str, str] = {}

NUMBER = r"\d[\d,]*(?:\.\d+)?"
UNIT = (r"(?:%"
        r"|[kMGTP]?FLOP/s|[kMGTP]?FLOPs?"
        r"|[KMGT]i?B/s|[KMGT]?b/s|[KMGT]i?B"
        r"|tok(?:ens)?/s|req(?:uests)?/s|/s"
        r"|[kMG]Hz"
        r"|ms|us|µs|μs|ns|s|sec|seconds?|min|minutes?|hours?"
        r"|x(?!\s*\d)|×(?!\s*\d))")
FIGURE = re.compile(
    rf"(?<![\w.$/-])(?:[~≈<>≤≥±+\-−])?(?:\$\s?{NUMBER}|{NUMBER}(?:\s?[-–]\s?{NUMBER})?\s?{UNIT})"
    r"(?![\w×/])"
    r"|(?<![\w./-])\d+/\d+(?![\w./])")                 # k/N, not 1/2/4/8 nor a path
# a confidence level names a statistic, it measures nothing: "a 95% CI", "a 90% band"
CONVENTION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?% (?=(?:CI|confidence|(?:bootstrap |prediction )?"
                        r"intervals?|bands?)\b)")
FACT = re.compile(r"<!-- fact:(?P<source>[^>]*?) -->(?P<text>.*?)<!-- /fact -->", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
LINK_TARGET = re.compile(r"\]\([^)]*\)|<https?://[^>]*>|https?://\S+")
FENCE = re.compile(r"^\s*(```|~~~)")

HOW = "quote it (n: marker, generated block), mark it (<!-- fact:SOURCE -->) or make it code"


def _blank(match: re.Match) -> str:
    """A removed region keeps its line breaks, so line numbers stay the page's own."""
    return "\n" * match.group(0).count("\n")


def bare_figures(text: str, where: str, blocks: re.Pattern, spans: re.Pattern,
                 readme: bool = False) -> list[str]:
    """The problems of one page: each figure typed by hand (file:line: the figure), each fact
    marker without a source, and (README.md) each fenced block with a figure outside a
    generated block. `blocks` and `spans` are readme_numbers' BLOCK and SPAN."""
    problems = [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: a fact marker needs its source "
                f"(<!-- fact:SOURCE -->{m['text']}<!-- /fact -->)"
                for m in FACT.finditer(text) if not m["source"].strip()]
    bare = blocks.sub(_blank, text)
    bare = FACT.sub(_blank, spans.sub(_blank, bare))
    bare = COMMENT.sub(_blank, bare)
    fenced_at, fenced_figures = None, []
    for number, line in enumerate(bare.split("\n"), 1):
        if FENCE.match(line):
            if fenced_at is None:
                fenced_at, fenced_figures = number, []
            else:
                if readme and fenced_figures:
                    problems.append(f"{where}:{fenced_at}: a code block shows {fenced_figures[0]!r}: "
                                    "an output in the README comes from a real run "
                                    "(benchmarks.examples) through a generated block")
                fenced_at = None
            continue
        if fenced_at is not None:
            fenced_figures += [m.group(0) for m in FIGURE.finditer(INLINE_CODE.sub("", line))]
            continue
        prose = CONVENTION.sub("", LINK_TARGET.sub("", INLINE_CODE.sub("", line)))
        problems += [f"{where}:{number}: {m.group(0).strip()!r} is typed by hand; {HOW}"
                     for m in FIGURE.finditer(prose)]
    return problems
