"""`sweeper trial` and `sweeper host-profile` on the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sweeper.cli import main
from sweeper.cli.trial import xla_flags_with_devices
from workloads.metrics import METRIC_NAMES, Measurement

REPO = Path(__file__).resolve().parents[1]
TINY = dict(model="tiny", chips=2, topology="2x1x1", batch=2, input_len=4, decode_steps=2,
            prefill={"ffn": "wg_x", "attn": "head"}, decode={"ffn": "ws2d", "attn": "batch"},
            repeats=1, warmup=0)


def write(tmp_path, data, name="trial.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


def run_cli(args, env_extra=None, prelude=""):
    """`sweeper ...` in a fresh interpreter; also reports whether JAX got imported."""
    code = (f"import sys\n{prelude}\nfrom sweeper.cli import main\nrc = main({args!r})\n"
            "print('JAX_IMPORTED=' + str('jax' in sys.modules), file=sys.stderr)\nsys.exit(rc)")
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_trial_json_with_verify(tmp_path, capsys, shared_sweeper_home):
    rc = main(["trial", "--config", str(write(tmp_path, TINY)), "--verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"source", "hardware", "collectives", "extra"} <= set(out)
    assert set(METRIC_NAMES) <= set(out)
    assert out["source"] == "measured" and out["hardware"] == "host"
    assert out["tokens_match"] is True and out["verify_max_abs_err"] <= 0.1
    assert out["int8_max_logit_dev"] is None          # NaN is written as null
    assert out["prefill_s"] > 0 and out["decode_step_s"] > 0 and out["compile_s"] > 0
    assert {s["kind"] for s in out["collectives"]["decode"]} >= {"all-to-all"}
    assert Measurement.from_dict(out).collectives["decode"][0].kind


def test_trial_prints_a_table(tmp_path, capsys, shared_sweeper_home):
    rc = main(["trial", "--config", str(write(tmp_path, TINY))])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("prefill_s", "decode_step_s", "total_s", "prefill_mfu", "kv_cache/chip",
                  "collectives (decode", "all-to-all", "emulated mesh"):
        assert label in out, label
    assert "tokens_match" not in out        # only with --verify


@pytest.mark.parametrize("data,needle", [
    (dict(TINY, batchsize=4), "did you mean 'batch'"),
    (dict(TINY, decode={"ffn": "ws2d", "attn": "batch"}, batch=3), "batch"),
    (dict(TINY, weights="int4"), "weights"),
    ("model: [unclosed", "valid YAML"),
])
def test_bad_input_exits_2_before_jax_starts(tmp_path, data, needle):
    path = write(tmp_path, data)
    result = run_cli(["trial", "--config", str(path)])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("JAX_IMPORTED")]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "JAX_IMPORTED=False" in result.stderr
    assert result.stdout == ""


def test_missing_config_file_exits_2(tmp_path):
    result = run_cli(["trial", "--config", str(tmp_path / "nope.yaml")])
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_restarts_itself_when_jax_already_runs_with_too_few_devices(tmp_path, shared_sweeper_home):
    """JAX started with 1 CPU device: the command re-executes with the device flag set."""
    env = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "SWEEPER_HOME": str(shared_sweeper_home)}
    prelude = "import jax\nassert jax.device_count() == 1"
    result = run_cli(["trial", "--config", str(write(tmp_path, TINY)), "--json"], env, prelude)
    assert result.returncode == 0, result.stderr
    assert "restarting with 2 virtual devices" in result.stderr
    out = json.loads(result.stdout)
    assert out["source"] == "measured" and out["extra"]["topology"] == "2x1x1"


def test_xla_flags_keep_other_flags_and_never_lower_the_count():
    assert xla_flags_with_devices("", 4) == "--xla_force_host_platform_device_count=4"
    assert xla_flags_with_devices("--xla_foo=1", 4) == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert xla_flags_with_devices("--xla_force_host_platform_device_count=8", 4) == \
        "--xla_force_host_platform_device_count=8"
    assert xla_flags_with_devices("--xla_force_host_platform_device_count=2 --x=1", 4) == \
        "--xla_force_host_platform_device_count=4 --x=1"


def test_host_profile_json(capsys, shared_sweeper_home):
    assert main(["host-profile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"]["name"] == "host" and out["profile"]["measured"] is True
    assert out["profile"]["peak_flops"] > 0
    assert out["cache"] == str(shared_sweeper_home.resolve() / "host_profile.yaml")
    assert "ici_measured_as" in out["notes"]


def test_host_profile_table(capsys, shared_sweeper_home):
    assert main(["host-profile"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "1/n" in out
