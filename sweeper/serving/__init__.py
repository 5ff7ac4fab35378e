"""Serving plans (issue 19, docs/serving.md): a deployment (deployment.py), the serving model
(simulate.py), the planner (plan.py), error bands (bands.py), serving host costs
(overheads.py); `sweeper serve` runs a deployment for real (serve.py). The application
profile is workloads/servingprofile.py: the sweep's serving trials read it too."""
