"""run_trial on a tiny model: finite metrics that mean what docs/architecture.md says, the compile
cache, verification against the reference, and the cached host profile."""

import dataclasses
import math

import pytest
import yaml

from workloads.hardware import per_chip
from workloads import costmodel, hostprofile
from workloads.config import ConfigError
from workloads.measure import cache_key, run_trial
from workloads.metrics import Measurement
from workloads.trial import TrialConfig

ATOL = 0.1   # as the engine's equivalence test: bf16 rounding ~0.03, a wrong layout O(1)

# The shape of test_comm_pattern's first case, with a few timed decode steps.
SPEC = dict(model="tiny", chips=4, topology="2x2x1", batch=4, input_len=8, decode_steps=3,
            prefill={"ffn": "wg_xy", "attn": "head"}, decode={"ffn": "ws2d", "attn": "batch"},
            repeats=2, warmup=1)


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
