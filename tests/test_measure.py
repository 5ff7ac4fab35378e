"""run_trial on a tiny model: finite metrics that mean what docs/architecture.md says, the compile
cache, verification against the reference, and the cached host profile."""

import dataclasses
import math

import pytest
import yaml

from workloads.hardware import per_chip
from workloads import costmodel, hostprofile
from workloads.config import ConfigError
from workloads.measure import (MIN_CI_SAMPLES, cache_key, ci_rel, compile_trial, median_ci,
                               repeat_until_precise, run_once, run_trial)
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

ATOL = 0.1   # as the engine's equivalence test: bf16 rounding ~0.03, a wrong layout O(1)

# The shape of test_comm_pattern's first case, with a few timed decode steps.
SPEC = dict(model="tiny", chips=4, topology="2x2x1", batch=4, input_len=8, decode_steps=3,
            prefill={"ffn": "wg_xy", "attn": "head"}, decode={"ffn": "ws2d", "attn": "batch"},
            repeats=6, warmup=1, time_budget_s=0.5)


@pytest.fixture(scope="module")
def measured(session_sweeper_home):
    """One measured trial with a fresh cache (module-wide: it is the expensive part)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SWEEPER_HOME", str(session_sweeper_home))
    try:
        cache: dict = {}
        trial = TrialConfig.from_dict(SPEC)
        yield trial, run_trial(trial, cache), cache
    finally:
        mp.undo()


def test_every_metric_is_finite_and_labelled(measured):
    trial, m, _ = measured
    assert (m.source, m.hardware) == ("measured", "host")
    assert m.extra["emulated_mesh"] is True and "this host" in m.extra["note"]
    for name in ("prefill_s", "prefill_s_min", "prefill_s_max", "decode_step_s", "decode_step_s_min",
                 "decode_step_s_max", "total_s", "compile_s", "prefill_mfu", "decode_mfu",
                 "prefill_cost_chip_s_per_token", "decode_cost_chip_s_per_token",
                 "prefill_tokens_per_s", "decode_tokens_per_s", "weight_bytes_per_chip",
                 "kv_bytes_per_chip", "peak_bytes_per_chip", "prefill_comm_bytes_per_chip",
                 "decode_comm_bytes_per_chip"):
        value = getattr(m, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert m.extra["compile_cache_hit"] is False
    # Not measured, so left NaN: the analytical breakdown and verification.
    assert math.isnan(m.prefill_compute_s) and m.tokens_match is None


def test_timings_are_ordered_and_total_covers_every_step(measured):
    trial, m, _ = measured
    assert m.prefill_s_min <= m.prefill_s <= m.prefill_s_max
    assert m.decode_step_s_min <= m.decode_step_s <= m.decode_step_s_max
    # total = prefill + handoff + every decode step, for the median repeat
    assert m.total_s >= m.prefill_s_min + trial.decode_steps * m.decode_step_s_min


def test_mfu_and_cost_follow_the_design_definitions(measured):
    """mfu = model FLOPs / (n x peak per chip x s), peak = this host's split over n chips;
    cost = n x s / tokens (paper §4)."""
    trial, m, _ = measured
    n, b, length = trial.chips, trial.batch, trial.input_len
    peak_per_chip = hostprofile.host_profile().peak_flops / n
    prefill_flops = b * length * costmodel.model_flops_per_token(trial.model, length)
    context = length + trial.decode_steps / 2
    decode_flops = b * costmodel.model_flops_per_token(trial.model, context)
    assert m.prefill_mfu == pytest.approx(prefill_flops / (n * peak_per_chip * m.prefill_s))
    assert m.decode_mfu == pytest.approx(decode_flops / (n * peak_per_chip * m.decode_step_s))
    assert m.prefill_cost_chip_s_per_token == pytest.approx(n * m.prefill_s / (b * length))
    assert m.decode_cost_chip_s_per_token == pytest.approx(n * m.decode_step_s / b)
    assert m.decode_tokens_per_s == pytest.approx(b / m.decode_step_s)


def test_memory_from_the_compiled_program_matches_the_stored_layout(measured):
    trial, m, _ = measured
    model_weights = costmodel.weight_bytes_per_chip(trial.model, trial.chips, trial.weights,
                                                    trial.mesh_shape)
    # The engine also stores the norm scales (replicated, E values each), which the
    # cost model leaves out: a few hundred bytes here.
    norms = (trial.model.n_layers + 1) * trial.model.d_model * 2
    assert m.weight_bytes_per_chip == pytest.approx(model_weights + norms, rel=0.01)
    assert m.kv_bytes_per_chip == costmodel.kv_bytes_per_chip(
        trial.model, trial.chips, trial.batch, trial.context_len, "batch", trial.mesh_shape, "ws2d")
    assert m.peak_bytes_per_chip >= m.weight_bytes_per_chip + m.kv_bytes_per_chip


def test_collectives_are_reported_per_phase(measured):
    _, m, _ = measured
    kinds = {phase: {s.kind for s in stats} for phase, stats in m.collectives.items()}
    assert "all-to-all" in kinds["decode"] and "all-to-all" not in kinds["prefill"]
    decode_bytes = sum(s.bytes_per_chip for s in m.collectives["decode"])
    assert decode_bytes == m.decode_comm_bytes_per_chip
    # survives the JSON-ish round trip the workers and MLflow use
    assert Measurement.from_dict(m.to_dict()).collectives == m.collectives


def test_a_repeated_shape_hits_the_compile_cache(measured, shared_sweeper_home):
    trial, first, cache = measured
    other_seed = dataclasses.replace(trial, seed=1, repeats=1, warmup=0)
    assert cache_key(other_seed) == cache_key(trial)
    m = run_trial(other_seed, cache, verify=True)
    assert m.extra["compile_cache_hit"] is True and m.compile_s == 0.0
    assert len(cache) == 1
    # the cached programs run the new seed's weights: the reference rebuilt from seed 1 agrees
    assert m.tokens_match is True and m.verify_max_abs_err <= ATOL


def test_verify_matches_the_reference(measured, shared_sweeper_home):
    trial, _, cache = measured
    m = run_trial(dataclasses.replace(trial, repeats=1), cache, verify=True)
    assert m.tokens_match is True
    assert 0 <= m.verify_max_abs_err <= ATOL
    assert m.extra["verify_steps"] == trial.decode_steps + 1
    assert math.isnan(m.int8_max_logit_dev)


def test_verify_int8_reports_the_quantisation_deviation(shared_sweeper_home, engine_cache):
    spec = dict(SPEC, model="tiny-serial", topology="2x1x2", weights="int8", repeats=1, warmup=0,
                decode_steps=2, prefill={"ffn": "wg_xyz", "attn": "head"})
    m = run_trial(TrialConfig.from_dict(spec), engine_cache, verify=True)
    assert m.tokens_match is True and m.verify_max_abs_err <= ATOL
    assert 0 < m.int8_max_logit_dev < 1.0   # int8 differs from bf16, but only slightly


def test_too_few_devices_is_a_config_error(shared_sweeper_home):
    wg = {"ffn": "wg_xyz", "attn": "head"}   # valid for tiny on 16 chips
    trial = TrialConfig.from_dict(dict(SPEC, chips=16, topology="4x2x2", batch=16, prefill=wg, decode=wg))
    with pytest.raises(ConfigError, match="chips"):
        run_trial(trial, {})


# --------------------------------------------------------------------------- host profile


def test_host_profile_is_measured_once_and_cached(sweeper_home, monkeypatch):
    calls = []
    real_measure = hostprofile.measure

    def counting_measure():
        calls.append(1)
        return real_measure()

    monkeypatch.setattr(hostprofile, "measure", counting_measure)
    first = hostprofile.host_profile()
    second = hostprofile.host_profile()
    assert len(calls) == 1 and first == second
    assert first.name == "host" and first.measured is True
    assert first.peak_flops > 0 and first.hbm_bandwidth > 0 and first.ici_bandwidth > 0
    assert first.hbm_bytes == hostprofile.physical_memory_bytes()
    cached = yaml.safe_load((sweeper_home / "host_profile.yaml").read_text())
    entry = cached[hostprofile.host_key()]
    assert entry["profile"]["peak_flops"] == first.peak_flops
    assert "ici_measured_as" in entry["notes"]
    hostprofile.host_profile(refresh=True)
    assert len(calls) == 2


def test_per_chip_splits_the_host_evenly(sweeper_home):
    profile = hostprofile.HardwareProfile("host", 8e11, 4e10, 64e9, 2e10, measured=True)
    chip = per_chip(profile, 8)
    assert (chip.peak_flops, chip.hbm_bandwidth, chip.hbm_bytes, chip.ici_bandwidth) == (1e11, 5e9, 8e9, 2.5e9)
    assert per_chip(profile, 1) == profile
    # a worker owning half the host's cores: half the compute and bandwidth, memory split by chips only
    half = per_chip(profile, 2, share=0.5)
    assert (half.peak_flops, half.hbm_bandwidth, half.hbm_bytes) == (2e11, 1e10, 32e9)


# --------------------------------------------------------------------------- noise


def test_median_ci_is_the_order_statistic_interval():
    """n = 10: the classic table's interval is (x(2), x(9)), covering the median with
    probability 1 - 2 * P(Binom(10, 1/2) <= 1) = 97.9%; the narrower (x(3), x(8)) covers
    only 89.1%, under 95%."""
    from scipy import stats

    samples = [7.0, 1.0, 9.0, 3.0, 10.0, 5.0, 2.0, 8.0, 4.0, 6.0]   # order does not matter
    assert median_ci(samples) == (2.0, 9.0)
    assert 1 - 2 * stats.binom.cdf(1, 10, 0.5) >= 0.95 > 1 - 2 * stats.binom.cdf(2, 10, 0.5)
    assert ci_rel(samples) == pytest.approx((9.0 - 2.0) / 2 / 5.5)
    # six samples: the widest interval (x(1), x(6)) covers 96.9%; five cannot reach 95%
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    assert all(math.isnan(v) for v in median_ci([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert ci_rel([1.0] * (MIN_CI_SAMPLES - 1)) == math.inf
    assert ci_rel([2.0] * MIN_CI_SAMPLES) == 0.0


def test_median_ci_is_scipy_quantile_tests_interval():
    """`median_ci` reads the binomial's CDF (scipy.special) instead of importing scipy.stats
    in every worker: the same interval as `scipy.stats.quantile_test` for every sample count
    a trial reaches and the confidences in use, ties included."""
    import numpy as np
    from scipy import stats

    rng = np.random.default_rng(0)
    for n in [*range(1, 300), 511, 1000, 2047, 4000]:
        samples = rng.lognormal(size=n).round(1)        # rounded: ties, like a timer's
        for confidence in (0.9, 0.95, 0.99):
            ci = stats.quantile_test(samples, q=float(np.median(samples)), p=0.5
                                     ).confidence_interval(confidence)
            ours = median_ci(samples, confidence) if n >= MIN_CI_SAMPLES else (math.nan,) * 2
            expected = (ci.low, ci.high) if n >= MIN_CI_SAMPLES else (math.nan,) * 2
            assert np.array_equal(ours, expected, equal_nan=True), (n, confidence, ours, expected)


class FakeClock:
    """Seconds that advance only when a run happens (each run takes one second)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_adaptive_repeats_stop_once_the_ci_meets_the_target():
    clock = FakeClock()
    # The first runs are disturbed, later ones quiet: the CI narrows as quiet runs pile up.
    values = iter([1.0, 1.6, 0.7, 1.4, 1.0, 1.01, 0.99] + [1.0] * 100)

    def run():
        clock.now += 1.0
        return next(values)

    def precise(results):
        return ci_rel(results) <= 0.02

    results = repeat_until_precise(run, precise, min_runs=3, budget_s=1000, clock=clock)
    first_precise = next(n for n in range(1, 108) if ci_rel(
        ([1.0, 1.6, 0.7, 1.4, 1.0, 1.01, 0.99] + [1.0] * 100)[:n]) <= 0.02)
    assert len(results) == first_precise
    assert MIN_CI_SAMPLES <= len(results) < 100 and ci_rel(results) <= 0.02


