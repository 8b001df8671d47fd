"""The README's promises name their tests: every test it names exists.

The guarantee table says "each promise is proved by the named test"; a test renamed or removed
would leave a promise that nothing proves. This reads every ``tests/FILE.py::name`` (and the
``::name`` shorthands that follow one in the same cell) and checks that the file defines it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(::[\w\[\]|.-]+)?`|`::([\w\[\]|.-]+)`")


def _named_tests() -> list[tuple[str, str]]:
    """(file, test name) for every test the README names, the shorthands resolved."""
    found = []
    for line in (ROOT / "README.md").read_text().splitlines():
        current = None
        for match in _REFERENCE.finditer(line):
            if match.group(1):
                current = match.group(1)
                if match.group(2):
                    found.append((current, match.group(2)[2:]))
            elif current is not None:
                found.append((current, match.group(3)))
    return found


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_every_test_the_readme_names_exists():
    named = _named_tests()
    assert len(named) > 50  # the guarantee table and the sections name many
    missing = []
    for file, name in named:
        path = ROOT / file
        base = name.split("[", 1)[0]  # a parametrised id names its function
        if not path.is_file() or base not in _defined(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"the README names tests that do not exist: {missing}"


def test_every_test_file_the_readme_names_exists():
    files = set(re.findall(r"`(tests/[\w/]+\.py)", (ROOT / "README.md").read_text()))
    assert files
    assert sorted(f for f in files if not (ROOT / f).is_file()) == []
