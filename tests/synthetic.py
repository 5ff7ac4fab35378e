"""Synthetic study tables for tests and benchmarks of the calibration code (a test oracle).

The "measurements" are the cost model under a known `truth` profile times lognormal noise, so
a fit can be checked against constants it must recover. Never presented as measured data
outside tests.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from sweeper.tracking import results
from workloads import costmodel
from workloads.config import HardwareProfile
from workloads.trial import TrialConfig


def synthetic_trials(configs: Iterable[TrialConfig], truth: HardwareProfile,
                     start: HardwareProfile, noise: float = 0.02, seed: int = 0,
                     scale_of=None) -> pd.DataFrame:
    """A study-shaped table (sweeper.tracking.results columns) whose "measurements" are the cost
    model under `truth` times lognormal noise, and whose `pred_*` come from `start`.

    For tests and benchmarks of the fitting code only: the rows say source="measured" so
    they go through the same path as a real sweep; nothing else may present them as such.
    `scale_of(config)` gives a trial's share of the profiles (default 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for number, config in enumerate(configs):
        config = config.resolved()
        share = scale_of(config) if scale_of else 1.0
        measured = costmodel.predict(config, truth.scaled(share)).metrics()
        factor = {m: float(np.exp(rng.normal(0.0, noise))) for m in ("prefill", "decode")}
        measured["prefill_s"] *= factor["prefill"]
        measured["decode_step_s"] *= factor["decode"]
        measured["total_s"] = measured["prefill_s"] + config.decode_steps * measured["decode_step_s"]
        for phase, key in (("prefill", "prefill_s"), ("decode", "decode_step_s")):
            tokens = config.batch * (config.input_len if phase == "prefill" else 1)
            measured[f"{phase}_cost_chip_s_per_token"] = config.chips * measured[key] / tokens
            flops = costmodel.phase_model_flops(config.model, config.batch, phase, config.input_len,
                                                costmodel.phase_calls(config)[phase].context)
            measured[f"{phase}_mfu"] = flops / (config.chips * truth.peak_flops * share * measured[key])
        for key in list(measured):
            if key.endswith(("_compute_s", "_memory_s", "_comm_s")):
                del measured[key]          # a measurement has no analytical breakdown
        prediction = costmodel.predict(config, start.scaled(share)).metrics()
        rows.append(results.trial_row(
            number=number, state=results.COMPLETE, reason=None, source="measured",
            hardware=truth.name, params=config.flat_params(), metrics=measured,
            prediction=prediction, mlflow_run_id=None))
    return results.frame(rows)
