"""The model under a device mesh: the mesh context, the logical-axis rules table, expert
parallelism and pipelining."""
