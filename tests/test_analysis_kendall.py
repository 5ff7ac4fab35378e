"""The hold-out ranking's Kendall tau-b (sweeper/analysis/holdout.py `kendall_tau_b`), counted
over pairs instead of importing scipy.stats: the same float as scipy's, ties and NaN included."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.stats import kendalltau

from sweeper.analysis.holdout import kendall_tau_b


def test_kendall_tau_b_is_scipys_float_with_ties_and_nan():
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(3000):
        n = int(rng.integers(0, 9))       # a ranking group: a few layouts
        x = rng.integers(0, 4, n).astype(float) if rng.random() < 0.5 else rng.random(n)
        y = rng.integers(0, 4, n).astype(float) if rng.random() < 0.5 else rng.random(n) * 1e-3
        if n and rng.random() < 0.05:
            x[int(rng.integers(0, n))] = math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # scipy's warning for fewer than 2 values
            expected = float(kendalltau(x, y).statistic)
        got = kendall_tau_b(x, y)
        assert (math.isnan(expected) and math.isnan(got)) or got == expected, (x, y)
        compared += not math.isnan(got)
    assert compared > 1000          # most cases are finite values, not NaN


def test_kendall_tau_b_orders_and_refuses_unequal_lengths():
    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau_b([1, 2, 3], [30, 20, 10]) == -1.0
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))      # a constant sequence
    with pytest.raises(ValueError, match="one length"):
        kendall_tau_b([1, 2], [1, 2, 3])
