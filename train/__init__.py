"""Training: config, state, the jitted step, losses, the loop, evaluation and `python -m train`;
the rooms below hold data, optimizers, parallelism, telemetry and experiment tools."""
