"""The MLflow UI shows a sweep's trial runs and their layout params (headless Chromium).

A small real sweep (analytical backend: no JAX, seconds) fills an MLflow SQLite store;
`mlflow server` serves it on a free loopback port; Selenium drives Chromium to the
experiment page (the React app renders the runs table; the trial runs are nested under
the sweep's parent run, so the test expands it) and to the compare view of the trial runs,
whose parameter table must list every layout param with each run's value.

Skipped, with the reason, where Chromium or chromedriver is missing, unless `CI` is set:
in CI the test must run (`.ci/run` installs `chromium` and `chromium-driver`).
Set SWEEPER_SCREENSHOT=path.png to keep a screenshot of the compare view
(docs/mlflow-compare.png is made this way from the quickstart sweep's store).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from requires import require

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
LAYOUT_PARAMS = ("prefill_ffn", "prefill_attn", "decode_ffn", "decode_attn")
PAGE_TIMEOUT_S = 240          # the React bundle is large and 2 shared cores are slow

SPACE = """
name: ui-test
model: tiny
hardware: analytical:tpu-v4
input_len: 32
decode_steps: 8
params:
  chips: [2, 4]
  prefill_ffn: [ws2d, wg_xyz]
  decode_ffn: [ws1d, ws2d]
batch: 8
decode: {attn: batch}
objectives:
  - {metric: decode_step_s, direction: minimize}
  - {metric: decode_cost_chip_s_per_token, direction: minimize}
sampler: {type: grid, seed: 0}
trials: 8
parallel: 1
"""


def _browser_missing() -> str | None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).is_file() and os.access(p, os.X_OK))]
    return f"not installed: {', '.join(missing)} (apt-get install chromium chromium-driver)" if missing else None


def _require_browser() -> None:
    reason = _browser_missing()
    require(reason is None, f"headless Chromium unavailable: {reason}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """`mlflow server` on a free loopback port; stopped (its process group) on exit."""

    def __init__(self, tracking_uri: str, artifact_root: str | None, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        if artifact_root:
            cmd += ["--default-artifact-root", artifact_root]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server not ready after {timeout}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)   # its own session: the uvicorn worker goes too
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def chromium(user_data_dir: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={user_data_dir}",
                 "--window-size=1600,1500"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def wait_for_text(driver, texts, timeout: float = PAGE_TIMEOUT_S) -> str:
    """Poll the rendered page until every text is on it; returns the page text."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        try:
            body = driver.find_element(By.TAG_NAME, "body").text
        except Exception:  # noqa: BLE001 - the app is still mounting
            body = ""
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    missing = [t for t in texts if t not in body]
    raise AssertionError(f"not on the page after {timeout}s: {missing}; page text: {body[:1500]!r}")


def wait_for_elements(driver, xpath: str, timeout: float = PAGE_TIMEOUT_S) -> list:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = driver.find_elements(By.XPATH, xpath)
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no element {xpath} after {timeout}s")


