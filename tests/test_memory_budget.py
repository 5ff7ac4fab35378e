"""Memory that is really there (issue 39, docs/models.md): a per-chip reserve for the runtime
and fragmentation, the model's context window enforced, and the KV capacity of each plan."""

import json

import pytest

from sweeper.cli import main
from sweeper.serving.plan import PlanQuestion, plan
from workloads import costmodel
from workloads.config import (HARDWARE_PRESETS, MODEL_PRESETS, ConfigError, HardwareProfile,
                              load_hardware, load_model)
from workloads.serving.profile import AppProfile, parse_length
from workloads.trial import TrialConfig


def profile(input_len=1024, output_len=128, rate=4.0, ttft=1.0, tpot=0.05):
    return AppProfile(rate=rate, input_len=parse_length(input_len, "x", None),
                      output_len=parse_length(output_len, "x", None), ttft=ttft, tpot=tpot)


def test_every_preset_reserves_a_tenth_of_its_hbm():
    for hw in HARDWARE_PRESETS.values():
        assert hw.memory_reserve == pytest.approx(0.1)
        assert hw.usable_hbm_bytes == pytest.approx(0.9 * hw.hbm_bytes)


def test_a_profile_file_overrides_the_reserve_and_bad_values_are_one_line():
    base = HARDWARE_PRESETS["h100"].to_dict()
    assert HardwareProfile.from_dict({**base, "memory_reserve": 0.05}).usable_hbm_bytes == \
        pytest.approx(0.95 * 80e9)
    with pytest.raises(ConfigError, match="memory_reserve: got 1.5; expected a fraction in"):
        HardwareProfile.from_dict({**base, "memory_reserve": 1.5})


def test_a_phase_that_fits_hbm_but_not_its_usable_part_does_not_fit():
    """Llama-2-70B's int8 weights (69 GB) on one 80 GB H100: the issue's case. A decode batch
    whose peak lies between the usable 72 GB and the whole 80 GB does not fit."""
    model, h100 = load_model("llama2-70b"), load_hardware("h100")
    pred = lambda hw, batch: costmodel.predict_phase(model, hw, 1, batch, "decode", 1, 4096,  # noqa: E731
                                                     weights="int8")
    between = next(b for b in range(1, 64) if h100.usable_hbm_bytes < pred(h100, b).peak_bytes_per_chip)
    assert pred(h100, between).peak_bytes_per_chip <= h100.hbm_bytes
    assert not pred(h100, between).fits
    no_reserve = HardwareProfile.from_dict({**h100.to_dict(), "memory_reserve": 0})
    assert pred(no_reserve, between).fits


def test_each_reported_plan_gives_its_memory_budget_and_kv_capacity():
    result = plan(PlanQuestion(load_model("llama2-70b"), load_hardware("h100"), profile(),
                               modes=("aggregated",), requests=100))
    best = result.to_dict()["best"]
    m = best["memory_per_chip"]["replica"]
    assert m["reserve_bytes"] == pytest.approx(8e9)
    used = m["weights_bytes"] + m["working_bytes"] + m["kv_bytes"]
    assert used + m["free_bytes"] == pytest.approx(m["hbm_bytes"] - m["reserve_bytes"])
    assert m["free_bytes"] >= 0
    assert m["kv_tokens"] == best["decode"]["batch"] * (1024 + 128)
    assert m["kv_bytes"] == pytest.approx(m["kv_tokens"] * m["kv_bytes_per_token"])
    room = m["hbm_bytes"] - m["reserve_bytes"] - m["weights_bytes"] - m["working_bytes"]
    assert m["kv_capacity_tokens"] == int(room // m["kv_bytes_per_token"]) >= m["kv_tokens"]


def test_a_larger_reserve_needs_more_chips(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    chips = {}
    for reserve in ("0.1", "0.6"):
        code = main(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "2",
                     "--input-len", "1024", "--output-len", "64", "--ttft", "2", "--tpot", "0.1",
                     "--mode", "aggregated", "--memory-reserve", reserve, "--requests", "100",
                     "--json", "--no-mlflow"])
        assert code == 0
        best = json.loads(capsys.readouterr().out)["best"]
        chips[reserve] = best["chips_total"]
        assert best["memory_per_chip"]["replica"]["reserve_bytes"] == pytest.approx(float(reserve) * 80e9)
    assert chips["0.6"] > chips["0.1"]
    assert main(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "2",
                 "--memory-reserve", "1", "--no-mlflow"]) == 2
    assert "--memory-reserve" in capsys.readouterr().err


def test_the_context_window_is_enforced_in_one_line(capsys, tmp_path, monkeypatch):
    """Llama-2-70B has a 4096-token window: --input-len 200000 is refused before searching."""
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    assert main(["plan", "--model", "llama2-70b", "--hardware", "h100", "--rate", "4",
                 "--input-len", "200000", "--output-len", "128", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--input-len: got 200000" in err and "4096 tokens" in err
    with pytest.raises(ConfigError, match="input_len: got 4000; expected .*4096"):
        TrialConfig.from_dict(dict(model="llama2-70b", chips=8, batch=1, input_len=4000,
                                   decode_steps=100))
    with pytest.raises(ConfigError, match="context: got 5000"):
        costmodel.predict_phase(MODEL_PRESETS["llama2-70b"], load_hardware("h100"), 8, 1,
                                "decode", 1, 5000)


def test_max_context_stops_at_the_window():
    h200 = load_hardware("h200")
    llama = costmodel.max_context(MODEL_PRESETS["llama2-70b"], h200, 8, 1, kv_fraction=0.9)
    assert (llama.max_context, llama.limited_by, llama.context_window) == (4096, "context window", 4096)
    palm = costmodel.max_context(MODEL_PRESETS["palm-540b"], HARDWARE_PRESETS["tpu-v4"], 64, 128)
    assert palm.limited_by == "memory" and palm.context_window is None


def test_max_context_fits_beside_the_weights_in_the_usable_hbm():
    """A KV fraction that the usable HBM cannot hold beside the weights is capped there."""
    llama, h100 = MODEL_PRESETS["llama3.1-8b"], load_hardware("h100")
    capped = costmodel.max_context(llama, h100, 1, 8, kv_fraction=1.0)
    weights = costmodel.weight_bytes_per_chip(llama, 1)
    assert capped.kv_budget_bytes_per_chip == pytest.approx(h100.usable_hbm_bytes - weights)
    assert costmodel.max_context(llama, h100, 1, 8, kv_fraction=0.3).kv_budget_bytes_per_chip \
        == pytest.approx(0.3 * h100.hbm_bytes)


def test_a_plan_names_its_reserve_and_where_it_comes_from(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_HOME", str(tmp_path))
    question = ["plan", "--model", "llama3.1-8b", "--rate", "2", "--input-len", "512",
                "--output-len", "64", "--mode", "aggregated", "--requests", "50", "--no-mlflow"]
    assert main([*question, "--hardware", "tpu-v5e"]) == 0
    out = capsys.readouterr().out
    assert "memory: 10% of each chip's HBM reserved" in out and "no TPU serving engine" in out
    assert main([*question, "--hardware", "h100", "--memory-reserve", "0.2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_reserve"] == {"share": 0.2,
                                                                     "source": "--memory-reserve"}
    hw = tmp_path / "chip.yaml"
    hw.write_text(json.dumps({**HARDWARE_PRESETS["h100"].to_dict(), "name": "my-chip",
                              "memory_reserve": 0.05}))
    assert main([*question, "--hardware", str(hw), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_reserve"] == {
        "share": 0.05, "source": "the hardware file's memory_reserve"}
