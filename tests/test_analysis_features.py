"""export, compare, the system metrics of a trial and `run --set`, on real small sweeps: a real
local Ray (actors running the JAX engine on an emulated mesh), a real SQLite Optuna study and
a real SQLite MLflow store. Two measured sweeps (the second made with `--set` overrides)
and one analytical sweep share one module; timings are never asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import ray  # noqa: E402 - a dependency: a broken install fails here, never skips
from requires import require  # noqa: E402

from sweeper.analysis import pareto  # noqa: E402
from sweeper.cli import main  # noqa: E402
from sweeper.tracking.results import COLUMNS, load_runs, load_trials  # noqa: E402
from workloads import hoststate  # noqa: E402

# ci_slow: three real sweeps in one module fixture, about 90 s (CI's second stage; keeps `make test` near 10 minutes on 2 cores)
pytestmark = pytest.mark.ci_slow

SPACE = {"name": "feat", "model": "tiny", "hardware": "host", "input_len": 8, "decode_steps": 2,
         "repeats": 2, "warmup": 1, "chips": 2, "parallel": 1, "timeout_s": 300,
         "memory_budget_bytes": "1GiB", "params": {"batch": [2, 4], "decode_ffn": ["ws1d", "ws2d"]},
         "sampler": {"type": "grid", "seed": 0}, "trials": 4}
ANALYTICAL = {"name": "feat-an", "model": "tiny", "hardware": "analytical:tpu-v4", "input_len": 8,
              "decode_steps": 2, "chips": 2, "params": {"batch": [2, 4]},
              "sampler": {"type": "grid", "seed": 0}, "trials": 2}


@pytest.fixture(scope="module")
def sweeps(session_sweeper_home, tmp_path_factory):
    """Studies `base` (the space as written) and `changed` (`--set params.batch=[4,8]`),
    measured, and `an` (analytical), in one Optuna store and one MLflow store."""
    root = tmp_path_factory.mktemp("feat")
    old = os.environ.get("SWEEPER_HOME")
    os.environ["SWEEPER_HOME"] = str(session_sweeper_home)     # host profile measured once
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    space, analytical = root / "feat.yaml", root / "feat-an.yaml"
    space.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    analytical.write_text(yaml.safe_dump(ANALYTICAL, sort_keys=False))
    stores = {"storage": f"sqlite:///{root / 'optuna.db'}", "tracking": f"sqlite:///{root / 'mlflow.db'}"}
    common = ["--storage", stores["storage"], "--tracking-uri", stores["tracking"], "--no-analysis",
              "--json"]
    try:
        assert main(["run", str(space), "--study", "base", *common]) == 0
        assert main(["run", str(space), "--study", "changed", "--set", "params.batch=[4,8]",
                     "--set", "trials=3", *common]) == 0
        assert main(["run", str(analytical), "--study", "an", *common]) == 0
        yield {**stores, "root": root}
    finally:
        if started:
            ray.shutdown()
        if old is None:
            os.environ.pop("SWEEPER_HOME", None)
        else:
            os.environ["SWEEPER_HOME"] = old


def complete(df: pd.DataFrame) -> pd.DataFrame:
    return df[df.state == "COMPLETE"]


# ----------------------------------------------------------------------------- --set


def test_overrides_reach_the_sweep_and_its_mlflow_parent_run(sweeps):
    from mlflow.tracking import MlflowClient

    base, changed = load_trials("base", sweeps["storage"]), load_trials("changed", sweeps["storage"])
    assert len(base) == 4 and len(changed) == 3
    assert set(base.batch) == {2, 4} and set(changed.batch) <= {4, 8} and 8 in set(changed.batch)
    parent = changed.mlflow_run_id.notna().any() and pareto.mlflow_parent_run("changed", sweeps["tracking"])
    client = MlflowClient(tracking_uri=sweeps["tracking"])
    text = Path(client.download_artifacts(parent, "feat.yaml", str(sweeps["root"] / "dl"))).read_text()
    assert "# --set params.batch=[4,8]" in text and yaml.safe_load(text)["params"]["batch"] == [4, 8]
    assert client.get_run(parent).data.params["trials"] == "3"


# ----------------------------------------------------------------------------- system metrics


def test_each_trial_records_load_steal_and_its_memory_high_water(sweeps):
    import psutil

    df = complete(load_trials("base", sweeps["storage"]))
    assert len(df) >= 2, load_trials("base", sweeps["storage"]).reason.tolist()
    # a JAX worker holds well over 50 MB resident, and never more than the machine has
    assert df.worker_rss_peak_bytes.between(50e6, psutil.virtual_memory().total).all()
    assert df.host_load_avg_1m.ge(0).all() and df.host_steal_frac.between(0, 1).all()
    # the same names as MLflow metrics of each child run, so the UI can filter on them
    runs = load_runs(sweeps["tracking"], parent_run_id=pareto.mlflow_parent_run("base", sweeps["tracking"]))
    runs = complete(runs).set_index("number")
    for _, row in df.iterrows():
        for name in ("worker_rss_peak_bytes", "host_load_avg_1m", "host_steal_frac"):
            assert runs.loc[row.number, name] == pytest.approx(row[name], rel=1e-12)


def test_memory_high_water_is_reset_per_interval():
    """The worker resets VmHWM before each trial: a later, smaller interval reports less."""
    require(hoststate.reset_peak_rss(), "this kernel does not allow resetting VmHWM (/proc/self/clear_refs)")
    before = hoststate.peak_rss_bytes()
    block = np.ones(200 * 2**20 // 8)          # 200 MiB, touched
    grown = hoststate.peak_rss_bytes()
    assert grown > before + 150 * 2**20
    del block
    assert hoststate.reset_peak_rss()
    assert hoststate.peak_rss_bytes() < grown - 150 * 2**20


# ----------------------------------------------------------------------------- export


def test_export_writes_the_whole_trial_table(sweeps, tmp_path, capsys):
    expected = load_trials("base", sweeps["storage"])
    csv, parquet = tmp_path / "base.csv", tmp_path / "base.parquet"
    assert main(["export", "--study", "base", "--storage", sweeps["storage"], "--out", str(csv)]) == 0
    assert main(["export", "--study", "base", "--storage", sweeps["storage"], "--format", "parquet",
                 "--out", str(parquet)]) == 0
    assert "4 trials x" in capsys.readouterr().out
    from_parquet = pd.read_parquet(parquet)
    pd.testing.assert_frame_equal(from_parquet, expected)        # types kept: Int64, floats, strings
    from_csv = pd.read_csv(csv)
    assert list(from_csv.columns) == list(COLUMNS)
    for col in ("number", "state", "batch", "decode_ffn", "mlflow_run_id"):
        assert from_csv[col].astype(str).tolist() == expected[col].astype(str).tolist()
    for col in ("decode_step_s", "pred_decode_step_s", "worker_rss_peak_bytes"):
        np.testing.assert_allclose(from_csv[col], expected[col].astype(float), rtol=1e-12)
    # stdout for CSV; Parquet needs a file; a study that does not exist: exit 2, one line
    assert main(["export", "--study", "base", "--storage", sweeps["storage"], "--out", "-"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ",".join(COLUMNS)
    for bad in (["--study", "base", "--format", "parquet", "--out", "-"], ["--study", "nope"]):
        assert main(["export", *bad, "--storage", sweeps["storage"]]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- compare


def test_compare_two_studies(sweeps, tmp_path, capsys):
    a, b = load_trials("base", sweeps["storage"]), load_trials("changed", sweeps["storage"])
    assert main(["compare", "base", "changed", "--storage", sweeps["storage"], "--out", str(tmp_path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["phases"]) == {"prefill", "decode"}
    for phase, comp in out["phases"].items():
        x, y = pareto.resolve_axes(phase)
        both = pd.concat([complete(a), complete(b)])
        reference = (both[x].max() * 1.1, both[y].max() * 1.1)          # one reference for both
        assert comp["reference"] == pytest.approx(list(reference))
        hv_a = pareto.analyse(a, phase, reference=reference).hypervolume
        hv_b = pareto.analyse(b, phase, reference=reference).hypervolume
        assert comp["hypervolume_a"] == pytest.approx(hv_a) and comp["hypervolume_b"] == pytest.approx(hv_b)
        assert comp["hypervolume_change"] == pytest.approx(hv_b - hv_a)
        layouts = {r["layout"]: r for r in comp["layouts"]}
        for label, df, side in ((lambda r: f"{r[phase + '_ffn']}/{r[phase + '_attn']}", a, "a"),
                                (lambda r: f"{r[phase + '_ffn']}/{r[phase + '_attn']}", b, "b")):
            done = complete(df)
            medians = done.groupby(done.apply(label, axis=1))[x].median()
            for layout, median in medians.items():
                assert layouts[layout][f"median_{side}"] == pytest.approx(median)
        for row in comp["layouts"]:
            if row["median_a"] and row["median_b"]:
                assert row["change"] == pytest.approx(row["median_b"] / row["median_a"] - 1)
        png = Path(out["figures"][phase])
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    assert main(["compare", "base", "changed", "--storage", sweeps["storage"]]) == 0
    text = capsys.readouterr().out
    assert "changed vs base" in text and "decode:" in text and "ws1d/head" in text
    # measured against analytical: refused, one line, exit 2
    assert main(["compare", "base", "an", "--storage", sweeps["storage"]]) == 2
    assert "never compared" in capsys.readouterr().err
