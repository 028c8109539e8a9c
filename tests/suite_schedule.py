"""How `make test` (pytest -n 2 --dist loadfile) shares the suite between its two workers.

- A module is the unit of work: one worker runs the whole module, so its module-scoped fixtures
  (a trained workdir, a compiled model) and the functions its tests trace and compile are built
  once, not once per worker. JOINED modules share a unit with another module.
- The units in HEAVY first, in that order, the rest in collection order: the last units handed
  out are then short ones and neither worker idles long at the end (xdist hands out the units in
  the order the workers collected them; it would otherwise sort them by their number of tests).

HEAVY is kept by hand: the modules costing about 25 CPU seconds or more alone, measured with
`/usr/bin/time python -m pytest FILE -n 0` on a cold cache or read off `--durations` of `make
test`. A heavy module missing from it still runs, only maybe late.

(`xdist_group` marks would say the same per test, but `--dist loadgroup` ignores them under
pytest >= 9.2, whose node ids xdist 3.8 can no longer suffix with the group: pytest-xdist issue
1386. The scheduler below needs only the module path, which every version gives.)
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

# module -> the module whose unit it joins, and why
JOINED = {
    # the session's reference run of the fault tests, made once
    "tests/train/test_faults_files.py": "tests/train/test_faults.py",
    # small_lm.baseline(), compiled once per process
    "tests/model/test_model_variants.py": "tests/model/test_model_heads.py",
}

HEAVY = (
    "tests/train/test_faults.py",  # with test_faults_files.py
    "tests/train/test_parallel.py",
    "tests/train/test_context_parallel.py",
    "tests/train/test_plan_measure.py",
    "tests/rl/test_rl_loop.py",
    "tests/model/test_model_heads.py",  # with test_model_variants.py
    "tests/model/test_decode.py",
    "tests/train/test_train.py",
    "tests/train/test_run_record.py",
    "tests/model/test_decode_shared_kv.py",
    "tests/model/test_hf_deepseek_v4_parity.py",
    "tests/train/test_deepseek_v4_training.py",
    "tests/test_gpu_suite.py",
    "tests/train/test_multihost.py",
    "tests/train/test_interrupts.py",
    "tests/rl/test_rl_mesh.py",
    "tests/train/test_notebook.py",
    "tests/train/test_chat_sft.py",
    "tests/train/test_periodic_evals.py",
    "tests/train/test_mixed_precision.py",
    "tests/pallas_kernels/test_pallas_moe.py",
    "tests/model/test_decode_mimo.py",
    "tests/model/test_kv_compression.py",
    "tests/model/test_attention_cores.py",
    "tests/rl/test_rl_distill_teachers.py",
    "tests/test_lowering.py",
    "tests/pallas_kernels/test_pallas_attention.py",
    "tests/pallas_kernels/test_pallas_model.py",
)


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the module JOINED names."""
    module = nodeid.split("::")[0]
    return JOINED.get(module, module)


class ModuleScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return unit(nodeid)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: still loads under `-p no:xdist`
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return ModuleScheduling(config, log)
    return None


def pytest_configure(config):
    config.option.loadscopereorder = False  # keep the workers' order (below)


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is None:  # not an xdist worker
        return
    rank = {module: index for index, module in enumerate(HEAVY)}
    items.sort(key=lambda item: rank.get(unit(item.nodeid), len(rank)))  # stable
