"""tests/suite_schedule.py names real modules: a renamed or removed test file would otherwise
drop out of its hand-kept lists without a word (and run late, or alone)."""

from pathlib import Path

from suite_schedule import HEAVY, JOINED, unit

REPO = Path(__file__).resolve().parents[1]


def test_every_listed_module_exists():
    listed = [*HEAVY, *JOINED, *JOINED.values()]
    assert [name for name in listed if not (REPO / name).is_file()] == []


def test_joined_modules_share_one_unit_and_others_are_their_own():
    for module, host in JOINED.items():
        assert unit(f"{module}::test_x[a::b]") == unit(f"{host}::test_y") == host
    assert unit("tests/test_layout.py::test_z") == "tests/test_layout.py"
