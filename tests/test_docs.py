"""The documentation: every Python example runs, every page is in the site, every test a page
names exists, the guides name none, every warning says what to do, the command-line reference
holds every command, and no page reads like a lab notebook.

Each page's examples run in a fresh interpreter in an empty directory (tests/docs_runner.py), in
order, with small real stand-ins for the user's objects (``unit``, ``model``, ...). A block is
skipped only when its fence says ``not run``, or when it only includes regions of an example,
which tests/test_examples.py runs (see docs/contributing.md).

The site follows the Diataxis split. The pages under "Reference" in mkdocs.yml's nav may name
tests; guarantees.md is the audit trail that does. Every other page, the README included, is a
tutorial, a guide or an explanation, and names no test file.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_runner import NOT_RUN, blocks, included, runnable

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Documents users read besides the pages of the site.
USER_FACING = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(::[\w\[\]|.-]+)?`|`::([\w\[\]|.-]+)`")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.slow
@pytest.mark.frameworks
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p.read_text())], ids=_rel)
def test_every_python_example_runs(page, tmp_path):
    count = len(runnable(page.read_text()))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs_runner.py"), str(page)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{_rel(page)}: an example failed\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert f"ran {count} blocks" in done.stdout


def test_the_examples_that_do_not_run_are_few_and_marked():
    skipped = []
    for page in PAGES:
        for info, code in blocks(page.read_text()):
            if included(code):
                continue  # an example's regions: tests/test_examples.py runs the example
            assert info == "" or NOT_RUN in info, f"{_rel(page)}: a python fence with {info!r}"
            if NOT_RUN in info:
                skipped.append(_rel(page))
    ran = sum(len(runnable(p.read_text())) for p in PAGES)
    assert ran >= 10 and len(skipped) <= 3, (ran, skipped)


def test_the_runner_finds_blocks_and_honours_the_marker():
    text = "x\n```python\na = 1\n```\n\n```python title=\"not run: an endpoint\"\nb = 2\n```\n```bash\nc\n```\n"
    assert blocks(text) == [("", "a = 1\n"), ('title="not run: an endpoint"', "b = 2\n")]
    assert runnable(text) == ["a = 1\n"]
    quoted = '```python title="examples/x.py"\n--8<-- "examples/x.py:a"\n\n--8<-- "examples/x.py:b"\n```\n'
    assert included(blocks(quoted)[0][1]) and runnable(quoted) == []
    assert runnable(quoted.replace('\n\n--8<--', '\nc = 3\n--8<--')) != []  # code beside an include runs


def test_every_page_is_in_the_site_and_every_link_of_the_nav_exists():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.findall(r":\s+([\w/-]+\.md)\s*$", config, flags=re.M)
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert set(nav) <= pages, f"the nav names missing pages: {set(nav) - pages}"
    assert pages <= set(nav), f"pages left out of the nav: {pages - set(nav)}"
    for name in re.findall(r"\(docs/([\w-]+\.md)[)#]", (ROOT / "README.md").read_text()):
        assert (ROOT / "docs" / name).is_file(), f"the README links to docs/{name}, which does not exist"


def _named_tests() -> list[tuple[str, str, str]]:
    """(page, file, test name) for every test a page names, the ``::name`` shorthands resolved."""
    found = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            current = None
            for match in _REFERENCE.finditer(line):
                if match.group(1):
                    current = match.group(1)
                    if match.group(2):
                        found.append((_rel(page), current, match.group(2)[2:]))
                elif current is not None:
                    found.append((_rel(page), current, match.group(3)))
    return found


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_every_test_the_docs_name_exists():
    named = _named_tests()
    assert len(named) > 50  # the guarantees, the Lightning switch table and others name many
    missing = []
    for page, file, name in named:
        path = ROOT / file
        base = name.split("[", 1)[0]  # a parametrised id names its function
        if not path.is_file() or base not in _defined(path):
            missing.append(f"{page}: {file}::{name}")
    assert not missing, f"the docs name tests that do not exist: {missing}"


#: What a diary or a scoreboard reads like; user-facing text says what the software does.
_DIARY = re.compile(
    r"\bI (measured|tried|dropped|found|ran|kept|made|think)\b|\b[Tt]his session\b|\bthis run, of\b"
    r"|\b\d+ of \d+ targets\b|\btargets met\b|\b[Ww]e (measured|tried|found)\b"
)


def test_no_page_reads_like_a_diary_or_keeps_a_tally():
    found = []
    for doc in USER_FACING:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if _DIARY.search(line):
                found.append(f"{_rel(doc)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_no_docstring_reads_like_a_diary():
    found = []
    for folder in ("tnt_snapshot_plugin", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node) or ""
                    if _DIARY.search(doc):
                        found.append(f"{_rel(path)}: {getattr(node, 'name', '<module>')}")
    assert not found, found


_MODULES = (
    "app_state|cadence|checksums|cli|config|distributed|errors|fileio|format|hookspecs|index|loading"
    "|metrics|naming|plugins|policies|preemption|restoring|retention|stores|verify|writer_job"
)
#: A backquoted dotted name of the package's own code: `format.plan_cache.PlanCache`, `fileio.READ_THREADS`.
_CODE_NAME = re.compile(rf"`((?:tnt_snapshot_plugin\.)?(?:{_MODULES})\.[A-Za-z_][\w.]*)(?:\(\))?`")


def _resolves(dotted: str) -> bool:
    import importlib

    if dotted.endswith(".py"):  # a file of the package, named by its file name
        return any((ROOT / "tnt_snapshot_plugin").rglob(dotted.rsplit(".", 1)[0].split(".")[-1] + ".py"))
    parts = dotted.split(".")
    if parts[0] != "tnt_snapshot_plugin":
        parts.insert(0, "tnt_snapshot_plugin")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.frameworks
def test_every_name_of_the_code_the_docs_mention_exists():
    missing = []
    for doc in USER_FACING:
        for match in _CODE_NAME.finditer(doc.read_text()):
            if not _resolves(match.group(1)):
                missing.append(f"{_rel(doc)}: {match.group(1)}")
    assert not missing, f"the docs name code that does not exist (renamed or moved?): {missing}"


# -- the Diataxis split: guides name no test; the reference holds what it lists -----------------

#: A test file named in a page: a path under tests/, or a module named test_*.py.
_TEST_FILE = re.compile(r"\btests/[\w/]*\.py\b|\btest_\w+\.py\b|`::test_\w+")
#: Pages outside the reference that may name tests: the contributor's page says how to run them.
_MAY_NAME_TESTS = {"contributing.md"}


def _nav_section(title: str) -> list[str]:
    config = (ROOT / "mkdocs.yml").read_text()
    section = re.search(rf"^  - {re.escape(title)}:\n((?:      - .*\n)+)", config, flags=re.M)
    assert section is not None, f"mkdocs.yml's nav has no {title!r} section"
    return re.findall(r":\s+([\w/-]+\.md)\s*$", section.group(1), flags=re.M)


def _reference_pages() -> set[str]:
    """The pages under "Reference" in mkdocs.yml's nav."""
    return set(_nav_section("Reference"))