def test_adaptive_repeats_stop_at_the_time_budget():
    clock = FakeClock()

    def run():
        clock.now += 1.0
        return 1.0 if int(clock.now) % 2 else 1.5    # never within 2%

    results = repeat_until_precise(run, lambda r: ci_rel(r) <= 0.02, min_runs=3, budget_s=10,
                                   clock=clock)
    assert len(results) == 10
    # at least min_runs, even when the budget is already spent
    assert len(repeat_until_precise(run, lambda r: True, min_runs=4, budget_s=0, clock=clock)) == 4


def test_every_measurement_carries_its_noise_and_the_host_state(measured):
    trial, m, _ = measured
    assert m.prefill_repeats == m.decode_repeats == m.extra["repeats"] >= trial.repeats
    assert m.prefill_repeats >= MIN_CI_SAMPLES        # repeats=6: a CI exists
    assert 0 <= m.prefill_ci_rel < math.inf and 0 <= m.decode_ci_rel < math.inf   # a loaded host: > 1
    # stopped by the CI target or by the budget (overrun by at most one run)
    assert (max(m.prefill_ci_rel, m.decode_ci_rel) <= trial.ci_target
            or m.measure_s >= trial.time_budget_s)
    assert m.prefill_spread == pytest.approx((m.prefill_s_max - m.prefill_s_min) / m.prefill_s)
    assert m.host_load_avg_1m >= 0 and m.host_involuntary_switches >= 0
    assert 0 <= m.host_steal_frac <= 1 and 0 <= m.host_busy_frac <= 1
    for name in ("prefill_ci_rel", "decode_ci_rel", "prefill_repeats", "host_load_avg_1m",
                 "host_steal_frac", "host_involuntary_switches", "measure_s"):
        assert name in m.metrics()          # what MLflow and Optuna's user attrs receive


