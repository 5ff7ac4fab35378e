"""`sweeper max-context | predict | recommend`: the JSON contract and one-line errors (exit 2).

Runs the real command line in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PALM_64 = ["--model", "palm-540b-padded", "--hardware", "tpu-v4", "--chips", "64"]


def sweeper(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, timeout=120)


def run_json(*args: str) -> dict:
    result = sweeper(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_predict_json_contract():
    out = run_json("predict", *PALM_64, "--batch", "64", "--phase", "decode", "--context", "2048",
                   "--ffn", "ws2d", "--attn", "batch", "--weights", "int8", "--topology", "4x4x4")
    for key in ("latency_s", "compute_s", "memory_s", "comm_s", "mfu", "cost_chip_s_per_token",
                "weight_bytes_per_chip", "kv_bytes_per_chip", "comm_bytes_per_chip"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["fits"] is True
    assert out["topology"] == [4, 4, 4]
    assert out["source"] == "analytical"
    assert out["latency_s"] == pytest.approx(out["compute_s"] + out["memory_s"] + out["comm_s"])


def test_predict_fills_in_the_layout_it_was_not_given():
    out = run_json("predict", *PALM_64, "--batch", "512", "--phase", "decode", "--context", "2048")
    assert (out["ffn"], out["attn"]) == ("ws2d", "batch")
    assert out["layout_chosen_by"] == "recommended"


def test_recommend_json_contract():
    out = run_json("recommend", *PALM_64, "--batch", "1", "--phase", "prefill", "--input-len", "2048")
    assert out["ffn"] in ("ws1d", "ws2d") and out["attn"] in ("head", "batch")
    assert len(out["topology"]) == 3 and isinstance(out["latency_s"], float)
    assert out["source"] == "analytical"
    assert out["alternatives"][0]["ffn"] == out["ffn"]


def test_recommend_pads_the_paper_model_and_lists_what_it_rejects():
    """The issue's question on the unpadded 540B preset: 48 heads padded to 64 (auto), 2D
    weight-stationary with batch-sharded attention, and every rejection with its reason."""
    args = ["recommend", "--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64",
            "--batch", "64", "--phase", "decode", "--context", "2048"]
    out = run_json(*args)
    assert (out["ffn"], out["attn"], out["topology"]) == ("ws2d", "batch", [4, 4, 4])
    assert (out["heads"], out["unpadded_heads"], out["pad_heads"]) == (64, 48, "auto")
    assert out["padding_params"] > 17e9
    assert all({"ffn", "attn", "kind", "reason"} <= set(r) for r in out["rejected"])
    text = sweeper(*args)
    assert "48 padded to 64" in text.stdout and "rejected layouts" in text.stdout
    unpadded = run_json(*args, "--pad-heads", "none")
    assert unpadded["ffn"].startswith("wg")
    assert {r["kind"] for r in unpadded["rejected"]} >= {"heads do not divide"}


def test_pad_vocab_flag(tmp_path):
    """--pad-vocab auto answers a vocabulary of 50000 on 64 chips; none refuses it in one line
    naming the vocabulary's divisibility; a bad value names the flag."""
    path = tmp_path / "v50k.yaml"
    path.write_text("name: v50k\nd_model: 4096\nd_ff: 16384\nn_layers: 4\nn_heads: 32\n"
                    "n_kv_heads: 8\nd_head: 128\nvocab: 50000\n")
    args = ["recommend", "--model", str(path), "--hardware", "tpu-v4", "--chips", "64",
            "--batch", "64", "--phase", "decode"]
    answer = run_json(*args)
    assert answer["pad_vocab"] == "auto" and answer["latency_s"] > 0
    refused = sweeper(*args, "--pad-vocab", "none")
    assert_one_line_error(refused, "multiple of chips=64")
    assert_one_line_error(sweeper(*args, "--pad-vocab", "often"), "--pad-vocab", "often")


