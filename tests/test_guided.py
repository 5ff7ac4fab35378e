"""`sampler: guided`: the cost model's recommended points first, then TPE / NSGA-II.

Analytical spaces only (no hardware, no Ray): the seeds must contain the exhaustive grid's
predicted frontier, a guided sweep must run them first through the real controller
(Optuna SQLite storage, MLflow store), and resuming must not seed twice.
"""

import itertools

import optuna
import pytest

from sweeper.spec import guided
from sweeper.sweep.controller import run_sweep
from sweeper.spec.space import load_space
from workloads.config import ConfigError
from workloads.costmodel import feasibility, predict

SPACE = {
    "name": "guided-540b", "model": "palm-540b-padded", "hardware": "analytical:tpu-v4",
    "input_len": 2048, "decode_steps": 64, "prefill": {"ffn": "ws2d"},
    "params": {"batch": [1, 4, 16, 64, 256], "chips": [32, 64], "decode_ffn": ["ws1d", "ws2d"],
               "attn": ["head", "batch"], "weights": ["bf16", "int8"]},
    "sampler": {"type": "guided", "seed": 0}, "trials": 16, "parallel": 1,
}


def space(**changes):
    return load_space({**SPACE, **changes}, source="tests/test_guided.py")


def grid_front(sp) -> set[tuple[float, float]]:
    """Every grid point predicted, infeasible ones dropped, the non-dominated values kept."""
    profile = sp.hardware.load_profile()
    grid = sp.grid()
    values = []
    for combo in itertools.product(*grid.values()):
        try:
            config = sp.trial_config(dict(zip(grid, combo)))
        except ConfigError:
            continue
        if feasibility(config, profile):
            continue
        m = predict(config, profile)
        values.append((m.decode_step_s, m.decode_cost_chip_s_per_token))
    ranks = guided.non_dominated_ranks([list(v) for v in values])
    return {v for v, r in zip(values, ranks) if r == 0}


def test_the_sampler_is_accepted_with_its_options_and_bad_ones_are_rejected():
    assert space().sampler.type == "guided"
    assert isinstance(space().make_sampler(), guided.GuidedSampler)
    nsga = space(sampler={"type": "guided", "seed": 1, "options": {"base": "nsga2", "fronts": 1}})
    assert isinstance(nsga.make_sampler()._base, optuna.samplers.NSGAIISampler)
    with pytest.raises(ConfigError, match="base"):
        space(sampler={"type": "guided", "options": {"base": "grid"}})
    with pytest.raises(ConfigError, match="sampler.options"):
        space(sampler={"type": "guided", "options": {"n_seeds": 3}})
    with pytest.raises(ConfigError, match="fronts"):
        space(sampler={"type": "guided", "options": {"fronts": 0}})


def test_seeds_contain_the_exhaustive_grids_predicted_frontier():
    sp = space()
    seeds = guided.seed_points(sp, fronts=1, max_seeds=100)
    front = grid_front(sp)
    assert front and {tuple(s.predicted) for s in seeds} == front
    # fewer points than the grid, each a recommend() pick: ws2d with int8 for PaLM 540B on
    # 32-64 chips, batch-sharded attention once the batch is large (paper Table 2)
    assert len(seeds) < sp.grid_size() // 5
    assert all(s.params["decode_ffn"] == "ws2d" and s.params["weights"] == "int8" for s in seeds)
    by_batch = {s.params["batch"]: s.params["attn"] for s in seeds}
    assert by_batch[1] == "head" and by_batch[max(by_batch)] == "batch"
    # a second front is appended after the first, never before it
    two = guided.seed_points(sp, fronts=2, max_seeds=100)
    assert [s.params for s in two[:len(seeds)]] == [s.params for s in seeds] and len(two) > len(seeds)


def test_a_guided_sweep_runs_the_seeds_first_then_its_base_sampler(sweeper_home):
    sp = space()
    seeds = [s.params for s in guided.seed_points(sp)]
    assert 0 < len(seeds) < sp.trials
    result = run_sweep(sp, progress=False)
    trials = sorted(result.study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert len(trials) == sp.trials
    assert [t.params for t in trials[:len(seeds)]] == seeds
    assert result.study.user_attrs[guided.SEEDED_ATTR] == seeds
    assert all(t.state.name == "COMPLETE" for t in trials[:len(seeds)])     # all feasible picks
    # the frontier of the seeded trials is the grid's predicted frontier
    seeded = {tuple(t.values) for t in trials[:len(seeds)]}
    assert grid_front(sp) <= seeded
    # resuming continues with the base sampler: nothing is enqueued again
    more = run_sweep(sp, study_name=result.study_name, resume=True, trials=sp.trials + 3, progress=False)
    all_trials = more.study.get_trials(deepcopy=False)
    assert len(all_trials) == sp.trials + 3
    fixed = [t for t in all_trials if t.system_attrs.get("fixed_params")]
    assert len(fixed) == len(seeds)


def test_one_chip_is_seeded_though_the_space_does_not_list_ws1d():
    """On one chip every layout is the same program and recommend names it ws1d; a space
    whose prefill layouts are ws2d/wg_* (the calibration sweep's) must still get a one-chip
    seed, labelled with a layout it allows, else guided never tries the cheapest point."""
    sp = load_space({"name": "one-chip", "model": "calib", "hardware": "analytical:tpu-v4",
                     "input_len": 64, "decode_steps": 8,
                     "params": {"chips": [1, 2], "batch": [8], "prefill_ffn": ["ws2d", "wg_xy"],
                                "decode_ffn": ["ws1d", "ws2d"], "attn": ["head", "batch"]},
                     "objectives": [{"metric": "prefill_s", "direction": "minimize"}],
                     "sampler": {"type": "guided", "seed": 0}, "trials": 4, "parallel": 1},
                    source="tests/test_guided.py")
    seeds = [s.params for s in guided.seed_points(sp, fronts=5, max_seeds=10)]
    one_chip = [p for p in seeds if p["chips"] == 1]
    assert len(one_chip) == 1, seeds
    assert one_chip[0]["prefill_ffn"] in ("ws2d", "wg_xy")
    sp.trial_config(one_chip[0])      # a valid trial of the space
