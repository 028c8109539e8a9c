"""Training: data (grain), Muon/AdamW, the jitted step, monitors, checkpoints, CLI (`python -m train`)."""
