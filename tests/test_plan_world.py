"""`sweeper plan` on real hardware (issue 38): bands from presets fitted to published
measurements, several chips compared in one call with their prices, the frontier files of
--out-dir and the engines' launch lines. Real subprocesses where the user would type."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sweeper.serving import bands
from sweeper.serving.launch import launch_lines
from sweeper.serving.plan import PlanQuestion, plan
from workloads.config import PRICE_SOURCES, WORLD_CALIBRATION, load_hardware, load_model
from workloads.serving.profile import AppProfile, parse_length

QUESTION = ["--model", "llama2-70b", "--rate", "2", "--input-len", "512", "--output-len", "64",
            "--ttft", "1", "--tpot", "0.06", "--requests", "200", "--no-mlflow"]
HEAVY = ("jax", "ray", "mlflow", "optuna")
WRAPPER = """
import json, os, sys
from sweeper.cli import main
code = 1
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
finally:
    loaded = sorted({m.split('.')[0] for m in sys.modules} & set(%r))
    with open(os.environ['SWEEPER_TEST_IMPORTS'], 'w') as f:
        json.dump(loaded, f)
sys.exit(code)
""" % (HEAVY,)


def _sweeper(args, home, timeout=240):
    env = {**os.environ, "SWEEPER_HOME": str(home), "SWEEPER_TEST_IMPORTS": str(home / "imports.json")}
    return subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _profile(**changes) -> AppProfile:
    values = dict(rate=2.0, input_len=parse_length(512, "--input-len", None),
                  output_len=parse_length(64, "--output-len", None), ttft=1.0, tpot=0.06)
    return AppProfile(**{**values, **changes})


def test_a_plan_on_a_world_preset_says_what_its_band_rests_on():
    """The preset fitted to published measurements carries a band, so at_risk is decided."""
    q = PlanQuestion(load_model("llama2-70b"), load_hardware("h100-world"), _profile(), requests=200)
    result = plan(q)
    best = result.best.to_dict()
    c = WORLD_CALIBRATION["h100-world"]
    assert best["band"].startswith(f"calibrated against {c['points']} published points (")
    assert all(s in best["band"] for s in c["sources"]) and f"{c['points_on_chip']} on h100" in best["band"]
    assert best["at_risk"] in (True, False)
    low, high = best["tpot_p99_band_s"]
    assert low <= best["tpot_p99_s"] <= high
    assert result.to_dict()["calibration"] == bands.calibration_text(q.hardware)


def test_a_phase_with_too_few_residuals_takes_both_phases():
    few = {"prefill": [0.1] * 5, "decode": [-0.1, 0.2] * 10}
    hw = load_hardware({"peak_flops": 1e12, "hbm_bandwidth": 1e11, "hbm_bytes": 1e10,
                        "ici_bandwidth": 1e10, "heldout_residuals": few})
    b = bands.profile_bands(hw)
    assert b["decode"].status == "calibrated" and b["decode"].points == 20
    assert b["prefill"].status == "calibrated (both phases)" and b["prefill"].points == 25
    sheet = {k: 1e10 for k in ("peak_flops", "hbm_bandwidth", "hbm_bytes", "ici_bandwidth")}
    five = load_hardware({**sheet, "heldout_residuals": {"decode": [0.1] * 5}})
    assert not bands.profile_bands(five)["decode"].known      # 5 points: no band is invented
    one_phase = load_hardware({**sheet, "heldout_residuals": {"decode": [0.1] * 30}})
    assert bands.profile_bands(one_phase)["prefill"].status == "uncalibrated"   # none: none borrowed


def test_several_chips_in_one_call_with_their_prices_and_the_files(tmp_path):
    out = tmp_path / "frontier"
    proc = _sweeper(["plan", *QUESTION, "--hardware", "h100-world,tpu-v5e,h200",
                     "--price", "tpu-v5e=2.0", "--out-dir", str(out), "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by = {h["hardware"]: h for h in data["hardware"]}
    assert list(by) == ["h100-world", "tpu-v5e", "h200"]
    assert (by["tpu-v5e"]["price_per_chip_hour"], by["tpu-v5e"]["price_source"]) == (2.0, "--price")
    assert by["h100-world"]["price_source"] == PRICE_SOURCES["h100-world"] == "as h100"
    assert by["h200"]["price_source"] == PRICE_SOURCES["h200"]
    priced = {n: h["dollars_per_hour"] for n, h in by.items() if h["dollars_per_hour"] is not None}
    assert data["cheapest"] == min(priced, key=priced.get)
    for name, h in by.items():
        best = h["plan"]["best"]
        assert h["dollars_per_hour"] == pytest.approx(best["chips_total"] * h["price_per_chip_hour"])
        assert {line["engine"] for line in h["launch"]} == (
            {"jetstream"} if name.startswith("tpu") else {"vllm", "sglang"})
    rows = list(csv.DictReader((out / "frontier.csv").open()))
    assert {r["hardware"] for r in rows} == set(by)
    assert sum(r["best"] == "True" for r in rows) == len(by)
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p["hardware"] for p in json.loads((out / "plans.json").read_text())] == list(by)


def test_the_text_answer_names_the_cheapest_and_its_launch_line(tmp_path):
    proc = _sweeper(["plan", *QUESTION, "--hardware", "a100-80g-world,h100"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "cheapest plan per hardware" in out and "cheapest overall: " in out
    assert "(Google Cloud a3-highgpu-8g on-demand / 8, US regions (2024))" in out
    assert "vllm serve meta-llama/Llama-2-70b-hf --tensor-parallel-size" in out
    assert "calibrated against" in out      # a100-80g-world's band


def _plan(**changes) -> dict:
    part = dict(chips=4, replicas=1, ffn="ws1d", attn="head", batch=16, weights="bf16",
                topology="1x4x1")
    plan_dict = {"mode": "aggregated", "prefill": {**part, "batch": 2}, "decode": dict(part)}
    for key, value in changes.items():
        phase, field = key.split("_", 1)
        plan_dict[phase][field] = value
    return plan_dict


def test_launch_lines_run_a_megatron_plan_as_is_and_flag_what_engines_lack():
    model, profile = load_model("llama2-70b"), _profile()
    lines = {line["engine"]: line for line in launch_lines(_plan(), model, load_hardware("h100"), profile)}
    assert lines["vllm"]["lacks"] == [] and lines["sglang"]["lacks"] == []
    assert "--tensor-parallel-size 4 --max-num-seqs 16 --max-model-len 576" in lines["vllm"]["command"]
    assert "--no-enable-chunked-prefill" in lines["vllm"]["command"]
    assert "--tp 4 --max-running-requests 16" in lines["sglang"]["command"]
    (tpu,) = launch_lines(_plan(), model, load_hardware("tpu-v5e"), profile)
    assert "ici_tensor_parallelism=4 per_device_batch_size=4" in tpu["command"]
    flagged = launch_lines(_plan(decode_ffn="ws2d", decode_attn="batch", decode_weights="int8",
                                 decode_replicas=3), model, load_hardware("h100"), profile)[0]["lacks"]
    assert any("ws2d" in f for f in flagged) and any("batch-sharded" in f for f in flagged)
    assert any("int8" in f for f in flagged) and any("3 replicas" in f for f in flagged)
    disaggregated = {**_plan(), "mode": "disaggregated"}
    assert any("disaggregated" in f for f in launch_lines(disaggregated, model, load_hardware("h100"),
                                                          profile)[0]["lacks"])


@pytest.mark.parametrize("args,flag,accepted", [
    (["--hardware", "h100,,tpu-v5e"], "--hardware", "comma-separated"),
    (["--hardware", "h100,h100"], "--hardware", "each once"),
    (["--hardware", "h100,tpu-v5e", "--price", "h100=cheap"], "--price", "CHIP=DOLLARS"),
    (["--hardware", "h100,tpu-v5e", "--price", "a100-80g=2"], "--price", "a hardware planned"),
    (["--hardware", "h100", "--price", "tpu-v5e=2"], "--price", "a price for the hardware planned"),
    (["--hardware", "h100,tpu-v9"], "--hardware", "preset"),
    (["--hardware", "h100,tpu-v5e", "--out", "plan.json"], "--out", "one hardware"),
])
def test_bad_comparison_input_is_one_line_before_anything_heavy(tmp_path, args, flag, accepted):
    proc = _sweeper(["plan", *QUESTION, *args], tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and accepted in lines[0], proc.stderr
    assert json.loads((tmp_path / "imports.json").read_text()) == []
    assert not proc.stdout


def test_out_dir_must_be_a_folder(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    proc = _sweeper(["plan", *QUESTION, "--hardware", "h100", "--out-dir", str(taken)], tmp_path, timeout=60)
    assert proc.returncode == 2 and "--out-dir" in proc.stderr and "a folder" in proc.stderr
