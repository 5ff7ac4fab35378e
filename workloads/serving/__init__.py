"""Serving on the engine and its model: everything about a request stream served by a
deployment, below `sweeper.serving` (the planner and `sweeper serve`) and the sweep's mesh
workers, which import it from here (docs/architecture.md, "Layers").

- `profile`: the application profile (`AppProfile`, `Request`, a space's `serving:` block);
- `model`: the serving model, a discrete-event simulation of a deployment serving a stream;
- `slots`: slot serving on the sharded engine and the serving loops (`SlotServer`,
  `serve_aggregated`, `serve_prefill_slice`, `serve_decode_slice`);
- `pipeline`: pipeline stages on the emulated mesh (`StagedEngine`, `StagedSlotServer`);
- `costs`: the serving loop's host costs, declared once (`HostCosts`);
- `hostcosts`: the serving loop's host costs, measured on a slot server outside any stream;
- `trial`: a serving trial of a sweep (`run_serving_trial`).

Nothing is imported here: `slots` and `pipeline` import JAX, while `profile` and `model`
are read by processes that never start it.
"""