def guide_problems(page: str, text: str) -> list[str]:
    """Where a tutorial, guide or explanation page names a test file (empty: it names none)."""
    return [
        f"{page}:{n}: {match.group(0)}"
        for n, line in enumerate(text.splitlines(), 1)
        for match in _TEST_FILE.finditer(line)
    ]


def test_no_guide_names_a_test():
    reference = _reference_pages()
    assert {"guarantees.md", "errors.md", "api.md", "cli-reference.md"} <= reference
    guides = [p for p in PAGES if p.name not in reference | _MAY_NAME_TESTS]
    assert ROOT / "README.md" in guides and len(guides) >= 15
    problems = [problem for page in guides for problem in guide_problems(_rel(page), page.read_text())]
    assert not problems, "guides name tests; move them to docs/guarantees.md:\n" + "\n".join(problems)
    # the check itself: each way of naming a test is found
    named = "see `tests/test_s3.py`\nor test_cli.py\nand `::test_a_thing`\nnot tests of it, nor test_ alone"
    assert [p.split(": ", 1)[1] for p in guide_problems("page.md", named)] == [
        "tests/test_s3.py", "test_cli.py", "`::test_a_thing"
    ]


def test_every_warning_has_a_section_saying_what_to_do():
    from tnt_snapshot_plugin import errors

    page = (ROOT / "docs" / "warnings.md").read_text()
    sections = dict(re.findall(r"^### `(\w+)`[^\n]*\n(.*?)(?=^#|\Z)", page, flags=re.M | re.S))
    categories = {
        name for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.SnapshotWarning) and value is not errors.SnapshotWarning
    }
    assert len(categories) >= 15
    assert set(sections) == categories, set(sections) ^ categories
    for name, body in sections.items():
        assert "What to do:" in body, f"docs/warnings.md: {name} does not say what to do"


def _cli_reference_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_reference_hook", ROOT / "docs" / "hooks" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_holds_every_command_and_option():
    """docs/cli-reference.md holds the hook's marker, mkdocs.yml runs the hook, and what the hook
    renders names every command of the group and every option of each, as click defines them."""
    import click

    from tnt_snapshot_plugin.cli import cli

    hook = _cli_reference_hook()
    assert hook.MARKER in (ROOT / "docs" / "cli-reference.md").read_text()
    assert "docs/hooks/cli_reference.py" in (ROOT / "mkdocs.yml").read_text()
    rendered = hook.render()
    assert hook.on_page_markdown(f"# x\n\n{hook.MARKER}\n", None, None, None) == f"# x\n\n{rendered}\n"
    assert hook.on_page_markdown("# other page\n", None, None, None) == "# other page\n"
    commands = cli.list_commands(click.Context(cli))
    assert {"ls", "inspect", "verify", "prune", "diff", "export"} <= set(commands)
    for name in commands:
        assert f"## `{name}`" in rendered, name
        command = cli.get_command(click.Context(cli), name)
        assert command is not None
        ctx = click.Context(command, info_name=name)
        for param in command.params:
            if isinstance(param, click.Argument):
                assert f"`{param.make_metavar(ctx)}` | argument" in rendered, f"{name} {param.name}"
            else:
                assert all(opt in rendered for opt in param.opts), f"{name} {param.opts}"
    assert "--version" in rendered


#: A how-to guide shows code within this many lines of its top: the task, then how to do it.
CODE_WITHIN_LINES = 12


def test_every_how_to_guide_starts_with_the_task_and_its_code():
    guides = _nav_section("How-to guides")
    assert "resume.md" in guides and len(guides) >= 10
    late = []
    for name in guides:
        lines = (ROOT / "docs" / name).read_text().splitlines()
        assert lines[0].startswith("# "), f"docs/{name} starts with its title"
        first_fence = next((n for n, line in enumerate(lines) if line.startswith("```")), len(lines))
        if first_fence >= CODE_WITHIN_LINES:
            late.append(f"docs/{name}: first code at line {first_fence + 1}")
    assert not late, late
