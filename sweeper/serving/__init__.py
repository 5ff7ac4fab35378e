"""Serving plans (issue 19, docs/serving.md): the planner (plan.py), error bands (bands.py),
serving host costs (overheads.py); `sweeper serve` runs a deployment for real (serve.py,
server.py). The deployment (workloads/deployment.py), the serving model
(workloads/serving/model.py) and the application profile (workloads/serving/profile.py) sit in
`workloads`, one layer down, so the sweep's serving trials use them too (each trial's
prediction, docs/space-files.md "Serving trials")."""
