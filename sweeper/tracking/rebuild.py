"""Rebuild a sweep's Optuna study from its MLflow runs (`sweeper sync`, issue 23).

Optuna storage is the record of a sweep and MLflow a view of it (sweeper/tracking/sync.py),
but when the Optuna file is deleted or damaged the MLflow runs are what survives. They
hold enough to recreate the study:

  the parent run (tag `study`)     the space as it ran (its text, a logged artifact; else
                                   the file named by tag `space_file`): the parameters'
                                   distributions, the objectives and constraints
  one child run per trial          params = the trial's flat parameters, metrics = what it
                                   measured and `pred_<metric>` the cost model's
                                   prediction, tags = state, reason, source, hardware,
                                   device, worker, hardware_share, retry_of, trial_number

Each trial is added with `study.add_trial` in trial-number order with its state, values
(the objectives' metrics), constraints, the Optuna parameters recovered from the flat ones
(`optuna_params`) and the user attrs the analysis and `--resume` read (see
sweeper/tracking/results.py and the controller's TrialRecord): flat_params, source,
hardware, prediction, measurement, outcome, config, reason, worker, interrupted,
constraints, feasible, hardware_share, retry_of, mlflow_run_id. A trial number with no
run (a trial that was running when the store was lost) becomes FAIL with reason
`lost: ...`, so trial numbers stay those of the MLflow runs. Trials are marked
`rebuilt_from: mlflow`.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from pathlib import Path
from typing import Any, Mapping

from sweeper.paths import open_optuna_storage
from sweeper.spec import lease
from sweeper.tracking.mlflow_log import KIND_TAG, PRED_PREFIX, SWEEP_KIND, run_matches
from workloads.config import ConfigError
from workloads.trial import TrialConfig

LOST_REASON = ("lost: its Optuna record was lost and MLflow has no run of it (it was running "
               "when the store was lost)")
STATUS_WORD = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "killed"}


def find_parent(tracker, study_name: str):
    """The latest parent (sweep) run of `study_name` in the tracking store, or None."""
    from mlflow.entities import ViewType   # lazy: MLflow (~1 s)

    client = tracker.client
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    if not ids:
        return None
    runs = client.search_runs(ids, filter_string=f"tags.`{KIND_TAG}` = '{SWEEP_KIND}' and "
                              f"tags.study = '{study_name}'", run_view_type=ViewType.ACTIVE_ONLY,
                              order_by=["attributes.start_time DESC"], max_results=10)
    return runs[0] if runs else None


def space_of(tracker, parent):
    """The space the sweep ran: its logged text, else the file its tag names."""
    import yaml

    from sweeper.spec.space import load_space

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # no tqdm bar
    source = parent.data.tags.get("space_file") or None
    client = tracker.client
    for item in client.list_artifacts(parent.info.run_id):
        if item.is_dir or not item.path.endswith((".yaml", ".yml")):
            continue
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            local = client.download_artifacts(parent.info.run_id, item.path, tmp)
            text = Path(local).read_text()
        data = yaml.safe_load(text)
        if isinstance(data, Mapping):
            space = load_space(data, source)
            return space
    if source and Path(source).is_file():
        return load_space(source)
    raise ConfigError("--study", parent.data.tags.get("study"), "a study whose space can be "
                      "read from its MLflow parent run (no space artifact, and its space file "
                      f"{source!r} is gone)")


def optuna_params(space, flat: Mapping[str, str]) -> dict[str, Any] | None:
    """The Optuna parameters of a trial from its flat parameters (MLflow keeps them as
    strings), or None when one cannot be recovered. `ffn`/`attn` (both phases) read the
    prefill layout; a `topology: auto` choice is taken when the resolved topology is not
    itself a choice."""
    params: dict[str, Any] = {}
    for p in space.params:
        key = {"ffn": "prefill_ffn", "attn": "prefill_attn"}.get(p.name, p.name)
        if key not in flat:
            return None
        raw = str(flat[key])
        if p.choices is not None:
            match = [c for c in p.choices if str(c) == raw]
            if not match and p.name == "topology" and "auto" in p.choices:
                match = ["auto"]
            if not match:
                return None
            params[p.name] = match[0]
        else:
            try:
                value = int(raw)
            except ValueError:
                return None
            if not p.low <= value <= p.high:
                return None
            params[p.name] = value
    return params


def _typed_flat(space, params: dict | None, flat: Mapping[str, str]):
    """(flat params with their types, TrialConfig dict or None) matching the run's strings."""
    as_text = {k: str(v) for k, v in flat.items()}
    if params is not None:
        try:
            config = space.trial_config(params)
            typed = config.flat_params()
            if {k: str(v) for k, v in typed.items()} == as_text:
                return typed, config.to_dict()
        except ConfigError:
            pass
        typed = space.flat_params(params)
        if {k: str(v) for k, v in typed.items()} == as_text:
            return typed, None
    typed = {}
    for k, v in flat.items():
        typed[k] = int(v) if k in TrialConfig.INT_FLAT_PARAMS and str(v).lstrip("-").isdigit() \
            else (None if v == "None" else v)
    return typed, None


