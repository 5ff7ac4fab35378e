"""Error bands of predicted TTFT/TPOT from the held-out error of the hardware profile used.

A fitted profile (`sweeper fit`) carries `heldout_residuals`: per phase, the signed relative
residuals r = predicted / measured - 1 of points the fit did not see. The ratio measured /
predicted of a new point is then 1 / (1 + r); split-conformal prediction (Vovk et al.,
"Algorithmic Learning in a Random World"; Lei et al. 2018, "Distribution-free predictive
inference for regression") gives the interval that covers it with probability >= coverage
for exchangeable points: the ceil((n+1)(1-a/2))-th smallest ratio above, the
floor((n+1)a/2)-th below (a = 1 - coverage). With fewer held-out points than that needs
(n >= 2/a - 1: 19 for 90%) the band is unbounded and reported as such.

A plan's band comes from simulating it again with every step time scaled to the band's
ends (prefill by the prefill ratio, decode by the decode ratio): queueing amplifies a
step-time error, and the band says by how much. It does so on minimum_points(coverage) other
arrival streams (sweeper/serving/plan.py band_streams): a served stream is one draw of its
arrivals, and a short one's p99 varies. A profile without residuals (a preset) is
"uncalibrated": no band is invented. On a profile `sweeper calibrate` wrote, the band's
simulations also scale each call by a factor drawn from the calibration's spread of the
serving loop's call durations, for the deployment's mode (`serving_spread`): a step-time
residual is a median's error, while a served p99 rests on the calls other processes
interrupted, and the serving model prices every call alike.

A phase with some residuals but fewer than its band needs, when the two phases together have
enough, takes both phases' residuals (status "calibrated (both phases)"): the presets fitted to
published measurements (`<chip>-world`, docs/world.md) have few held-out TTFT rows beside many
TPOT rows. `calibration_text` says what such a preset's residuals come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workloads.config import WORLD_CALIBRATION, HardwareProfile

DEFAULT_COVERAGE = 0.9


@dataclass
class RatioBand:
    """measured / predicted lies in [low, high] with probability >= coverage (per phase)."""

    phase: str
    low: float | None
    high: float | None
    points: int
    coverage: float
    status: str            # "calibrated" | "uncalibrated" | "too few held-out points"

    @property
    def known(self) -> bool:
        return self.low is not None and self.high is not None

    def to_dict(self) -> dict:
        return {"phase": self.phase, "ratio_low": self.low, "ratio_high": self.high,
                "heldout_points": self.points, "coverage": self.coverage, "status": self.status}


def conformal_ratio_band(residuals: list[float], coverage: float = DEFAULT_COVERAGE,
                         phase: str = "") -> RatioBand:
    """The split-conformal band of measured/predicted from held-out residuals (module doc)."""
    n = len(residuals)
    if n == 0:
        return RatioBand(phase, None, None, 0, coverage, "uncalibrated")
    alpha = 1.0 - coverage
    ratios = sorted(1.0 / (1.0 + r) for r in residuals)
    upper_rank = math.ceil((n + 1) * (1 - alpha / 2) - 1e-9)    # (float noise: 20 x 0.95)
    lower_rank = math.floor((n + 1) * alpha / 2 + 1e-9)
    if upper_rank > n or lower_rank < 1:
        return RatioBand(phase, None, None, n, coverage, "too few held-out points")
    return RatioBand(phase, ratios[lower_rank - 1], ratios[upper_rank - 1], n, coverage,
                     "calibrated")


def profile_bands(hw: HardwareProfile, coverage: float = DEFAULT_COVERAGE) -> dict[str, RatioBand]:
    """{prefill: RatioBand, decode: RatioBand} of a profile's held-out residuals; a phase
    with too few (but some) takes both phases' (module doc); one with none stays uncalibrated."""
    residuals = hw.heldout_residuals or {}
    both = [r for phase in ("prefill", "decode") for r in residuals.get(phase, [])]
    out = {}
    for phase in ("prefill", "decode"):
        band = conformal_ratio_band(list(residuals.get(phase, [])), coverage, phase)
        if band.points and not band.known and len(both) >= minimum_points(coverage):
            band = conformal_ratio_band(both, coverage, phase)
            band.status = "calibrated (both phases)"
        out[phase] = band
    return out


def serving_spread(hw: HardwareProfile, mode: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(prefill, decode step) duration factors a band's simulations draw from: the quantiles
    `sweeper calibrate` measured on its probe deployment of `mode` (the profile's
    calibration notes, sweeper/calibrate/serving.py); ((), ()) where there are none."""
    spread = ((hw.calibration or {}).get("serving_spread") or {}).get(mode) or {}
    return tuple(spread.get("prefill") or ()), tuple(spread.get("decode") or ())


def calibration_text(hw: HardwareProfile) -> str | None:
    """"calibrated against N published points (...)" for a preset fitted to published
    measurements (workloads/config.py WORLD_CALIBRATION), else None."""
    c = WORLD_CALIBRATION.get(hw.name)
    if c is None:
        return None
    on_chip = c.get("points_on_chip", c["points"])
    where = f", {on_chip} on {c['datasheet']}" if on_chip != c["points"] else ""
    return (f"calibrated against {c['points']} published points ({', '.join(c['sources'])}"
            f"{where}; held out by source)")


def minimum_points(coverage: float = DEFAULT_COVERAGE) -> int:
    """Held-out points a two-sided band at `coverage` needs (n >= 2/a - 1)."""
    return math.ceil(2.0 / (1.0 - coverage) - 1 - 1e-9)
