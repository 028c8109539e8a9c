"""The model under a device mesh: the mesh context, the logical-axis rules table, expert
parallelism, pipelining and context parallelism (sequences split over `context`)."""