def grid_attrs(space, params: Mapping[str, Any]) -> dict[str, Any]:
    """The system attrs Optuna's GridSampler gives a trial (`grid_id`: the point's index in
    the sampler's grid, which it shuffles with the space's seed), so a resumed grid skips
    the points already visited."""
    sampler = space.make_sampler()
    grids = getattr(sampler, "_all_grids", None)
    search_space = getattr(sampler, "_search_space", None)
    if grids is None or search_space is None:
        return {}
    point = tuple(params.get(name) for name in search_space)
    if point not in grids:
        return {}
    return {"search_space": search_space, "grid_id": grids.index(point)}


def _time(ms: int | None):
    return dt.datetime.fromtimestamp(ms / 1000) if ms else None


def _pick(runs: list):
    """One run per trial: a complete one (its status says the trial's state), oldest."""
    good = [r for r in runs if run_matches(r, r.data.tags.get("status", ""))]
    return sorted(good or runs, key=lambda r: r.info.start_time or 0)[0]


def trial_from_run(space, run, run_id_attr: bool = True):
    """An Optuna FrozenTrial (number not set: add_trial numbers it) from a child run."""
    import optuna   # lazy: Optuna (~1 s)

    tags, metrics = run.data.tags, run.data.metrics
    state_name = tags.get("status", "FAIL")
    if state_name not in ("COMPLETE", "PRUNED", "FAIL"):
        state_name = "FAIL"
    measurement = {k: v for k, v in metrics.items() if not k.startswith(PRED_PREFIX)}
    prediction = {k[len(PRED_PREFIX):]: v for k, v in metrics.items() if k.startswith(PRED_PREFIX)}
    params = optuna_params(space, run.data.params)
    flat, config = _typed_flat(space, params, run.data.params)
    reason = tags.get("reason") or None
    attrs: dict[str, Any] = {"flat_params": flat, "source": tags.get("source"),
                             "hardware": tags.get("hardware"), "prediction": prediction,
                             "measurement": measurement}
    if tags.get("device"):
        attrs["device"] = tags["device"]
    if config is not None:
        attrs["config"] = config
    if reason:
        attrs["reason"] = reason
    worker = {key: tags[tag] for key, tag in (("pid", "worker_pid"), ("node_id", "node_id"),
                                              ("node_ip", "node_ip"), ("attempts", "attempts"))
              if tags.get(tag)}
    for key in ("pid", "attempts"):
        if str(worker.get(key, "")).isdigit():
            worker[key] = int(worker[key])
    if worker:
        attrs["worker"] = worker
    if reason and reason.startswith("interrupted"):
        attrs["interrupted"] = True
    values = None
    constraints = None
    if state_name == "COMPLETE":
        values = [measurement.get(m) for m in space.metric_names]
        if not all(isinstance(v, float) and math.isfinite(v) for v in values):
            state_name, values = "FAIL", None        # (cannot happen for a run we logged)
            attrs["reason"] = "objective not reported (rebuilt from MLflow)"
        else:
            constraints = {c.text: c.value(measurement) for c in space.constraints}
            attrs["constraints"] = constraints
            attrs["feasible"] = all(v <= 0 for v in constraints.values())
    if tags.get("hardware_share"):
        attrs["hardware_share"] = float(tags["hardware_share"])
    if str(tags.get("retry_of", "")).isdigit():
        attrs["retry_of"] = int(tags["retry_of"])
    if run_id_attr:
        attrs["mlflow_run_id"] = run.info.run_id
    attrs["rebuilt_from"] = "mlflow"
    if params is None:
        attrs["params_unrecovered"] = True      # no distributions: --resume cannot re-run it
    attrs["outcome"] = state_name
    distributions = space.distributions() if params is not None else {}
    trial = optuna.trial.create_trial(
        state=optuna.trial.TrialState[state_name], values=values, params=params or {},
        distributions={k: distributions[k] for k in (params or {})}, user_attrs=attrs,
        constraints={str(i): v for i, v in enumerate(constraints.values())} if constraints else None)
    if params is not None and space.sampler.type == "grid":
        trial.system_attrs.update(grid_attrs(space, params))
    trial.datetime_start = _time(run.info.start_time) or trial.datetime_start
    trial.datetime_complete = _time(run.info.end_time) or trial.datetime_complete
    return trial


