"""What a sweep is: its search space (the hardware backend, objectives and constraints, the
sampler, the guided sampler), the space file's schema and command-line overrides, and the
lease that says which controller holds a study. Below tracking and analysis, which read a
space file and take a study's lease; running a sweep is `sweeper.sweep`, above them
(docs/architecture.md "Layers")."""
