"""benchmarks/serving_validation.py: the calibration fit starts from the host profile of the
sweep's own SWEEPER_HOME (the one its trials were priced with), not this process's cache
(docs/serving.md, "Validation on this host")."""

from __future__ import annotations

import os

import numpy as np
import pytest

import yaml

from benchmarks import harness
from benchmarks import serving_validation as sv
from benchmarks.render import serving_validation as render
from sweeper.analysis import calibrate as cal
from workloads import hostprofile
from workloads.config import HardwareProfile


def _cache(home, hbm: float) -> None:
    profile = HardwareProfile("host", peak_flops=4e11, hbm_bandwidth=hbm, hbm_bytes=2e10,
                              ici_bandwidth=6e9, measured=True)
    (home / "host_profile.yaml").write_text(yaml.safe_dump(
        {hostprofile.host_key(): {"profile": profile.to_dict(), "notes": {}}}))


def test_the_fit_resolves_host_in_the_sweeps_home(tmp_path, monkeypatch):
    mine, sweeps = tmp_path / "mine", tmp_path / "sweep"
    mine.mkdir(), sweeps.mkdir()
    _cache(mine, 8.6e9)          # a stale cache measured under load
    _cache(sweeps, 3.2e10)       # what the calibration sweep measured
    monkeypatch.setenv("SWEEPER_HOME", str(mine))
    attrs = {"hardware": "host"}
    assert cal.study_base_profile(attrs).hbm_bandwidth == 8.6e9
    with sv._sweeper_home(sweeps):
        assert cal.study_base_profile(attrs).hbm_bandwidth == 3.2e10
    assert os.environ["SWEEPER_HOME"] == str(mine)     # restored after the block
    with sv._sweeper_home(None):
        assert cal.study_base_profile(attrs).hbm_bandwidth == 8.6e9


# --------------------------------------------- the stream's calls vs the closed loop's (issue 19)

PROFILE = "benchmarks/results/serving_validation.fitted.yaml"   # the committed fitted profile
COSTS = {"step_overhead_s": 0.0005, "prefill_overhead_per_prompt_s": 0.001,
         "handover_overhead_s": 0.0, "prefill_wake_s": 0.002, "prefill_first_overhead_s": 0.0005,
         "detail": {"aggregated": {"engine_prefill_s": 0.008, "engine_step_s": 0.0045,
                                   "loop_step_mean_s": 0.005, "loop_step_s": 0.005,
                                   "loop_prefill_first_block_means_s": [0.0085, 0.0095],
                                   "loop_step_block_means_s": [0.005, 0.005]}}}


def _row(factor: float, seed: int = 1) -> dict:
    """One aggregated stream of 4 requests far apart (every prefill call finds the loop idle)
    whose every call lasts `factor` times what the loop model charges for it (COSTS): each
    prefill call starts 1 ms after its arrival (its wake), reaches its first tokens at the
    engine's call + the idle wake (2 ms, larger than the 0.5 ms before the first tokens),
    inserts its row in 0.5 ms (1 prompt x 1 ms - 0.5 ms), then 15 steps of 5 ms."""
    requests = sv.stream(0.5, 4, seed)
    log, wake = [], 0.001
    for i, r in enumerate(requests):
        start = r.arrival_s + wake
        first = start + factor * (0.008 + 0.002) - wake
        end = first + factor * 0.0005
        log.append(["prefill", start, first, [i], end])
        t = end
        for _ in range(15):
            log.append(["step", t, t + factor * 0.005 - 1e-5, 1, t + factor * 0.005])
            t += factor * 0.005
    return {"deployment": "agg-1chip-4slots", "mode": "aggregated", "load": 0.85, "rate_rps": 0.5,
            "requests": 4, "seed": seed, "host_costs": COSTS, "calls": {"aggregated": log},
            "measured": {"ttft_p50_s": 0.012, "tpot_p50_s": 0.005}}


def test_stream_calls_sets_each_call_against_the_loop_models_charge():
    d = sv.deployment("agg-1chip-4slots", sv.common.ROOT / PROFILE)
    row = _row(1.2)
    kinds = sv.stream_calls(d, row["calls"], sv.stream(0.5, 4, 1), COSTS)
    assert set(kinds) == {"prefill_first", "prefill_after", "decode_step"}
    assert len(kinds["prefill_first"]["stream"]) == 4 and len(kinds["decode_step"]["stream"]) == 60
    # idle calls: the engine's call + the wake (larger than the part before the first tokens)
    assert kinds["prefill_first"]["loop"] == pytest.approx([0.010] * 4)
    assert kinds["prefill_first"]["stream"] == pytest.approx([0.012] * 4)
    assert kinds["prefill_after"]["loop"] == pytest.approx([0.0005] * 4)
    assert kinds["decode_step"]["stream"] == pytest.approx([0.006] * 60)
    assert kinds["decode_step"]["loop"] == pytest.approx([0.005] * 60)


