"""Where a sweep is recorded: MLflow runs, Optuna study helpers, sync, trials as one table."""