def test_decode_is_timed_as_one_run_of_back_to_back_steps(measured, monkeypatch):
    """A run's decode time covers all its steps, and the steps are dispatched back to back:
    no step waits for the device or takes the previous token off it before the next is
    queued (engine.decode_loop; the run synchronises once, after the last step). Which of two ways
    is faster is a benchmark's question, not a test's."""
    import jax

    from workloads import engine as engine_module

    trial, _, cache = measured
    entry, _ = compile_trial(trial, cache)
    run = run_once(entry, trial)
    assert run.steps == trial.decode_steps and run.decode_s > 0
    assert run.decode_step_s * run.steps == pytest.approx(run.decode_s)

    engine, decode = entry.engine, entry.compiled["decode"]
    logits, kv = entry.compiled["prefill"](engine.params, engine.input_tokens())
    kv = engine.handoff(kv)
    token = jax.block_until_ready(engine.greedy(logits))

    syncs, seen = [], []
    real_block = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (syncs.append(1), real_block(x))[1])

    def step(params, cache_, tok, pos):
        seen.append((len(syncs), isinstance(tok, jax.Array)))
        return decode(params, cache_, tok, pos)

    out = engine_module.decode_loop(step, engine.greedy, engine.params, kv, token, engine.positions())
    # no step waited for the previous one, and each got the previous token as a device array
    assert seen == [(0, True)] * trial.decode_steps
    assert len(out.tokens) == trial.decode_steps and all(isinstance(t, jax.Array) for t in out.tokens)