def test_scaled_step_times_scale_each_kind_alone():
    d = sv.deployment("agg-1chip-4slots", sv.common.ROOT / PROFILE)
    times = sv.loop_step_times(d, COSTS)
    same = sv.scaled_step_times(times, {})
    assert same.prefill_s(1, 32) == times.prefill_s(1, 32)
    assert same.host_costs.prefill_overhead_per_prompt_s == pytest.approx(
        times.host_costs.prefill_overhead_per_prompt_s)
    slower = sv.scaled_step_times(times, {"prefill_first": 1.5})
    assert slower.prefill_s(1, 32) == pytest.approx(1.5 * 0.008)
    assert slower.host_costs.prefill_first_overhead_s == pytest.approx(1.5 * 0.0005)
    assert slower.decode_step_s(4, 40) == times.decode_step_s(4, 40)
    # the host work after the first tokens of a 1-prompt call stays what it was
    slow, base = slower.host_costs, times.host_costs
    assert (slow.prefill_overhead_per_prompt_s - slow.prefill_first_overhead_s
            == pytest.approx(base.prefill_overhead_per_prompt_s - base.prefill_first_overhead_s))
    assert sv.scaled_step_times(times, {"decode_step": 0.9}).decode_step_s(4, 40) == pytest.approx(0.0045)


def test_duration_analysis_finds_the_streams_longer_calls():
    r = {"profile": PROFILE, "rows": [_row(1.0, 1), _row(1.0, 2)]}
    even = sv.duration_analysis(r)[0]
    assert even["kinds"]["prefill_first"]["ratio"] == pytest.approx(1.0)
    assert even["ttft_p50_error_scaled"] == pytest.approx(even["ttft_p50_error_loop"])
    r = {"profile": PROFILE, "rows": [_row(1.2, 1), _row(1.2, 2)]}
    longer = sv.duration_analysis(r)[0]
    for kind in ("prefill_first", "prefill_after", "decode_step"):
        assert longer["kinds"][kind]["ratio"] == pytest.approx(1.2)
        assert longer["kinds"][kind]["replicate_spread"] == pytest.approx(0.0, abs=1e-9)
    # every call found the loop idle: none back to back
    assert longer["kinds"]["prefill_first"]["ratio_idle"] == pytest.approx(1.2)
    assert longer["kinds"]["prefill_first"]["idle_calls"] == 8
    assert "ratio_busy" not in longer["kinds"]["prefill_first"]
    # at the stream's (longer) calls the loop model's TTFT and TPOT grow: errors go up
    assert longer["ttft_p50_error_scaled"] > longer["ttft_p50_error_loop"] + 0.1
    assert longer["tpot_p50_error_scaled"] > longer["tpot_p50_error_loop"] + 0.1
    assert longer["utilisation_stream"] == pytest.approx(1.2 * longer["utilisation_assumed"], rel=0.05)
    assert longer["block_drift"]["prefill_first"] == pytest.approx(0.001 / 0.009)
    lines = "\n".join(render._durations_lines([longer]))
    assert "agg-1chip-4slots at 85%: " in lines and "20% longer" in lines


def test_duration_analysis_uses_a_remeasured_closed_loop_and_its_drift():
    rows = [_row(1.2, 1), _row(1.2, 2)]
    for row, step in zip(rows, (0.006, 0.0054)):     # re-measured before each stream
        row["host_costs_stream"] = {**COSTS, "detail": {"aggregated": {
            **COSTS["detail"]["aggregated"], "loop_step_mean_s": step}}}
    a = sv.duration_analysis({"profile": PROFILE, "rows": rows})[0]
    assert a["kinds_near"]["decode_step"]["ratio"] == pytest.approx((1.0 + 0.006 / 0.0054) / 2)
    assert a["run_drift"]["decode_step"] == pytest.approx((0.006 - 0.005) / np.mean([0.005, 0.006, 0.0054]))
    assert "near" in "\n".join(render._durations_lines([a]))


# --------------------------------------------- several runs (--runs N) and the steal (issue 19)

import copy
import json

COMMITTED = sv.common.RESULTS / "serving_validation.json"


