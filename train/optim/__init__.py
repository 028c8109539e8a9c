"""Optimizers: hyperparameter groups, Muon, the Muon/AdamW/frozen parameter groups and the
learning-rate schedules."""
