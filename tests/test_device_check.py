"""benchmarks/device_check.py runs anywhere in --smoke mode (tiny model on the host CPU)
and writes its report; without an accelerator and without --smoke it refuses in one line.
Nothing here needs an accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWEEPER_HOME": str(home),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "benchmarks.device_check", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


# ci_slow: ~15 s; keeps `make test` near 10 minutes on 2 cores
@pytest.mark.ci_slow
def test_smoke_run_writes_the_device_report(tmp_path, session_sweeper_home):
    proc = run_check("--smoke", "--out", str(tmp_path), home=session_sweeper_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "device-cpu.md").read_text()
    data = json.loads((tmp_path / "device-cpu.json").read_text())
    assert data["smoke"] is True and data["device"]["platform"] == "cpu"
    trials = data["trials"]
    assert {(t["purpose"], t["weights"]) for t in trials} == {
        (p, w) for p in ("prefill", "decode") for w in ("bf16", "int8")}
    for t in trials:
        assert t["prefill_s"] > 0 and t["decode_step_s"] > 0 and t["memory_bound_s"] > 0
        assert 0 < t["prefill_mfu"] < 1.5                       # against the host's peak
        assert t["bound_ratio"] == t["decode_step_s"] / t["memory_bound_s"]
    bf16, int8 = (next(t for t in trials if t["purpose"] == "decode" and t["weights"] == w)
                  for w in ("bf16", "int8"))
    assert int8["weight_bytes"] < bf16["weight_bytes"]          # int8 halves the matmul weights
    assert "SMOKE" in report and "| decode | int8 |" in report
    assert "## sweeper profile" in report and data["sweeper_profile"]["note" if not
                                                                      data["sweeper_profile"]["ran"] else "output"]


def test_without_an_accelerator_it_asks_for_smoke(tmp_path):
    proc = run_check("--out", str(tmp_path), home=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--smoke" in proc.stderr
    assert not list(tmp_path.glob("device-*"))