def _one_run() -> dict:
    """The committed results' first run (a single-run file is one run)."""
    r = json.loads(COMMITTED.read_text())
    return r["runs"][0] if "runs" in r else r


def _shifted(run: dict, by: float, steal: float) -> dict:
    """`run` with every case's prediction `by` further from its measurement, its summary
    recomputed, and `steal` percent stolen over its serving."""
    out = copy.deepcopy(run)
    for g in out["groups"]:
        g["error"] += by
        g["predicted_mean_s"] = g["measured_mean_s"] * (1 + g["error"])
        g["within_target"] = abs(g["error"]) <= g["target"]
    out["summary"] = sv.summarize(out["groups"])
    out["context"]["steal_pct"], out["context"]["iowait_pct"] = steal, 0.1
    return out


def test_over_runs_states_every_run_and_the_median_never_the_best():
    base = _one_run()
    runs = [_shifted(base, 0.0, 1.0), _shifted(base, 0.5, 6.0), _shifted(base, 0.01, 2.0)]
    over = sv.over_runs(runs)
    counts = [r["summary"]["p50"]["within_target"] for r in runs]
    assert counts[1] < counts[0]                     # run 2 is the bad one
    p50 = over["summary"]["p50"]
    assert p50["within_target_runs"] == counts
    assert p50["within_target"] == sorted(counts)[1]  # the median run, not the best
    assert isinstance(p50["within_target"], int)      # "17/24" where readme_numbers quotes it
    assert sv._median_count([14, 19]) == 16.5
    assert [p["steal_pct"] for p in over["per_run"]] == [1.0, 6.0, 2.0]
    case = over["cases"][0]
    first = base["groups"][0]
    assert case["errors"] == pytest.approx([first["error"], first["error"] + 0.5, first["error"] + 0.01])
    assert case["median_error"] == pytest.approx(first["error"] + 0.01)
    assert case["error_spread"] == pytest.approx(0.5)
    # the median errors are run 3's here: its count is theirs
    assert p50["median_error_within_target"] == counts[2]
    assert p50["median_error_spread"] == pytest.approx(0.5)


