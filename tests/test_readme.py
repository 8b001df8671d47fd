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
    section = README[README.index("## Set-up") :]
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
