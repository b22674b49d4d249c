"""DVC stages: one thin module per stage (read params, call the library, write outputs, log to MLflow)."""
