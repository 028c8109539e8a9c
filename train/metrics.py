"""Reading a run"s metrics.jsonl: the documented path; the code lives in
`train.telemetry.metrics`."""

from train.telemetry.metrics import read_metrics

__all__ = ["read_metrics"]
