"""One source for every published benchmark number: the numbers in README.md, docs/*.md and
benchmarks/results/summary.md are generated from `benchmarks/results/*.json` (and the recorded
data in `benchmarks/data/`) by this script; `make bench` runs it last.

    python -m benchmarks.readme_numbers            # rewrite every generated number in place
    python -m benchmarks.readme_numbers --check    # exit 1, naming file and line, if one is stale

Three forms (issue 21: every number in prose comes from a results file):

- a block, `<!-- generated:NAME -->` ... `<!-- /generated:NAME -->`: a table or paragraph
  from one results file (NAME is a key of BLOCKS: engine_efficiency, sweep_overhead,
  calibration, profile_predict, search_efficiency, paper_fit, performance, serving_validation);
- a number in a sentence, `<!-- n:FILE:PATH:FORMAT -->TEXT<!-- /n -->`: FILE is a results
  file (`engine_efficiency` = benchmarks/results/engine_efficiency.json) or `data/NAME.EXT`
  (benchmarks/data/, JSON or YAML); PATH is dotted keys, `[3]` an index, `[k=v,k2=v2]` the
  first element with those values, and `A / B` the ratio of two paths; FORMAT is a key of
  FORMATS. The comments do not show in rendered Markdown;
- `benchmarks/results/summary.md`, generated whole (every target with its measured value).

Nothing outside the markers is touched. A "met" appears only where the results file says so,
with its sample size (issue 14). Reads JSON and YAML only: it runs in `make test` in about a
second.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks import common, sweep_overhead

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("engine_efficiency", "sweep_overhead", "calibration", "profile_predict", "search_efficiency")


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _x(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}×"


def _load_text(block: dict) -> str:
    start = (block.get("context") or {}).get("load_average")
    end = (block.get("context_end") or {}).get("load_average")
    return f"load average {start} at the start, {end} at the end" if start else "load not recorded"


def engine_section(r: dict) -> list[str]:
    single = {row["tokens"]: row["prefill_mfu"] for row in r["prefill_rows"]
              if row["chips"] == 1 and row["process_devices"] == 1}
    largest = max(row["tokens"] for row in r["sharded"])
    ratios = ", ".join(f"{row['ffn']} {_x(row['ratio'])}" for row in
                       sorted((s for s in r["sharded"] if s["tokens"] == largest), key=lambda s: s["ratio"]))
    dec = {(d["batch"], d["chips"], d["ffn"]): d["ratio_to_bound"] for d in r["decode"]
           if d["process_devices"] == d["chips"] or d["chips"] > 1}
    dec_text = "; ".join(f"batch {b}, {c} chip{'s' if c > 1 else ''} {f}: {_x(v)}"
                         for (b, c, f), v in sorted(dec.items()))
    return [
        f"**Engine efficiency** (`benchmarks/engine_efficiency.py`, model `{r['model']['name']}`, run of "
        f"{r['context']['time']}, {_load_text(r)}):",
        "",
        *common.table(["target", "measured", "verdict"], [
            [f"single-chip prefill MFU ≥ {common.pct(r['targets']['single_chip_prefill_mfu_min'], 0)} of host peak",
             "; ".join(f"{common.pct(v)} at {t} tokens" for t, v in sorted(single.items()))
             + f" (per CPU-second {common.pct(r['single_chip_prefill_mfu_per_cpu_s'])} at the largest)",
             common.met(r["meets_prefill_target"])],
            [f"8 emulated chips within {r['targets']['sharded_over_single_max']}× of 1 chip ({largest} tokens)",
             ratios, common.met(r["meets_sharded_target"])],
            [f"decode step within {r['targets']['decode_over_memory_bound_max']}× of its memory bound",
             f"{_x(r['best_decode_ratio'])} to {_x(r['worst_decode_ratio'])} ({dec_text})",
             common.met(r["meets_decode_target"])],
        ]),
    ]


def overhead_section(r: dict) -> list[str]:
    rows = []
    for key in ("sweeper", "tune"):
        b = r.get(key)
        if b:
            rows.append([b["framework"], f"{b['wall_s']:.1f} s", f"{b['trial_run_s_sum']:.1f} s",
                         f"{b['overhead_per_trial_s'] * 1e3:.0f} ms", f"{b['until_first_trial_s']:.1f} s",
                         f"{b['steady_overhead_per_trial_s'] * 1e3:.0f} ms"])
    q = r.get("quickstart") or {}
    lines = [f"**Sweep overhead** (`benchmarks/sweep_overhead.py`, {r['sweeper']['trials']} tiny trials "
             f"one at a time, run of {r['context']['time']}, {_load_text(r)}):", "",
             *common.table(["framework", "wall", "sum of trials", "overhead/trial", "start-up",
                            "overhead/trial after start-up"], rows), ""]
    lines.append(f"- sweeper overhead per trial ≤ Ray Tune's: ratio {r['sweeper_over_tune']:.2f} "
                 f"({common.met(r['meets_tune_target'])}, one run each);")
    if q:
        lines.append(f"- overhead < {common.pct(r['targets']['quickstart_overhead_share_max'], 0)} of the "
                     f"quickstart's wall time: {common.pct(r['quickstart_overhead_share'])} of "
                     f"{q['wall_s']:.1f} s ({q['trials']} trials, compile-cache hit rate "
                     f"{common.pct(q['compile_cache_hit_rate'])}): {common.met(r['meets_quickstart_target'])}.")
    return lines


def search_section(r: dict) -> list[str]:
    lines = [f"**Search efficiency** (`benchmarks/search_efficiency.py`, {r['seeds']} seeds per sampler, "
             f"{_load_text(r)}): trials each sampler is charged for (dispatched trials only) until "
             "the found points reach 95% of the grid's hypervolume; median [min–max] over seeds.", ""]
    for name, block in r["spaces"].items():
        g = block["grid"]
        header = ["sampler", "median", "spread (min–max)", "not reached"]
        rows = []
        for sampler, s in block["samplers"].items():
            spread = (f"{s.get('min_trials_to_target', '—')}–{s['max_trials_to_target']}")
            rows.append([sampler, f"{s['median_trials_to_target']:.1f}", spread, s["censored_runs"]])
        lines += [f"*{name}*: {g['source']}, {g['points']} points ({g['complete']} dispatched, "
                  f"{g['pruned']} pruned or infeasible).", "", *common.table(header, rows), ""]
        for variant, v in (block.get("verdict") or {}).items():
            lines.append(f"- `{variant}`: median {common.pct(v['guided_share_of_grid'])} of the grid "
                         f"(≤ 20%: {common.met(v['meets_share_target'])}); fewer trials than every "
                         f"plain sampler: {common.met(v['beats_every_plain'])}.")
        lines.append("")
    if r.get("fit_note"):
        lines.append(f"`guided+fit`: {r['fit_note']}.")
    return lines


def calibration_section(r: dict) -> list[str]:
    lines = [f"**Calibration** (`benchmarks/calibration.py`, {r['source_text']}; "
             f"{r['trials_complete']} trials, {r['n_points']} points):", ""]
    rows = []
    for name, h in r["holdouts"].items():
        if h.get("skipped"):
            rows.append([name, "skipped", "", "", "", "", h["skipped"]])
            continue
        ci = h.get("mape_ci95") or [None, None]
        rows.append([name, h["n_points"], f"{common.pct(h['mape_heldout'])} [{common.pct(ci[0])}, "
                     f"{common.pct(ci[1])}]", common.pct(h["median_ape_heldout"]),
                     common.pct(h.get("noise_floor_mape")),
                     f"{common.pct(h['top1_agreement'])} over {h['ranking_groups']} groups",
                     h.get("verdict_text", "—")])
    lines += common.table(["hold-out", "points", "MAPE [95% CI]", "median", "noise floor",
                           "top-1", "verdict"], rows)
    return lines


def profile_predict_section(r: dict) -> list[str]:
    prof = r.get("profiling") or {}
    lines = [f"**Op-level profile alone** (`benchmarks/profile_predict.py`, profile `{r['profile']}`, "
             f"load average {prof.get('load_average_start')} -> {prof.get('load_average_stop')} while "
             f"profiling; {r['n_points']} calibration points, all held out by construction):", ""]
    rows = [["op-level profile", r["profiled"]], ["host profile (unprofiled)", r["host_unprofiled"]]]
    if r.get("fit_kfold"):
        rows.append(["trial-level fit, k-fold held out", r["fit_kfold"]])
    lines += common.table(["predictor", "MAPE", "median", "max", "top-1"],
                          [[name, common.pct(s["mape"]), common.pct(s["median"]), common.pct(s["max"]),
                            f"{common.pct(s['top1'])} over {s['ranking_groups']} groups"] for name, s in rows])
    return lines


SECTIONS = {"engine_efficiency": engine_section, "sweep_overhead": overhead_section,
            "calibration": calibration_section, "profile_predict": profile_predict_section,
            "search_efficiency": search_section}


def generate(results: Path) -> str:
    parts = ["_Generated by `python -m benchmarks.readme_numbers` from `benchmarks/results/*.json`; "
             "do not edit by hand._", ""]
    for name, section in (("engine_efficiency", engine_section), ("sweep_overhead", overhead_section),
                          ("calibration", calibration_section), ("profile_predict", profile_predict_section),
                          ("search_efficiency", search_section)):
        data = _load(results, name)
        if data is None:
            parts += [f"**{name}**: no results file.", ""]
            continue
        try:
            parts += section(data) + [""]
        except KeyError as err:   # a results file from an older version of its benchmark
            parts += [f"**{name}**: results file lacks {err} (run `make bench`).", ""]
    return "\n".join(parts).rstrip() + "\n"


def _signed_pct(v: float) -> str:
    return f"{100 * v:+.0f}%"


FORMATS = {
    "pct": common.pct,                                  # 0.115 -> 11.5%
    "pct0": lambda v: common.pct(v, 0),                 # 0.115 -> 12%
    "spct": _signed_pct,                                # 1.35 -> +135%
    "x1": lambda v: f"{v:.1f}×",
    "x2": lambda v: f"{v:.2f}×",
    "f0": lambda v: f"{v:.0f}",
    "f1": lambda v: f"{v:.1f}",
    "f2": lambda v: f"{v:.2f}",
    "int": lambda v: f"{int(round(v)):,}",
    "ms0": lambda v: f"{v * 1e3:.0f} ms",
    "ms1": lambda v: f"{v * 1e3:.1f} ms",
    "ms2": lambda v: f"{v * 1e3:.2f} ms",
    "s0": lambda v: f"{v:.0f} s",
    "s1": lambda v: f"{v:.1f} s",
    "s2": lambda v: f"{v:.2f} s",
    "min1": lambda v: f"{v / 60:.1f} minutes",
    "gflops": lambda v: f"{v / 1e9:.0f} GFLOP/s",
    "tflops": lambda v: f"{v / 1e12:.0f} TFLOP/s",
    "gbs1": lambda v: f"{v / 1e9:.1f} GB/s",
    "gbs0": lambda v: f"{v / 1e9:.0f} GB/s",
    "tbs1": lambda v: f"{v / 1e12:.1f} TB/s",
    "str": str,
    "len": lambda v: str(len(v)),                      # a list: how many entries
}

SPAN = re.compile(r"<!-- n:(?P<file>[^:>]+):(?P<path>[^:>]+):(?P<fmt>\w+) -->(?P<text>.*?)<!-- /n -->")
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)
STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


class Stale(Exception):
    """A marker this script cannot fill: unknown file, path, format or block."""


def read_file(results: Path, name: str) -> dict:
    if name.startswith("data/"):
        path = common.DATA / name[len("data/"):]
    else:
        path = results / f"{name}.json"
    if not path.is_file():
        raise Stale(f"no results file {path}")
    if path.suffix in (".yaml", ".yml"):
        import yaml   # PyYAML, a dependency of the package

        return yaml.safe_load(path.read_text())
    return json.loads(path.read_text())


def lookup(data, path: str):
    """`a.b[2].c[k=v]`: keys, an index, or the first element whose fields match."""
    value = data
    for key, selector in STEP.findall(path.strip()):
        if key:
            if not isinstance(value, dict) or key not in value:
                raise Stale(f"{path}: no key {key!r}")
            value = value[key]
        elif selector.isdigit():
            value = value[int(selector)]
        else:
            want = dict(part.split("=", 1) for part in selector.split(","))
            match = [e for e in value if all(str(e.get(k)) == v for k, v in want.items())]
            if not match:
                raise Stale(f"{path}: no element with {selector}")
            value = match[0]
    return value


def number(results: Path, file: str, path: str, fmt: str) -> str:
    if fmt not in FORMATS:
        raise Stale(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    data = read_file(results, file)
    parts = path.split(" / ")
    value = lookup(data, parts[0])
    for divisor in parts[1:]:
        value = value / lookup(data, divisor)
    return FORMATS[fmt](value)


def paper_fit_block(results: Path) -> str:
    md = results / "paper_fit.md"
    if not md.is_file():
        raise Stale(f"no results file {md}")
    return md.read_text().rstrip() + "\n"


def one_section(name: str):
    def render(results: Path) -> str:
        data = _load(results, name)
        if data is None:
            raise Stale(f"no results file {results / (name + '.json')}")
        return "\n".join(SECTIONS[name](data)).rstrip() + "\n"
    return render


BLOCKS = {name: one_section(name) for name in NAMES}
BLOCKS["paper_fit"] = paper_fit_block


WORLD_EVERY_ROW = "## Every row"   # benchmarks/world.py EVERY_ROW (not imported: it fits)


def world_block(results: Path) -> str:
    """benchmarks/results/world.md up to its every-row table (docs/world.md quotes it)."""
    md = results / "world.md"
    if not md.is_file():
        raise Stale(f"no results file {md}")
    return md.read_text().split(WORLD_EVERY_ROW)[0].rstrip() + "\n"


BLOCKS["world"] = world_block
BLOCKS["performance"] = lambda results: generate(results)


def serving_validation_block(results: Path) -> str:
    """benchmarks/results/serving_validation.md without its title (docs/serving.md quotes it);
    of a several-run file, the summary over the runs and the last run (each run renders
    alike: the others stay in the results file)."""
    md = results / "serving_validation.md"
    if not md.is_file():
        raise Stale(f"no results file {md}")
    lines = md.read_text().rstrip().splitlines()
    lines = lines[1:] if lines and lines[0].startswith("# ") else lines
    runs = [i for i, line in enumerate(lines) if line.startswith("#### Run ")]
    if len(runs) > 1:
        note = (f"Runs 1 to {len(runs) - 1} are rendered alike in "
                "`benchmarks/results/serving_validation.md`; the last run:")
        lines = [*lines[:runs[0]], note, "", *lines[runs[-1]:]]
    return "\n".join(lines).strip() + "\n"


BLOCKS["serving_validation"] = serving_validation_block


def fill(text: str, results: Path, where: str) -> tuple[str, list[str]]:
    """The text with every block and span regenerated, and the problems found."""
    problems: list[str] = []
    current = [text]   # the text being substituted, for line numbers

    def line_of(pos: int) -> int:
        return current[0].count("\n", 0, pos) + 1

    def block(m: re.Match) -> str:
        name = m["name"]
        try:
            if name not in BLOCKS:
                raise Stale(f"unknown block {name!r} (one of {', '.join(BLOCKS)})")
            body = BLOCKS[name](results)
        except Stale as err:
            problems.append(f"{where}:{line_of(m.start())}: generated:{name}: {err}")
            return m.group(0)
        if body != m["body"]:
            problems.append(f"{where}:{line_of(m.start())}: generated:{name} is out of date")
        return m.group(1) + body + m.group(4)

    def span(m: re.Match) -> str:
        try:
            value = number(results, m["file"], m["path"], m["fmt"])
        except (Stale, KeyError, IndexError, TypeError, ZeroDivisionError) as err:
            problems.append(f"{where}:{line_of(m.start())}: n:{m['file']}:{m['path']}: {err}")
            return m.group(0)
        if value != m["text"]:
            problems.append(f"{where}:{line_of(m.start())}: {m['file']}:{m['path']} is {value}, "
                            f"the text says {m['text']!r}")
        return m.group(0).replace(f"-->{m['text']}<!--", f"-->{value}<!--", 1)

    # spans first: a value is one line, so the blocks' line numbers stay the file's own
    current[0] = SPAN.sub(span, text)
    return BLOCK.sub(block, current[0]), problems


# Pages that report measurements: there a rate or a ratio in prose must come from a marker
# (the stale "429-445 GFLOP/s" and "18x at batch 1" of issue 21 were such hand-typed text).
MEASURED_PAGES = ("README.md", "docs/performance.md", "docs/calibration.md", "docs/measurement.md")
MEASURED_NUMBER = re.compile(r"(?<![\w.])\d[\d.,]*\s?(?:[GT]FLOP/s|[GT]B/s)"
                             r"|(?<![\w.])\d+(?:\.\d+)?[×x](?![\w×]|\s*\d)")   # 18x, 2.37×; not 2x2x1


def unmarked_numbers(text: str, where: str) -> list[str]:
    """Rates and ratios in prose (outside code blocks, blocks and spans) of a measured page."""
    bare = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), SPAN.sub("", text))
    found, fenced = [], False
    for number, line in enumerate(bare.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            found += [f"{where}:{number}: {m.group(0)!r} is typed by hand; quote it from a results "
                      "file (an n: marker)" for m in MEASURED_NUMBER.finditer(line)]
    return found


def overhead_rows(ovh: dict) -> list[list]:
    """Issue 22's targets: the quickstart's wall time, the slots' time outside trials (within
    the trials' span and over the command) per sweep, compiled programs reused."""
    t, rows = ovh.get("targets") or {}, []
    q = ovh.get("quickstart")
    if q and t.get("quickstart_wall_s_max"):
        judged = sweep_overhead.issue22_targets(ovh)["quickstart"]     # the median, when repeated
        low, high = judged["wall_s_range"]
        measured = (f"{q['wall_s']:.1f} s (one run, load {q['context']['load_average'][0]:.1f})"
                    if judged["runs"] == 1 else
                    f"median {judged['wall_s']:.1f} s over {judged['runs']} runs (range {low:.1f}-{high:.1f} s, "
                    f"{judged['runs_meeting_wall_s']} of {judged['runs']} within)")
        rows.append(["sweep overhead", f"the quickstart <= {t['quickstart_wall_s_max']:.0f} s end to end on 2 cores",
                     measured, common.met(judged["meets_wall_s"])])
    for name in ("quickstart", "grid", "calibration", "calibration_full"):
        r = ovh.get(name)
        if not r or "span_share" not in r or "span_share_max" not in t:
            continue
        runs = sweep_overhead.every_run(r)
        measured = ", ".join(f"{common.pct(x['span_share'])} / {common.pct(x['orchestration_share'])}"
                             for x in runs)
        counted = "one run" if len(runs) == 1 else f"{len(runs)} runs"
        rows.append(["sweep overhead", f"{_SWEEP_NAMES.get(name, name)}: slots' time outside trials <= "
                     f"{common.pct(t['span_share_max'], 0)} within the span, <= "
                     f"{common.pct(t['wall_share_max'], 0)} over the command",
                     f"{measured} ({r['trials']} trials, {r['worker_processes']} worker processes, {counted})",
                     common.met(all(x["span_share"] <= t["span_share_max"]
                                    and x["orchestration_share"] <= t["wall_share_max"] for x in runs))])
    for name in ("calibration", "calibration_full"):
        c = ovh.get(name)
        if c and "calibration_reuse_min" in t:
            runs = sweep_overhead.every_run(c)
            rows.append(["sweep overhead", f"{_SWEEP_NAMES[name]}: compiled programs reused in >= "
                         f"{common.pct(t['calibration_reuse_min'], 0)} of trials",
                         ", ".join(common.pct(x["reuse_rate"]) for x in runs) + f" of {c['trials']} trials"
                         + ("" if len(runs) == 1 else f" ({len(runs)} runs)"),
                         common.met(all(x["reuse_rate"] >= t["calibration_reuse_min"] for x in runs))])
    return rows


