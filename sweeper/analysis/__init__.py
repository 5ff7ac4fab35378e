"""From stored trials to answers: calibration, Pareto frontiers, plots, the HTML report."""
