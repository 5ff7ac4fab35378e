"""The serving loop's host costs, declared once: what a serving engine's loop adds on the
host to the engine's own calls (docs/serving.md "Serving host costs").

    costs = HostCosts.from_measured(measured)     # a measurement's dict (hostcosts.combine)
    hardware = dataclasses.replace(hardware, host_costs=costs)

workloads/serving/hostcosts.py measures them (sweeper/serving/overheads.py says how), a
hardware profile holds them (`HardwareProfile.host_costs`, a profile YAML's `host_costs:`
mapping) and the serving model charges them (`StepTimes.host_costs`,
workloads/serving/model.py). Plain data: no JAX, no validation (workloads/config.py
validates a profile's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping


DISAGGREGATED = {"disaggregated": True}    # a cost only a disaggregated deployment pays
SLICE_WAKE = ("_s", "_idle_s", "_short_s", "_short_idle_s")   # prefill_wake* <-> slice_wake*


@dataclass(frozen=True)
class HostCosts:
    """Seconds a serving loop pays on the host beyond the engine's calls; 0 = none (an
    accelerator's profile, or not measured). One field is bytes (`unit`)."""

    # per decode step: the loop's own work (the tokens to the host, argmax, slot bookkeeping)
    step_overhead_s: float = 0.0
    # per prompt of a prefill call, after its first tokens: its row into a slot, or its KV
    # exported and sent (a prefill slice)
    prefill_overhead_per_prompt_s: float = 0.0
    # per prefill call: the part of its host work before its first tokens (prompts placed)
    prefill_first_overhead_s: float = 0.0
    # a prefill call on an idle loop: how much longer it takes to its first tokens, after
    # the loop idled `prefill_wake_idle_s` (0: not recorded, the wake after any idle)
    prefill_wake_s: float = 0.0
    prefill_wake_idle_s: float = 0.0
    # the same after a short idle, `prefill_wake_short_idle_s` (0: not measured): the wake
    # grows with the idle time between them (`wake_after`)
    prefill_wake_short_s: float = 0.0
    prefill_wake_short_idle_s: float = 0.0
    # aggregated: an idle loop's decode steps right after its prefill, beyond the model's
    # steps, after the loop idled `prefill_wake_idle_s` (the short one after
    # `prefill_wake_short_idle_s`; 0: not measured): the first steps after an idle are slower
    # too (`decode_wake_after`)
    decode_after_wake_s: float = 0.0
    decode_after_wake_short_s: float = 0.0
    # the weight bytes of the prefill slice `prefill_wake_s` was measured on (0: not
    # recorded): on a calibrated host the serving model moves the wake by the DRAM time of
    # the difference to another deployment's (workloads/serving/model.py `host_costs_for`)
    prefill_wake_weight_bytes: float = dataclasses.field(default=0.0, metadata={"unit": "B"})
    # disaggregated, per prompt: the least an idle prefill loop's call pays after its first
    # tokens (its KV exported and sent)
    prefill_idle_after_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    # disaggregated, per KV handover: the decode loop's time (the KV received, its insert)
    handover_overhead_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    # disaggregated: from the prefill slice's send to an idle decode loop's insert (the
    # transport and the loop's poll), charged to neither loop
    handover_latency_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    # disaggregated: an idle decode loop's first step, beyond the model's step
    decode_wake_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    # disaggregated: the prefill wake and its idles as measured on a prefill slice's own loop
    # (0: not measured; `prefill_wake_s` and the rest serve both). A profile measured on both
    # kinds of loop (`sweeper calibrate`) keeps each loop's (`for_mode`): the two loops wait
    # for work in different code, and their wakes were measured apart by up to 40%
    slice_wake_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    slice_wake_idle_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    slice_wake_short_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)
    slice_wake_short_idle_s: float = dataclasses.field(default=0.0, metadata=DISAGGREGATED)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def unit(cls, name: str) -> str:
        """A field's unit: "s", or "B" for the wake's weight bytes."""
        return next(f.metadata.get("unit", "s") for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def disaggregated_names(cls) -> tuple[str, ...]:
        """The costs of a KV handover between slices (0 for an aggregated deployment)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("disaggregated"))

    def for_mode(self, mode: str) -> "HostCosts":
        """The costs a deployment of `mode` pays: a disaggregated one's prefill wake is its
        prefill slice's loop's (`slice_wake_*`) where that was measured."""
        if mode != "disaggregated" or self.slice_wake_s <= 0:
            return self
        return dataclasses.replace(self, **{f"prefill_wake{name}": getattr(self, f"slice_wake{name}")
                                            for name in SLICE_WAKE})

    def wake_after(self, idle_s: float) -> float:
        """The wake of a prefill call after the loop idled `idle_s` seconds: between the two
        measured idles, straight in log(idle) from the short wake to the long one; the
        short wake below the short idle, the long one above the long idle (the wake stops
        growing there: docs/serving-model.md "A prefill on an idle loop"). One measured idle: that
        wake at any idle."""
        return self._after_idle(idle_s, self.prefill_wake_short_s, self.prefill_wake_s)

    def decode_wake_after(self, idle_s: float) -> float:
        """What an aggregated loop's decode steps right after a prefill on a loop idle
        `idle_s` seconds take beyond the model's steps: `decode_after_wake_s` (short, long),
        between the two idles as `wake_after`."""
        return self._after_idle(idle_s, self.decode_after_wake_short_s, self.decode_after_wake_s)

    def _after_idle(self, idle_s: float, short_value: float, long_value: float) -> float:
        """A cost measured after the two idles (`prefill_wake_short_idle_s`,
        `prefill_wake_idle_s`) at `idle_s`: straight in log(idle) between them, flat
        beyond; the long idle's at any idle where only one was measured."""
        short, long_ = self.prefill_wake_short_idle_s, self.prefill_wake_idle_s
        if not (0.0 < short < long_):
            return long_value
        if idle_s <= short:
            return short_value
        if idle_s >= long_:
            return long_value
        share = math.log(idle_s / short) / math.log(long_ / short)
        return short_value + share * (long_value - short_value)

    @classmethod
    def from_measured(cls, costs: Mapping[str, Any]) -> "HostCosts":
        """The costs in a measurement's dict (or a results file's, old names too); 0 where
        one was not measured."""
        named = renamed(costs)
        return cls(**{name: float(named.get(name) or 0.0) for name in cls.names()})

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# Only for files written before HostCosts: the names these costs had as flat fields of a
# hardware profile and in a measurement's dict (a committed profile or results file, a
# user's host profile); `renamed` maps them, nothing writes them.
OLD_NAMES = {"serving_step_overhead_s": "step_overhead_s",
             "serving_prefill_overhead_s": "prefill_overhead_per_prompt_s",
             **{f"serving_{name}": name for name in ("prefill_first_overhead_s", "prefill_wake_s",
                                                     "prefill_idle_after_s", "handover_latency_s",
                                                     "decode_wake_s")}}


def renamed(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with the old names of these costs (`OLD_NAMES`) replaced by HostCosts's."""
    return {OLD_NAMES.get(key, key): value for key, value in data.items()}
