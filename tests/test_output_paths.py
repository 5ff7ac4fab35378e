"""Output paths that cannot be written (issue 23 item 8): one line, exit 2, no traceback and
no `--resume` advice (`export` and `report` have none)."""

from __future__ import annotations

import os

import optuna
import pytest
from requires import require

from sweeper.cli import main
from sweeper.paths import default_storage, open_optuna_storage


@pytest.fixture
def study(sweeper_home):
    """A real Optuna study with one finished trial in $SWEEPER_HOME's store."""
    s = optuna.create_study(storage=open_optuna_storage(default_storage()), study_name="s")
    s.add_trial(optuna.trial.create_trial(values=[1.0], params={}, distributions={},
                                          user_attrs={"flat_params": {}, "measurement": {}}))
    return "s"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "--resume" not in err, err
    return err


def test_report_out_an_existing_file(sweeper_home, tmp_path, capsys):
    target = tmp_path / "report.html"
    target.write_text("keep me")
    assert main(["report", "--study", "s", "--out", str(target)]) == 2
    assert "--out" in one_line(capsys) and target.read_text() == "keep me"
    assert main(["report", "--study", "s", "--out", str(target / "sub")]) == 2
    assert "not a folder" in one_line(capsys)


def test_export_out_dev_full(study, capsys):
    require(os.path.exists("/dev/full"), "no /dev/full (Linux has one)")
    assert main(["export", "--study", study, "--out", "/dev/full"]) == 2
    err = one_line(capsys)
    assert "--out: got '/dev/full'" in err and "No space left on device" in err


def test_export_out_a_folder(study, tmp_path, capsys):
    assert main(["export", "--study", study, "--out", str(tmp_path)]) == 2
    assert "--out" in one_line(capsys)
