"""The user documentation (README.md and docs/*.md) names only things that exist: every config
and repository path, every `python -m` command and each of its `--flags` (read from the
command's own `--help`, run in this process: nothing compiles), every `make` target, every
relative link and #anchor; and no line names an issue number."""

import contextlib
import functools
import glob
import importlib
import importlib.util
import inspect
import io
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_DIRS = ("configs", "model", "train", "rl", "pallas_kernels", "benchmarks", "tests", "docs",
            "notebooks")


def page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def text(page: Path) -> str:
    """The page with `\\`-continued lines joined (a command split over lines is one line)."""
    return re.sub(r"\\\n\s*", " ", page.read_text())


def expand(pattern: str) -> list[str]:
    """`a/{x,y}.yaml` -> [a/x.yaml, a/y.yaml]."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [path for option in match.group(1).split(",")
            for path in expand(pattern[:match.start()] + option + pattern[match.end():])]


def repo_paths(page: Path) -> list[str]:
    """Repository paths the page names in backticks or links (`configs/tiny.yaml`, `model/ops/`,
    `tests/rl/test_rl_distill_*.py`, `configs/ablation/100b_a10b_{sink,gate}.yaml`)."""
    pattern = r"(?<![\w./-])((?:%s)/[\w./{},*+-]*)" % "|".join(TOP_DIRS)
    found = set()
    spans = re.findall(r"```.*?```|`[^`\n]+`|\]\([^)\s]+\)", text(page), flags=re.S)
    for span in spans:
        for candidate in re.findall(pattern, span):
            candidate = candidate.rstrip(".,")
            if "." in candidate.rsplit("/", 1)[-1] or candidate.endswith("/"):
                found.add(candidate)
    return sorted(found)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_paths_exist(page):
    missing = [path for path in repo_paths(page)
               if not any(glob.glob(str(REPO / each)) for each in expand(path))]
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


def test_every_shipped_config_is_documented():
    named = [each for page in PAGES for path in repo_paths(page) for each in expand(path)]
    configs = sorted(path.relative_to(REPO).as_posix() for path in REPO.glob("configs/**/*.yaml"))
    undocumented = [config for config in configs
                    if not any(Path(config).match(pattern) for pattern in named)]
    assert configs and not undocumented, f"configs no page names: {undocumented}"


def commands(page: Path) -> list[tuple[str, str]]:
    """(module, its arguments up to the end of the line, a comment or a closing backtick) for
    every `python -m MODULE` on the page."""
    return re.findall(r"python -m ([A-Za-z_][\w.]*)([^`\n#]*)", text(page))


def main_module(module: str):
    """The module whose `main` `python -m module` runs (a package's __main__)."""
    if importlib.util.find_spec(module).submodule_search_locations is not None:
        module += ".__main__"
    return importlib.import_module(module)


@functools.lru_cache(maxsize=None)
def help_text(module: str, subcommand: str | None) -> str:
    """`python -m module [subcommand] --help`, run in this process (argparse prints, then exits
    or `main` returns its status)."""
    main = main_module(module).main
    argv = ([subcommand] if subcommand else []) + ["--help"]
    out = io.StringIO()
    saved = sys.argv
    try:
        with contextlib.redirect_stdout(out):
            if inspect.signature(main).parameters:
                status = main(argv)
            else:  # a benchmark's main() reads sys.argv
                sys.argv = [module, *argv]
                status = main()
    except SystemExit as exited:
        status = exited.code
    finally:
        sys.argv = saved
    assert status in (0, None), f"python -m {module} {' '.join(argv)}: exit status {status}"
    assert "usage:" in out.getvalue(), f"python -m {module} {' '.join(argv)} printed no usage"
    return out.getvalue()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_m_commands_exist_with_their_flags(page):
    problems = []
    for module, args in commands(page):
        if importlib.util.find_spec(module) is None:
            problems.append(f"python -m {module}: no such module")
            continue
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args))
        if not flags:
            continue
        first = args.split()[0] if args.split() else ""
        subcommand = first if re.fullmatch(r"[a-z]+", first) and module == "model.hf" else None
        known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(module, subcommand)))
        problems += [f"python -m {module} {subcommand or ''} {flag}: not in its --help"
                     for flag in sorted(flags - known)]
    assert not problems, f"{page_id(page)}: " + "; ".join(problems)


# The override spelling of each tool (`python -m train model.layout=...`, `python -m model.summary
# layout=...`) and the config classes its keys name fields of.
def _override_fields() -> dict[str, list[str]]:
    from model.config import ModelConfig, dotted_names
    from rl.config import RLConfig
    from rl.task_config import TaskMixConfig
    from train.config import MeshConfig, TrainConfig
    run = [*dotted_names(ModelConfig, "model."), *dotted_names(TrainConfig, "train."),
           *dotted_names(MeshConfig, "mesh.")]
    rl = [*dotted_names(RLConfig, "rl."), *dotted_names(TaskMixConfig, "task."),
          *dotted_names(ModelConfig, "model."), "task.max_operand", "task.ops", "task.name"]
    model = dotted_names(ModelConfig)
    return {"train": run, "train.sweep": run, "rl": rl, "model.summary": model,
            "model.flops": model}


def _names_a_field(key: str, known: list[str]) -> bool:
    """`key` is a field, or lies inside a field that holds a mapping (`task.tasks.add.weight`,
    `train.data.mixture.code`): the longest known prefix is not a group of fields."""
    groups = {name.rsplit(".", 1)[0] for name in known if "." in name}
    parts = key.split(".")
    prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    longest = next((p for p in prefixes if p in known), None)
    return longest is not None and (longest == key or longest not in groups)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_overrides_in_commands_name_fields_in_their_tools_spelling(page):
    tools = _override_fields()
    problems = []
    for module, args in commands(page):
        if module not in tools:
            continue
        for key, value in re.findall(r"(?<![\w.=/-])([a-z_]\w*(?:\.\w+)*)=(\S*)", args):
            placeholder = value.rstrip("]") in ("...", "value")  # `[train.x=...]`, `key=value`
            if not placeholder and not _names_a_field(key, tools[module]):
                problems.append(f"python -m {module} ... {key}=")
    assert not problems, f"{page_id(page)}: overrides that name no field: {problems}"


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
    code = [span for page in PAGES
            for span in re.findall(r"```.*?```|`[^`\n]+`", text(page), flags=re.S)]
    named = {target for span in code for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", span)}
    assert named, "the docs name no make target"
    assert named <= targets, f"make targets the docs name but the Makefile lacks: {named - targets}"


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        match = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_and_anchors_resolve(page):
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", body):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(link)
    assert not broken, f"{page_id(page)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_issue_numbers(page):
    lines = [f"{number}: {line.strip()}"
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if re.search(r"(?i)\bissues?\s*#?\d|(?<![\w&/])#\d+\b", line)]
    assert not lines, f"{page_id(page)} names issue numbers:\n" + "\n".join(lines)


def test_slug_matches_githubs():
    assert slug("GPU run: one NVIDIA H200") == "gpu-run-one-nvidia-h200"
    assert slug("`configs/gpu_1b.yaml`") == "configsgpu_1byaml"
    assert slug("Toggle (Kimi K2.5)") == "toggle-kimi-k25"
