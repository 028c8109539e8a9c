"""Training at scale: the device mesh and state/batch shardings, multi-host start-up and the
memory planner."""