# --------------------------------------------------------------------------- settings


def test_measurement_settings_come_from_the_space_file(tmp_path):
    from sweeper.spec.space import load_space

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "model": "tiny", "hardware": "host", "chips": 2, "batch": 4,
        "ci_target": 0.05, "time_budget_s": 3, "params": {"seed": [0, 1]},
        "sampler": {"type": "grid"}}))
    space = load_space(str(path))
    trials = [space.trial_config({"seed": seed}) for seed in (0, 1)]
    assert [(t.ci_target, t.time_budget_s, t.seed) for t in trials] == [(0.05, 3.0, 0), (0.05, 3.0, 1)]
    assert cache_key(trials[0]) == cache_key(trials[1])   # replicates share compiled programs


@pytest.mark.parametrize("field, value", [("ci_target", -0.1), ("time_budget_s", "soon"),
                                          ("ci_target", float("nan"))])
def test_bad_measurement_settings_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=field):
        TrialConfig.from_dict(dict(SPEC, **{field: value}))


def test_calibration_space_meets_its_design():
    """Every point runs; >= 10 ranking groups (phase, chips, batch) with >= 2 layouts;
    every configuration replicated; one chip's prefill and decode big enough to time."""
    import itertools
    from collections import defaultdict

    from sweeper.spec.space import load_space

    space = load_space("search_spaces/calibration.yaml")
    names = [p.name for p in space.params]
    trials = [space.trial_config(dict(zip(names, values)))
              for values in itertools.product(*(p.grid_values() for p in space.params))]
    assert len(trials) == space.planned_trials() == 192
    layouts = defaultdict(set)
    replicates = defaultdict(set)
    for t in trials:
        for phase in ("prefill", "decode"):
            layout = getattr(t, phase)
            if t.chips > 1:
                layouts[(phase, t.chips, t.batch)].add((layout.ffn, layout.attn))
        replicates[cache_key(t)].add(t.seed)
    assert sum(len(v) >= 2 for v in layouts.values()) >= 10
    assert all(seeds == {0, 1} for seeds in replicates.values())
    assert {t.chips for t in trials} == {1, 2, 4, 8}
    assert {t.decode.attn for t in trials} == {"head", "batch"}
    assert {t.model.name for t in trials} == {"calib"}