def expand_parent_run(driver, parent_name: str) -> None:
    """Nested runs are collapsed under their parent: click the parent row's expander."""
    from selenium.webdriver.common.by import By

    rows = wait_for_elements(driver, f"//*[@role='row'][.//a[normalize-space(.)='{parent_name}']]")
    for row in rows:
        buttons = row.find_elements(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']")
        if buttons:
            driver.execute_script("arguments[0].click();", buttons[0])
            return
    raise AssertionError(f"no expandable row for parent run {parent_name!r} ({len(rows)} rows)")


def close_side_panels(driver) -> None:
    """The assistant side panel covers part of the page in screenshots: close it if open."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label*='lose']"):
        try:
            if button.is_displayed():
                driver.execute_script("arguments[0].click();", button)
        except Exception:  # noqa: BLE001 - a stale element is as good as a closed panel
            pass


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    runs = urllib.parse.quote(json.dumps(run_ids))
    exps = urllib.parse.quote(json.dumps([experiment_id]))
    return f"{base}/#/compare-runs?runs={runs}&experiments={exps}"


def screenshot_compare(driver, path: Path) -> None:
    """The compare view scrolled to its run table: run names, then params (layouts side by side)."""
    from selenium.webdriver.common.by import By

    close_side_panels(driver)
    heads = [e for e in driver.find_elements(By.XPATH, "//*[normalize-space(text())='Run details']")
             if e.is_displayed()]
    if heads:
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", heads[-1])
        time.sleep(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))


def check_ui(tracking_uri: str, artifact_root: str | None, workdir: Path,
             screenshot: Path | None = None, max_compare: int = 8) -> dict:
    """Serve the store, open the experiment and compare pages, check runs and layout params."""
    from mlflow.tracking import MlflowClient

    from sweeper.tracking.mlflow_log import KIND_TAG, SWEEP_KIND, TRIAL_KIND

    client = MlflowClient(tracking_uri=tracking_uri)
    parents = [r for e in client.search_experiments()
               for r in client.search_runs([e.experiment_id], f"tags.`{KIND_TAG}` = '{SWEEP_KIND}'")]
    assert parents, "no sweep in the store"
    parent = parents[0]
    exp_id = parent.info.experiment_id
    trials = client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                f"tags.`{KIND_TAG}` = '{TRIAL_KIND}'", max_results=200)
    trials = sorted(trials, key=lambda r: int(r.data.tags["trial_number"]))
    server = MlflowServer(tracking_uri, artifact_root, workdir / "mlflow-server.log")
    driver = None
    try:
        server.wait_ready()
        driver = chromium(workdir / "chromium-profile")
        driver.get(f"{server.url}/#/experiments/{exp_id}/runs")
        expand_parent_run(driver, parent.info.run_name)
        shown = trials[:10]               # the first page of children is enough to prove it
        wait_for_text(driver, [r.info.run_name for r in shown])
        compared = trials[:max_compare]
        driver.get(compare_url(server.url, exp_id, [r.info.run_id for r in compared]))
        body = wait_for_text(driver, [*LAYOUT_PARAMS, *(r.info.run_name.split()[0] for r in compared)])
        lines = body.splitlines()
        for param in LAYOUT_PARAMS:
            # The parameter table has one line per param: its name, then each run's value.
            row = next((line for line in lines if line.split(" ")[0] == param and len(line.split()) > 1),
                       None)
            assert row is not None, f"no row for {param} in the compare table"
            values = row.split()[1:]
            assert values == [r.data.params[param] for r in compared], (param, values)
        if screenshot is not None:
            screenshot_compare(driver, screenshot)
        return {"experiment_id": exp_id, "trials": len(trials), "compared": len(compared)}
    finally:
        if driver is not None:
            driver.quit()
        server.stop()


@pytest.fixture(scope="module")
def ui_store(tmp_path_factory):
    _require_browser()                 # skip (or fail in CI) before doing any work
    from sweeper.sweep.controller import run_sweep

    root = tmp_path_factory.mktemp("ui")
    (root / "space.yaml").write_text(SPACE)
    tracking = f"sqlite:///{root}/mlflow.db"
    result = run_sweep(str(root / "space.yaml"), storage=f"sqlite:///{root}/optuna.db",
                       tracking_uri=tracking, study_name="ui", progress=False)
    assert result.counts["complete"] == 8
    return root, tracking


def test_trial_runs_and_layout_params_are_on_the_mlflow_ui(ui_store):
    from sweeper.paths import artifact_root

    root, tracking = ui_store
    shot = Path(os.environ["SWEEPER_SCREENSHOT"]) if os.environ.get("SWEEPER_SCREENSHOT") else root / "compare.png"
    seen = check_ui(tracking, artifact_root(tracking), root, screenshot=shot)
    assert seen["trials"] == 8 and seen["compared"] == 8
    assert shot.read_bytes().startswith(b"\x89PNG")
