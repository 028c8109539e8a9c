"""Test-session set-up for a 2-core CPU, where XLA compile time dominates the suite:

- XLA's backend optimisation level 0 (about half the compile time of a train step; same
  semantics, the tests compare numbers, not speed), unless the caller set XLA_FLAGS;
- one persistent compilation cache shared by the test processes, so a step function compiled by
  one test is not compiled again by another. Cache keys cover the HLO, the JAX version and the
  compile options, so a stale entry is never used.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402  (after XLA_FLAGS, which the backend reads when it starts)


def pytest_configure(config):
    cache = Path(tempfile.gettempdir()) / f"stepjax-test-xla-cache-{os.getuid()}"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
