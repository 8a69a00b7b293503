"""Tuning: budget-matched Optuna studies on validation data."""
