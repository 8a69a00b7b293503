"""The store: MLflow tracking, runs' tags and records, claims, reuse, ownership, the UI view."""
