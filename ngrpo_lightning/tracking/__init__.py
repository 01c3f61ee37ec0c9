"""What a run reports: the MLflow logger, system metrics, the console."""
