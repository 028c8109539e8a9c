"""What a run reports: expert monitors, the background metrics writer, FLOPs and MFU."""
