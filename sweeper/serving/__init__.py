"""Serving plans (issue 19, docs/serving.md): the application profile (workload.py), a
deployment (deployment.py), the serving model (simulate.py), the planner (plan.py), error
bands (bands.py); `sweeper serve` runs a deployment for real (serve.py)."""
