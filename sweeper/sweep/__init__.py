"""Running a sweep: the controller's trial loop, the Ray session and worker pools, recording,
study naming, pre-flight checks. What a sweep is (its space, schema, lease) is sweeper.spec."""