def test_predict_names_a_degenerate_layout_as_its_program():
    out = run_json("predict", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "8", "--batch", "8",
                   "--phase", "decode", "--ffn", "wg_x", "--attn", "head", "--topology", "1x4x2")
    assert out["ffn"] == "ws1d" and out["same_program_as"] == ["wg_x"]


def test_bad_pad_heads_is_one_line():
    result = sweeper("recommend", *PALM_64, "--batch", "64", "--phase", "decode", "--pad-heads", "many")
    assert_one_line_error(result, "--pad-heads", "many")


def test_max_context_json_contract():
    out = run_json("max-context", "--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64",
                   "--batch", "128", "--attn", "batch")
    assert isinstance(out["max_context"], int) and 41_700 <= out["max_context"] <= 44_300
    assert out["kv_bytes_per_token_per_chip"] > 0
    assert out["source"] == "analytical"


def test_tables_are_labelled_analytical():
    result = sweeper("recommend", *PALM_64, "--batch", "64", "--phase", "decode", "--context", "2048")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("analytical prediction")
    assert "alternatives" in result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess, *names: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0], lines[0]


def test_unknown_preset():
    result = sweeper("predict", "--model", "palm-9000b", "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "8", "--phase", "decode")
    assert_one_line_error(result, "--model", "palm-9000b")


def test_model_yaml_with_a_missing_field(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("d_ff: 512\nn_layers: 2\nn_heads: 8\nd_head: 16\nvocab: 256\n")
    result = sweeper("max-context", "--model", str(path), "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "8", "--attn", "head")
    assert_one_line_error(result, "d_model")


def test_non_positive_hardware_field(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("peak_flops: 1e12\nhbm_bandwidth: 0\nhbm_bytes: 16GiB\nici_bandwidth: 1e9\n")
    result = sweeper("max-context", "--model", "tiny", "--hardware", str(path), "--chips", "8",
                     "--batch", "8", "--attn", "head")
    assert_one_line_error(result, "hbm_bandwidth")


def test_non_positive_chips():
    result = sweeper("predict", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "0",
                     "--batch", "8", "--phase", "decode")
    assert_one_line_error(result, "--chips")


def test_topology_product_is_not_the_chip_count():
    result = sweeper("predict", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "8", "--phase", "decode", "--ffn", "ws2d", "--attn", "head",
                     "--topology", "2x2x1")
    assert_one_line_error(result, "--topology", "2x2x1", "chips=8")


def test_batch_not_divisible_for_batch_attention():
    result = sweeper("predict", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "6", "--phase", "decode", "--ffn", "ws2d", "--attn", "batch")
    assert_one_line_error(result, "batch", "6")


def test_batch_not_divisible_for_batch_attention_in_max_context():
    result = sweeper("max-context", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "6", "--attn", "batch")
    assert_one_line_error(result, "batch", "6")


def test_unknown_layout():
    result = sweeper("predict", "--model", "tiny", "--hardware", "tpu-v4", "--chips", "8",
                     "--batch", "8", "--phase", "decode", "--ffn", "ws3d", "--attn", "head")
    assert_one_line_error(result, "--ffn", "ws3d", "ws2d")


def test_formatting_units_and_table_alignment():
    from sweeper.formatting import format_table, human_bytes, human_seconds, percent

    assert human_bytes(32 * 2**30) == "32 GiB" and human_bytes(17.11e9, binary=False) == "17.1 GB"
    assert human_seconds(0.00254) == "2.54 ms" and human_seconds(71.4) == "71.4 s"
    assert percent(0.308) == "30.8%"
    table = format_table([{"ffn": "ws2d", "latency": 0.0134}, {"ffn": "wg_xyz", "latency": 2.5}],
                         formats={"latency": human_seconds}).splitlines()
    assert table[0].split() == ["ffn", "latency"]
    assert table[2].startswith("ws2d ") and table[2].endswith("13.4 ms")   # numbers right-aligned
    assert len(table[2]) == len(table[3])