# the summary's names of sweep_overhead's sweep sections
_SWEEP_NAMES = {"calibration": "calibration subset", "calibration_full": "calibration sweep (all 192 trials)"}


def paper_and_serving_rows(results: Path) -> list[list]:
    """Issue 20's paper target and issue 19's serving validation and planner speed."""
    rows = []
    paper = _load(results, "paper_fit")
    if paper:
        phys = all(v for v in (paper.get("physical") or {}).values() if isinstance(v, bool))
        ratio = (paper.get("int8_advantage") or {}).get("ratio")
        int8 = f"; int8 decode advantage {ratio:.2f}x (paper 1.29x)" if ratio else ""
        rows.append(["paper fit", f"leave-one-out MAPE <= {common.pct(paper['target_mape'], 0)} on the "
                     "paper's numbers, every constant physically possible",
                     f"{common.pct(paper['mape_heldout'])} (median {common.pct(paper['median_ape_heldout'])}, "
                     f"{len(paper['rows'])} rows); physical: {'yes' if phys else 'no'}{int8}",
                     common.met(paper["mape_heldout"] <= paper["target_mape"] and phys)])
    serving = _load(results, "serving_validation")
    if serving:
        for stat, v in serving["summary"].items():
            # several runs (serving_validation --runs N): the median run's count, every run's
            runs = v.get("within_target_runs")
            of_runs = (f" (median of {len(runs)} runs: {', '.join(str(n) for n in runs)})"
                       if runs and len(runs) > 1 else "")
            rows.append(["serving", f"predicted {stat} TTFT/TPOT within {common.pct(v['target'], 0)} of "
                         "real serving runs",
                         f"{v['within_target']}/{v['cases']} cases{of_runs}, median absolute error "
                         f"{common.pct(v['median_abs_error'])} (replicate spread "
                         f"{common.pct(v['median_replicate_spread'])})",
                         common.met(v["within_target"] == v["cases"])])
    speed = _load(results, "plan_speed")
    if speed:
        for name, q in speed["questions"].items():
            if q.get("best") is None:
                continue
            w = q["search_wall_s"]
            rows.append(["serving", f"`sweeper plan` answers {name} in seconds",
                         f"search {w['mean']:.2f} ± {w['sd']:.2f} s (n={w['n']}); CLI {q['cli_wall_s']:.1f} s",
                         common.met(q["cli_wall_s"] < 60)])
    return rows


