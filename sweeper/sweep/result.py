"""What a sweep returns: counts, the Pareto trials and where everything is stored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sweeper.spec.space import SearchSpace
from sweeper.tracking.study import mlflow_run_ids
from workloads.trial import TrialConfig


@dataclass
class SweepResult:
    study: Any                           # optuna.Study
    study_name: str
    storage: str
    tracking_uri: str
    parent_run_id: str | None
    experiment: str
    experiment_id: str | None
    source: str                          # measured | analytical
    counts: dict[str, int]               # complete, failed, pruned (the whole study)
    pareto: list[dict[str, Any]]         # non-dominated feasible trials
    objectives: list[tuple[str, str]]    # (metric, direction)
    searched: list[str] = field(default_factory=list)   # the space's searched params
    elapsed_s: float = 0.0
    tracking_errors: list[str] = field(default_factory=list)
    interrupted: int = 0                 # of `failed`: left running by a controller that died
    mlflow_missing: int = 0              # finished trials with no MLflow run yet (sweeper sync)

    def to_json(self) -> dict[str, Any]:
        return {"study": self.study_name, "trials_complete": self.counts["complete"],
                "trials_failed": self.counts["failed"], "trials_pruned": self.counts["pruned"],
                "trials_interrupted": self.interrupted,
                "pareto": self.pareto, "parent_run_id": self.parent_run_id,
                "tracking_uri": self.tracking_uri, "storage": self.storage,
                "experiment": self.experiment, "experiment_id": self.experiment_id,
                "source": self.source, "mlflow_missing": self.mlflow_missing,
                "tracking_errors": len(self.tracking_errors),
                "elapsed_s": round(self.elapsed_s, 3)}


# A Pareto row: the trial's flat parameters less those a sweep holds fixed.
ROW_PARAMS = tuple(p for p in TrialConfig.FLAT_PARAMS if p not in ("model", "seed", "repeats"))


def pareto_rows(study, space: SearchSpace) -> list[dict[str, Any]]:
    """The non-dominated COMPLETE trials that meet every constraint, best first.

    Two objectives: `sweeper.analysis.pareto.pareto_front` (the same front `sweeper pareto` draws);
    otherwise Optuna's own `best_trials` (any number of objectives).
    """
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state.name == "COMPLETE" and t.user_attrs.get("feasible", True)]
    if not trials:
        return []
    metrics = space.metric_names
    numbers: list[int]
    if len(metrics) == 2:
        # lazy: pandas (~1 s) only once the trials are done, not while the controller
        # starts Ray and the workers (docs/performance.md, "Start-up and shutdown")
        import pandas as pd

        from sweeper.analysis.pareto import pareto_front

        df = pd.DataFrame([{"number": t.number, **(t.user_attrs.get("flat_params") or {}),
                            metrics[0]: t.values[0], metrics[1]: t.values[1]} for t in trials])
        maximize = [o.metric for o in space.objectives if o.direction == "maximize"]
        phase = "prefill" if metrics[0].startswith("prefill") else "decode"
        numbers = [int(n) for n in pareto_front(df, metrics[0], metrics[1], phase=phase,
                                                maximize=maximize)["number"]]
    else:
        best = {t.number for t in study.best_trials}
        ordered = sorted((t for t in trials if t.number in best),
                         key=lambda t: t.values[0] * (1 if space.directions[0] == "minimize" else -1))
        numbers = [t.number for t in ordered]
    run_ids = mlflow_run_ids(study)
    by_number = {t.number: t for t in trials}
    rows, seen = [], set()
    for number in numbers:
        t = by_number[number]
        flat = t.user_attrs.get("flat_params") or {}
        key = tuple(sorted((k, str(v)) for k, v in flat.items()))
        if key in seen:      # the sampler revisited a point: list each configuration once
            continue
        seen.add(key)
        row: dict[str, Any] = {"number": number}
        row.update({m: v for m, v in zip(metrics, t.values)})
        row.update({k: flat.get(k) for k in ROW_PARAMS})
        row["mlflow_run_id"] = run_ids.get(number)
        rows.append(row)
    return rows