def test_a_results_file_of_several_runs_renders_each_run(tmp_path):
    base = _one_run()
    runs = [_shifted(base, 0.0, 1.0), _shifted(base, 0.5, 6.0)]
    result = sv.runs_result(runs, "python -m benchmarks.serving_validation --runs 2",
                            sv.common.machine_context())
    harness.write_json("serving_validation", result, tmp_path, sv.RAW_KEYS)
    assert harness.main(sv.BENCHMARK, ["--render", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "serving_validation.md").read_text()
    counts = [r["summary"]["p50"]["within_target"] for r in runs]
    cases = runs[0]["summary"]["p50"]["cases"]
    assert f"prediction within target in {counts[0]}/{cases}, {counts[1]}/{cases} cases" in text
    assert "\n#### Run 1 of 2\n" in text and "\n#### Run 2 of 2\n" in text
    assert "\n##### Results\n" in text and "\n## " not in text    # under docs/serving.md's ###
    assert "6.0% / 0.1%" in text                      # run 2's steal / iowait over serving
    assert "steal_pct" in result["context"]            # the whole window's (None if no tick passed)


def test_a_single_run_file_still_renders(tmp_path):
    """--render of a results file of one run (every file before --runs) is one run's
    Markdown, with the steal over serving where the file has it."""
    run = _one_run()
    (tmp_path / "serving_validation.json").write_text(json.dumps(run))
    assert harness.main(sv.BENCHMARK, ["--render", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "serving_validation.md").read_text()
    assert text == render.one_run(run) and "#### Run" not in text
    assert "prediction within target in" in text
    run["context"].update(steal_pct=2.5, iowait_pct=0.25)
    assert "hypervisor steal 2.5%, iowait 0.2% of the CPUs' time over serving" in render.one_run(run)


def test_runs_must_be_a_positive_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        harness.main(sv.BENCHMARK, ["--runs", "0", "--out", str(tmp_path)])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--runs: 0" in err[0] and "integer >= 1" in err[0]


def test_the_steps_table_shows_the_calibration_trial_of_the_decode_shape():
    """A run records each calibration trial's medians (`trials_measured`): the steps table
    sets the deployment's engine step beside the trial of the same decode shape."""
    run = _one_run()
    run["calibration"].pop("trials_measured", None)           # a file without them: as before
    assert "| calibration trial |" not in render.one_run(run)
    trial = {"number": 3, "chips": 2, "batch": 4, "prefill_ffn": "ws2d", "prefill_attn": "head",
             "decode_ffn": "ws1d", "decode_attn": "head", "prefill_s": 0.028,
             "decode_step_s": 0.00627, "decode_step_s_min": 0.0054, "decode_spread": 0.5,
             "decode_repeats": 12, "host_load_avg_1m": 2.1, "host_busy_frac": 0.97,
             "host_steal_frac": 0.0}
    run["calibration"]["trials_measured"] = [trial]
    assert sv.calibration_trial(run["calibration"], "dis-1+2chip-4slots") == trial
    assert sv.calibration_trial(run["calibration"], "dis-1+1chip-4slots") is None
    lines = render.one_run(run).splitlines()
    header = next(x for x in lines if "decode step predicted" in x)
    assert "| engine | calibration trial | loop |" in header
    row = next(x for x in lines if x.startswith("| dis-1+2chip-4slots |") and "6.27 ms (busy 97%)" in x)
    assert row.count("|") == header.count("|")
    other = next(x for x in lines if x.startswith("| agg-1chip-4slots |") and "ms / " in x)
    assert other.count("|") == header.count("|")


# ------------------------------------------- a partial run merges into the results file (issue 38)

STAGED = "agg-2chip-2stages-4slots"


def _partial(base: dict, cells: dict[tuple[str, float], tuple[str, float]], factor: float,
             profile: str | None = None) -> dict:
    """A run as `run` returns it for some cells: {(deployment, load): the committed cell
    whose rows it copies}, every measurement `factor` times theirs."""
    rows = []
    for (name, load), (src, src_load) in cells.items():
        for r in base["rows"]:
            if (r["deployment"], r["load"]) == (src, src_load):
                row = copy.deepcopy(r)
                row.update(deployment=name, load=load, profile=profile or base["profile"])
                row["measured"] = {k: v * factor if isinstance(v, float) else v
                                   for k, v in row["measured"].items()}
                rows.append(row)
    loads = sorted({load for _, load in cells})
    names = list(dict.fromkeys(name for name, _ in cells))
    return {**copy.deepcopy(base), "rows": rows, "groups": sv.groups(rows),
            "summary": sv.summarize(sv.groups(rows)), "steps": sv.deployment_steps(rows),
            "loads": loads, "wall_s": 60.0, "profile": profile or base["profile"],
            "command": f"python -m benchmarks.serving_validation --deployments {','.join(names)}",
            "context": {**base["context"], "time": "later"}}


def test_a_partial_run_replaces_its_cells_and_keeps_the_others():
    base = _one_run()
    # a run without the staged cell, whatever the committed results hold
    base["rows"] = [r for r in base["rows"] if r["deployment"] != STAGED]
    base["steps"] = [s for s in base["steps"] if s["deployment"] != STAGED]
    base.pop("merged", None)          # and no partial run merged into it yet
    new = _partial(base, {(STAGED, 0.35): ("agg-1chip-4slots", 0.35),
                          ("agg-2chip-8slots", 0.85): ("agg-2chip-8slots", 0.85)}, 1.5,
                   "elsewhere.yaml")
    merged = sv.merge_run(base, new)
    cells = {(r["deployment"], r["load"]) for r in merged["rows"]}
    assert cells == {(r["deployment"], r["load"]) for r in base["rows"]} | {(STAGED, 0.35)}
    assert len(merged["rows"]) == len(base["rows"]) + len(new["rows"]) // 2   # one cell new
    replaced = [r for r in merged["rows"] if (r["deployment"], r["load"]) == ("agg-2chip-8slots", 0.85)]
    assert replaced and all(r["profile"] == "elsewhere.yaml" for r in replaced)
    kept = [r for r in merged["rows"] if r["deployment"] == "agg-1chip-4slots"]
    assert kept and all(r["profile"] == base["profile"] for r in kept)   # predicted with its own
    assert {g["deployment"] for g in merged["groups"]} == {d for d, _ in cells}
    assert merged["summary"]["p50"]["cases"] == len(merged["groups"]) // 2
    assert merged["command"] == base["command"] and merged["calibration"] == base["calibration"]
    assert merged["merged"][-1]["deployments"] == ["agg-2chip-8slots", STAGED]
    assert STAGED in merged["features"] and STAGED in {s["deployment"] for s in merged["steps"]}
    again = sv.merge_run(merged, _partial(base, {(STAGED, 0.35): ("agg-1chip-4slots", 0.35)}, 2.0))
    assert len(again["rows"]) == len(merged["rows"]) and len(again["merged"]) == 2
    # the rows keep the deployments' order, whatever order the runs came in
    order = [list(sv.DEPLOYMENTS).index(r["deployment"]) for r in again["rows"]]
    assert order == sorted(order)
    text = render.one_run(again)
    assert STAGED in text and "Partial runs merged in since" in text and "(later)" in text


def _args(out, *flags):
    return harness.parser_for(sv.BENCHMARK).parse_args(["--out", str(out), *flags])


def test_deployments_runs_only_them_and_merges_into_the_results_file(tmp_path, monkeypatch):
    """`--deployments NAME --runs 3` into a folder with a results file of three runs: only
    NAME is served, each run predicted with the profile of the run it merges into (no
    calibration sweep), and the file keeps every other cell of every run."""
    previous = json.loads(COMMITTED.read_text())
    served = []

    def fake_run(n, calibration, names, loads, remeasure):
        served.append((names, loads, calibration["used"]))
        base = previous["runs"][len(served) - 1]
        return _partial(base, {(STAGED, load): ("agg-1chip-4slots", load) for load in loads or sv.LOADS},
                        1.1, calibration["used"])

    monkeypatch.setattr(sv, "run", fake_run)
    monkeypatch.setattr(sv, "calibrate", lambda *a, **k: pytest.fail("no calibration when merging"))
    result = sv.run_all(_args(tmp_path, "--deployments", STAGED, "--runs", "3"), previous)
    assert [s[0] for s in served] == [[STAGED]] * 3
    assert [s[2] for s in served] == [r["profile"] for r in previous["runs"]]
    written = json.loads((tmp_path / "serving_validation.json").read_text())
    assert len(written["runs"]) == 3 and written["command"] == previous["command"]
    for before, after in zip(previous["runs"], written["runs"]):
        cells = {(r["deployment"], r["load"]) for r in after["rows"]}
        assert cells == {(r["deployment"], r["load"]) for r in before["rows"]} | {
            (STAGED, load) for load in sv.LOADS}
    assert result["summary"]["p50"]["cases"] == len(written["runs"][0]["groups"]) // 2
    assert written["merged"][-1]["command"].endswith("--runs 3")


@pytest.mark.parametrize("flags,needle", [
    (["--deployments", STAGED], "--runs: 1"),                   # the file holds 3 runs
    (["--deployments", STAGED, "--runs", "3", "--requests", "8"], "--requests: 8"),
])
def test_a_partial_run_that_cannot_merge_is_one_line_before_any_work(tmp_path, capsys, flags,
                                                                      needle, monkeypatch):
    monkeypatch.setattr(sv, "run", lambda *a, **k: pytest.fail("nothing runs"))
    previous = json.loads(COMMITTED.read_text())
    with pytest.raises(SystemExit) as done:
        sv.run_all(_args(tmp_path, *flags), previous)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "accepted" in err[0], err


def test_the_staged_cell_is_predicted_as_sweeper_plan_prices_stages():
    """The pipeline-stage cell's prediction is the serving model's staged one (as `sweeper
    plan` prices a staged slice): a decode step is 2 stages of one layer, one after the
    other on the emulated mesh (one micro-batch of the 4 slots, each stage at the worker's
    whole share), plus the activations' transfer; a prefill call both stages in turn."""
    from workloads.serving import model as sm

    d = sv.deployment(STAGED, sv.common.ROOT / PROFILE)
    assert d.decode.stages == d.prefill.stages == 2 and d.decode.stage_chips == 1
    times = sm.cost_model_step_times(d)
    micro = sm.micro_batch(4, 2, d.hardware)
    stage = sm.phase_prediction(d, "decode", micro, 1, 40).latency_s
    assert micro == 4 and sm.micro_batch(4, 2) == 2      # real chips: 2 micro-batches
    whole = sm.stage_hardware(d.hardware, 1, 2)
    assert whole.peak_flops == pytest.approx(2 * sm.per_chip(d.hardware, 2).peak_flops)
    assert whole.hbm_bytes == pytest.approx(sm.per_chip(d.hardware, 2).hbm_bytes)
    assert times.decode_step_s(4, 40) == pytest.approx(
        sm.pipelined_s(stage, sm.stage_transfer_s(d, d.decode, micro), 2))
    first = sm.phase_prediction(d, "prefill", 1, 32).latency_s
    assert times.prefill_s(1, 32) == pytest.approx(
        sm.pipelined_s(first, sm.stage_transfer_s(d, d.prefill, 32), 2))
    assert "pipeline stages" in sv.features()[STAGED]
