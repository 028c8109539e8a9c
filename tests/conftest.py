"""Test-session set-up for a 2-core CPU, where XLA compile time dominates the suite:

- XLA's backend optimisation level 0 (about half the compile time of a train step; same
  semantics, the tests compare numbers, not speed), unless the caller set XLA_FLAGS;
- one persistent compilation cache shared by the test processes, so a step function compiled by
  one test is not compiled again by another. Cache keys cover the HLO, the JAX version and the
  compile options, so a stale entry is never used;
- the `parity` tests (against Hugging Face transformers, the `.[parity]` extra) need torch,
  transformers and accelerate, the `lm_eval` tests lm-evaluation-harness (the `.[eval]` extra):
  without them they are deselected and the run ends with a loud list of what did not run; under
  CI (CI=true), where `make test` installs the extras, their absence is an error.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402  (after XLA_FLAGS, which the backend reads when it starts)

pytest_plugins = ("suite_schedule",)  # how `make test` shares the tests between its workers


def pytest_configure(config):
    cache = Path(tempfile.gettempdir()) / f"stepjax-test-xla-cache-{os.getuid()}"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures gone), drops JAX's in-memory caches of
    traced and compiled functions: kept for the life of the process they grew each xdist worker
    by gigabytes over the suite, and a later module that compiles the same program finds it in
    the persistent cache."""
    yield
    if nextitem is None or nextitem.path != item.path:
        jax.clear_caches()


# marker -> (the modules its tests import, the extra that installs them)
EXTRAS = {"parity": (("torch", "transformers", "accelerate"), "parity"),
          "lm_eval": (("lm_eval",), "eval")}


def _missing_extras() -> dict[str, str]:
    """{marker: extra} of the markers whose modules are not installed."""
    return {marker: extra for marker, (modules, extra) in EXTRAS.items()
            if not all(importlib.util.find_spec(name) is not None for name in modules)}


def pytest_collection_modifyitems(config, items):
    missing = _missing_extras()
    unrunnable = [item for item in items
                  if any(item.get_closest_marker(marker) for marker in missing)]
    if not unrunnable:
        return
    extras = ", ".join(f".[{extra}]" for extra in missing.values())
    if os.environ.get("CI") == "true":
        raise pytest.UsageError(
            f"{len(unrunnable)} tests need the {extras} extra(s), which CI installs (`make test` "
            "does); they are missing")
    items[:] = [item for item in items if item not in unrunnable]
    config.hook.pytest_deselected(items=unrunnable)
    config.stash[_NOT_RUN] = ([item.nodeid for item in unrunnable], extras)


_NOT_RUN = pytest.StashKey[tuple]()


def pytest_terminal_summary(terminalreporter, config):
    not_run, extras = config.stash.get(_NOT_RUN, ([], ""))
    if not_run:
        terminalreporter.section("TESTS NOT RUN", sep="!", red=True, bold=True)
        terminalreporter.line(f"{len(not_run)} tests against Hugging Face transformers or "
                              f"lm-evaluation-harness did not run: install {extras} "
                              "(`pip install -e '.[parity,eval]'`; torch 2.13.0 is the CPU "
                              "wheel).", red=True, bold=True)
        for nodeid in not_run:
            terminalreporter.line(f"  not run: {nodeid}", red=True)
