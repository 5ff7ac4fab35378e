"""MLflow records of serving: `sweeper serve` runs (measured beside predicted).

Experiment `sweeper/serve`, one run per `sweeper serve`:
  params   mode, model, hardware, each phase's chips/ffn/attn/batch/weights, rate, requests, seed
  metrics  measured ttft_p50_s ... throughput_rps by name; the serving model's prediction of
           each as `pred_<name>`; the warm-up diagnostic as `warmup_<name>`; the serving
           model replayed on the run's own call log (a rules check, docs/serving.md "Checking
           the model against the server") as `replay_<name>`; per-request
           ttft_s / tpot_s as metric histories (step = request index)
  tags     sweeper.kind=serve, hardware_label (host | devices), source=measured,
           percentiles_of ("N completed [of M requests]"); a stream cut short (a lost or
           failed worker, SIGINT/SIGTERM) also stop_kind, stop_reason and the worker's
           name, phase and pid (stop_worker, stop_phase, stop_pid)
  status   FINISHED; FAILED for a lost or failed worker, KILLED for a signal (the metrics are
           those of the requests that completed: docs/reliability.md, "Serving")
  artifact serve.json (the whole result, per-request times and tokens, each worker's call log)
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

SERVE_EXPERIMENT = "sweeper/serve"


def _finite(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    return {f"{prefix}{k}": float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def open_tracker(tracking_uri: str | None):
    """The Tracker of `tracking_uri`; a store half-created by an earlier run on a full disk,
    holding no run, is moved aside first (one line on stderr), as `sweeper run` does, so
    that running the same command again works (store_health.py `prepare_tracking_store`)."""
    from sweeper.paths import default_tracking_uri
    from sweeper.tracking.mlflow_log import Tracker
    from sweeper.tracking.store_health import prepare_tracking_store

    moved = prepare_tracking_store(tracking_uri or default_tracking_uri(create=False))
    if moved:
        print(moved, file=sys.stderr)
    return Tracker(tracking_uri)


def log_serve(result, rate: float, seed: int, tracking_uri: str | None = None) -> str:
    """Log one `sweeper serve` run (a `sweeper.serving.serve.ServeResult`); its run id."""
    from mlflow.entities import Metric, Param, RunTag   # lazy: MLflow (~1 s)

    from sweeper.tracking.mlflow_log import KIND_TAG

    tracker = open_tracker(tracking_uri)
    client = tracker.client
    experiment = tracker.experiment_id(SERVE_EXPERIMENT)
    d = result.deployment
    params = {"mode": d.mode, "model": d.model.name, "hardware": d.hardware.name, "rate": rate,
              "requests": len(result.requests), "seed": seed}
    for phase in ("prefill", "decode"):
        for key, value in getattr(d, phase).to_dict().items():
            params[f"{phase}_{key}"] = value
    tags = {KIND_TAG: "serve", "source": "measured",
            "hardware_label": "host" if result.emulated else "devices",
            "percentiles_of": result.percentiles_of}
    stop = result.stop or {}
    for key in ("kind", "reason", "worker", "phase", "pid", "signal"):
        if stop.get(key) is not None:
            tags[f"stop_{key}"] = str(stop[key])[:5000]
    run = client.create_run(experiment, run_name=f"serve {d.mode} {d.model.name} {rate:g} rps",
                            tags=tags)
    run_id = run.info.run_id
    metrics = {**_finite(result.measured), **_finite(result.predicted, "pred_"),
               **_finite(result.calibrated, "warmup_"),
               **_finite(result.replayed or {}, "replay_")}
    stamp = 0
    batch = [Metric(k, v, stamp, 0) for k, v in metrics.items()]
    ttft, tpot = [], []
    for i, (r, p) in enumerate(zip(result.requests, result.per_request)):
        if "first_token_s" in p:
            ttft.append(Metric("ttft_s", p["first_token_s"] - r.arrival_s, stamp, i))
        if "finish_s" in p and "first_token_s" in p and r.output_len > 1:
            tpot.append(Metric("tpot_s", (p["finish_s"] - p["first_token_s"]) / (r.output_len - 1),
                               stamp, i))
    everything = batch + ttft + tpot
    for start in range(0, len(everything), 900):          # MLflow takes 1000 entries per batch
        client.log_batch(run_id, metrics=everything[start:start + 900],
                         params=[Param(k, str(v)) for k, v in params.items()] if start == 0 else [],
                         tags=[RunTag("requests_logged", str(len(ttft)))] if start == 0 else [])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "serve.json"
        path.write_text(json.dumps({**result.to_json(), "per_request": result.per_request,
                                    "calls": result.calls},
                                   default=str))
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, serve_status(result.stop))
    return run_id


def serve_status(stop: dict | None) -> str:
    """The MLflow run status of a `sweeper serve` run: FINISHED, KILLED (a signal stopped
    it) or FAILED (a worker was lost or failed)."""
    if stop is None:
        return "FINISHED"
    return "KILLED" if stop.get("kind") == "signal" else "FAILED"


PLAN_EXPERIMENT = "sweeper/plan"


def log_plan(result, tracking_uri: str | None = None) -> str:
    """Log one `sweeper plan` answer (a `sweeper.serving.plan.PlanResult`); its run id.

    Experiment `sweeper/plan`, one run per question:
      params   model, hardware, the application profile's fields, modes, max_chips
      metrics  the best plan's predictions by name (ttft_p99_s, goodput_rps, chips_total, ...),
               and the search's size (simulated, configs, wall_s)
      tags     sweeper.kind=plan, source=analytical, best_mode (or none), reason, at_risk
      artifact plan.json (the whole answer: best, best per mode, frontier, error bands)
    """
    from mlflow.entities import Metric, Param, RunTag   # lazy: MLflow (~1 s)

    from sweeper.tracking.mlflow_log import KIND_TAG

    tracker = open_tracker(tracking_uri)
    client = tracker.client
    experiment = tracker.experiment_id(PLAN_EXPERIMENT)
    q = result.question
    data = result.to_dict()
    params = {"model": q.model.name, "hardware": q.hardware.name,
              "modes": ",".join(q.modes), "max_chips": q.max_chips,
              "requests_simulated": q.requests, "seed": q.seed, "coverage": q.coverage}
    params.update({f"serving_{k}": v for k, v in q.profile.to_dict().items()})
    best = data["best"]
    tags = {KIND_TAG: "plan", "source": "analytical", "reason": str(data["reason"])[:5000],
            "best_mode": best["mode"] if best else "none",
            "at_risk": str(best.get("at_risk")) if best else "none"}
    run = client.create_run(experiment, run_name=f"plan {q.model.name} {q.hardware.name}",
                            tags=tags)
    run_id = run.info.run_id
    metrics = dict(_finite({k: v for k, v in (best or {}).items()}))
    metrics.update(_finite({k: data["search"][k] for k in ("simulated", "configs", "wall_s")},
                           "search_"))
    client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()],
                     params=[Param(k, str(v)) for k, v in params.items()],
                     tags=[RunTag("plans", str(len(data["plans"])))])
    client.log_text(run_id, json.dumps(data, indent=2, default=str), "plan.json")
    client.set_terminated(run_id, "FINISHED")
    return run_id