def summary(results: Path) -> str:
    """benchmarks/results/summary.md: every target with its measured value, from the results
    files; each benchmark's own .md says when and under which load it ran."""
    eng, ovh, cal, srch = (_load(results, n) for n in ("engine_efficiency", "sweep_overhead",
                                                       "calibration", "search_efficiency"))
    rows = []
    if eng:
        rows += [
            ["engine", f"single-chip large-batch prefill MFU >= {common.pct(eng['targets']['single_chip_prefill_mfu_min'], 0)} of host peak",
             f"{common.pct(eng['single_chip_prefill_mfu'])} (per CPU-second: "
             f"{common.pct(eng['single_chip_prefill_mfu_per_cpu_s'])})", common.met(eng["meets_prefill_target"])],
            ["engine", f"8 emulated chips within {eng['targets']['sharded_over_single_max']}x of 1 chip (prefill, same work)",
             f"{eng['best_sharded_ratio_largest']:.2f}x to {eng['worst_sharded_ratio_largest']:.2f}x",
             common.met(eng["meets_sharded_target"])],
            ["engine", f"decode step within {eng['targets']['decode_over_memory_bound_max']}x of its memory bound",
             f"{eng['best_decode_ratio']:.2f}x to {eng['worst_decode_ratio']:.2f}x", common.met(eng["meets_decode_target"])],
        ]
    if ovh:
        if ovh.get("tune"):
            rows.append(["sweep overhead", "sweeper overhead per trial <= Ray Tune's",
                         f"{ovh['sweeper']['overhead_per_trial_s'] * 1e3:.0f} ms vs "
                         f"{ovh['tune']['overhead_per_trial_s'] * 1e3:.0f} ms (one run each)",
                         common.met(ovh["meets_tune_target"])])
        rows += overhead_rows(ovh)
    if cal:
        t = cal["targets"]
        for name in t["schemes"]:
            h = cal["holdouts"].get(name) or {}
            if h.get("skipped") or not h:
                continue
            ci = h["mape_ci95"]
            rows.append(["calibration", f"{name}: held-out MAPE <= {common.pct(t['mape_max'], 0)}, "
                         f"median <= {common.pct(t['median_max'], 0)}",
                         f"{common.pct(h['mape_heldout'])} [95% CI {common.pct(ci[0])}-{common.pct(ci[1])}], "
                         f"median {common.pct(h['median_ape_heldout'])}, noise floor "
                         f"{common.pct(h['noise_floor_mape'])} ({h['n_points']} points)",
                         common.met(h["verdict"]["mape"]["met"] and h["verdict"]["median"]["met"])])
        for name in t["schemes"]:      # issue 20: against replicate means, every cell
            i20 = (cal["holdouts"].get(name) or {}).get("issue20")
            if not i20:
                continue
            worst = max(i20["cells"], key=lambda c: abs(c["signed_median"]))
            rows.append(["calibration", f"{name}: held-out MAPE vs replicate means <= 7%, every "
                         "(phase, chips) cell's signed median within +-5%",
                         f"{common.pct(i20['mape_vs_mean'])} (noise floor {common.pct(i20['floor_vs_mean'])}, "
                         f"{i20['configurations']} configurations); worst cell {worst['phase']} at "
                         f"{worst['chips']} chips {_signed_pct(worst['signed_median'])}",
                         common.met(i20["met"])])
        k = cal["holdouts"]["kfold"]
        rows.append(["calibration", f"top-1 layout agreement >= {common.pct(t['top1_min'], 0)} over "
                     f">= {t['min_groups']} groups",
                     f"{common.pct(k['top1_agreement'])} over {k['ranking_groups']} groups",
                     common.met(k["verdict"]["top1"]["met"])])
    if srch:
        for name, block in srch["spaces"].items():
            plain = ", ".join(f"{s} {v['median_trials_to_target']:.1f}" for s, v in block["samplers"].items()
                              if not s.startswith("guided"))
            size = block["grid"]["complete"]
            for variant, v in (block.get("verdict") or {}).items():
                g = block["samplers"][variant]
                rows.append(["search", f"{name}: {variant} reaches 95% HV within 20% of the "
                             f"{size} dispatchable points (every seed)",
                             f"median {g['median_trials_to_target']:.1f}, worst {g['max_trials_to_target']} "
                             f"over {len(g['runs'])} seeds", common.met(v["meets_share_target"])])
                rows.append(["search", f"{name}: {variant}'s worst seed beats every plain median",
                             f"plain medians: {plain}", common.met(v["beats_every_plain"])])
    rows += paper_and_serving_rows(results)
    host = []
    if eng and eng.get("host_profile"):
        hp, notes = eng["host_profile"], eng.get("host_profile_notes") or {}
        host.append(f"- engine efficiency's MFU is against the host profile measured at "
                    f"{notes.get('measured_at', '?')} (load {notes.get('load_average_1min', '?')}): peak "
                    f"{hp['peak_flops'] / 1e9:.0f} GFLOP/s ({notes.get('peak_flops_from', '?')}; one core "
                    f"{(notes.get('peak_flops_one_core') or 0) / 1e9:.0f} GFLOP/s, in-process "
                    f"{(notes.get('peak_flops_in_process') or 0) / 1e9:.0f} GFLOP/s), read bandwidth "
                    f"{hp['hbm_bandwidth'] / 1e9:.1f} GB/s;")
    calib_host = common.DATA / "calibration-host.yaml"
    if calib_host.is_file():
        hp = read_file(results, "data/calibration-host.yaml")
        host.append(f"- the calibration sweep predicted with the host profile in "
                    f"`benchmarks/data/calibration-host.yaml`: peak {hp['peak_flops'] / 1e9:.0f} GFLOP/s, "
                    f"read bandwidth {hp['hbm_bandwidth'] / 1e9:.1f} GB/s.")
    lines = [
        "# Benchmarks: summary",
        "",
        "_Generated by `python -m benchmarks.readme_numbers` from `benchmarks/results/*.json`; "
        "do not edit by hand. `make bench` (= `python -m benchmarks.run_all`) reruns the "
        "benchmarks, then this._",
        "",
        "Every emulated-mesh timing is this host's and moves with its load: each benchmark's "
        "own file says when it ran and the load average around it. Ratios were measured side "
        "by side in one run.",
        "",
        *common.table(["benchmark", "target", "measured", ""], rows),
        "",
        "Host profiles (MFU is a fraction of the measured peak):",
        "",
        *host,
        "",
        "Details: " + ", ".join(f"[{n}]({n}.md)" for n in (*NAMES, "paper_fit", "plan_speed")
                                if (results / f"{n}.md").is_file()) + ".",
        "",
    ]
    return "\n".join(lines)


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose numbers this script owns."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(common.RESULTS))
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose README.md and docs/ to fill")
    parser.add_argument("--check", action="store_true", help="exit 1 if any generated number is out of date")
    args = parser.parse_args(argv)
    results, root = Path(args.results), Path(args.root)
    problems: list[str] = []
    changed: list[Path] = []
    for path in documents(root):
        if not path.is_file():
            continue
        text = path.read_text()
        where = str(path.relative_to(root))
        new, found = fill(text, results, where)
        problems += found
        if where in MEASURED_PAGES:
            problems += unmarked_numbers(text, where)
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    summary_path = results / "summary.md"
    text = summary(results)
    if not summary_path.is_file() or summary_path.read_text() != text:
        changed.append(summary_path)
        problems.append(f"{summary_path}: out of date")
        if not args.check:
            summary_path.write_text(text)
    if args.check:
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated numbers out of date; run: python -m benchmarks.readme_numbers", file=sys.stderr)
        return 1 if problems else 0
    # what rewriting cannot fix: a marker that names nothing, a number typed by hand
    unfixable = [p for p in problems if "out of date" not in p
                 and ("typed by hand" in p or ", the text says " not in p)]
    for line in unfixable:
        print(line, file=sys.stderr)
    print(f"regenerated from {results}: {', '.join(str(p) for p in changed) or 'nothing changed'}",
          file=sys.stderr)
    return 1 if unfixable else 0


if __name__ == "__main__":
    sys.exit(main())
