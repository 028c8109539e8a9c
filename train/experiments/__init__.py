"""Experiment tools: sweeps and their reports, staged recipes, plots."""