def rebuild_study(study_name: str, storage: str, tracker) -> tuple[Any, int, int]:
    """Create `study_name` in `storage` from the MLflow runs of `tracker`'s store.

    Returns (study, trials rebuilt from runs, trial numbers with no run). ConfigError when
    the store has no parent run of that study."""
    import optuna   # lazy: Optuna (~1 s)

    parent = find_parent(tracker, study_name)
    if parent is None:
        raise ConfigError("--study", study_name, f"a study in the Optuna storage {storage}, "
                          f"or one whose runs are in {tracker.tracking_uri} to rebuild it from "
                          "(neither has it)")
    space = space_of(tracker, parent)
    runs = tracker.child_runs(parent.info.run_id, parent.info.experiment_id)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=open_optuna_storage(storage), study_name=study_name,
                                directions=space.directions)
    tags = parent.data.tags
    attrs = {"space": space.name, "hardware": space.hardware.label,
             "source": tags.get("source") or space.hardware.source,
             "objectives": space.metric_names, "directions": space.directions,
             "space_file": tags.get("space_file") or space.source,
             "constraints": [c.text for c in space.constraints],
             "mlflow_parent_run_id": parent.info.run_id, "tracking_uri": tracker.tracking_uri,
             lease.LEASE_ATTR: {"status": STATUS_WORD.get(parent.info.status, "killed")},
             "rebuilt_from_mlflow": {"at": dt.datetime.now().isoformat(timespec="seconds"),
                                     "runs": sum(1 for v in runs.values() if v)}}
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    top = max(runs, default=-1)
    rebuilt = lost = 0
    for number in range(top + 1):
        if runs.get(number):
            study.add_trial(trial_from_run(space, _pick(runs[number])))
            rebuilt += 1
        else:
            study.add_trial(optuna.trial.create_trial(
                state=optuna.trial.TrialState.FAIL,
                user_attrs={"reason": LOST_REASON, "outcome": "FAIL", "rebuilt_from": "mlflow",
                            "source": attrs["source"], "hardware": attrs["hardware"],
                            "flat_params": {}, "measurement": {}, "prediction": {}}))
            lost += 1
    return study, rebuilt, lost
