"""The README: short, its set-up commands are what CI runs, and what it says about installing holds.

Its Python examples run in tests/test_docs.py, with every page of the docs; the tests it names
are checked there too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _setup_block() -> list[str]:
    section = README[README.index("## Develop") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_the_readme_is_read_in_minutes():
    assert len(README.splitlines()) <= 200


def test_two_setup_commands_and_ci_runs_the_readmes_test_command_exactly():
    install, tests = _setup_block()
    assert install.endswith(".venv/bin/tnt-snapshot-demo") and "-c constraints.txt" in install
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"CI does not run the README's test command {tests!r}"
    assert ci[-1] == tests  # the tests come last, after the docs are built
    assert "mkdocs build --strict" in "\n".join(ci)


def test_what_the_readme_says_about_torchs_cpu_wheel_is_a_pip_command():
    # constraints.txt pins versions only; the CPU wheel comes from PyTorch's own index.
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
    assert "pins the CPU wheel" not in README
    assert not re.search(r"constraints\.txt` pins `?torch==[\d.]+`? \(the CPU wheel", README)


def test_the_extras_the_readme_names_exist():
    setup = (ROOT / "setup.cfg").read_text()
    extras = set(re.findall(r"^(\w+) =$", setup.split("[options.extras_require]")[1].split("[options.entry_points]")[0], flags=re.M))
    line = next(line for line in README.splitlines() if line.startswith("Extras:"))
    named = set(re.findall(r"`(\w+)`", line + README.split(line, 1)[1].split("\n\n", 1)[0]))
    assert named and named <= extras, named - extras


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", README, flags=re.M)


def test_the_readme_says_what_it_is_then_how_to_use_it_and_the_contributors_setup_last():
    sections = _sections()
    assert sections[0] == "Install"
    assert sections.index("torchtnt quickstart") < sections.index("Lightning quickstart") < sections.index("Develop")
    assert sections.index("What it promises") < sections.index("Develop")
    assert sections[-1] == "Develop"
    promises = README.split("## What it promises\n", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"^- ", promises, flags=re.M)) == 5


def test_how_to_resume_is_one_click_from_the_readme_and_starts_with_code():
    assert "(docs/resume.md)" in README.split("## Develop")[0]
    page = (ROOT / "docs" / "resume.md").read_text()
    title, first_paragraph, rest = page.split("\n\n", 2)
    assert title.startswith("# Resume")
    assert rest.startswith("```python"), "docs/resume.md: working code comes right after the task"
    code = rest.split("```python", 1)[1].split("\n```\n", 1)[0]
    # the whole quickstart, which tests/test_examples.py runs, restore_from_latest included
    quoted = [f'--8<-- "examples/torchtnt_quickstart.py:{name}"' for name in ("imports", "model", "data", "quickstart")]
    assert all(line in code for line in quoted), code
    assert "restore_from_latest" in (ROOT / "examples" / "torchtnt_quickstart.py").read_text()

def test_the_readmes_install_step_is_the_one_ci_runs():
    install, _ = _setup_block()
    ci = (ROOT / ".ci" / "run").read_text()
    assert install.startswith("python3 -m venv .venv && ") and "python3 -m venv .venv\n" in ci
    assert ".venv/bin/pip install -c constraints.txt -e \".[all]\"" in install
    assert ".venv/bin/pip install -q -c constraints.txt -e \".[all," in ci  # the same, plus the docs' extra
