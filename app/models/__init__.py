"""Model runners: one per task, behind the `ModelRunner` protocol."""
