"""Running a sweep: the search space, the controller, worker pools, the guided sampler."""
