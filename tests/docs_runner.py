"""Run the Python examples of one markdown page, as tests/test_docs.py does for every page.

    python tests/docs_runner.py README.md        (in an empty working directory)

The page's ```python blocks run in order, in one namespace, so a later block may use what an
earlier one made. Two kinds of block are skipped:

- a block whose fence says ``not run`` (```python title="not run: ..."): the docs' placeholders,
  such as an endpoint no test can reach, are marked so;
- a block made only of pymdownx.snippets includes (``--8<-- "examples/FILE.py:NAME"``): it shows
  regions of an example, and tests/test_examples.py runs the example itself.

The examples use a few names that stand for the user's own objects; this runner provides small,
real ones, and only those a page mentions:

- ``unit``, ``train_dataloader``: a torchtnt ``TrainUnit`` and a resumable loader (tests/toy.py);
- ``model``, ``dm``: a ``LightningModule`` and a ``LightningDataModule`` (tests/lightning_toy.py).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: A fenced Python block: its info string (after "python") and its code.
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
#: The marker that keeps a block from running.
NOT_RUN = "not run"
#: A line that includes a file, or a marked region of one, where the site is built.
INCLUDE = re.compile(r'^--8<-- "[^"]+"$')


def blocks(text: str) -> list[tuple[str, str]]:
    """Every ```python block of ``text``: (info string, code)."""
    return [(info.strip(), code) for info, code in FENCE.findall(text)]


def included(code: str) -> bool:
    """Whether a block is made only of snippet includes (and blank lines)."""
    lines = [line for line in code.splitlines() if line.strip()]
    return bool(lines) and all(INCLUDE.match(line) for line in lines)


def runnable(text: str) -> list[str]:
    return [code for info, code in blocks(text) if NOT_RUN not in info and not included(code)]


def _uses(code: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", code) is not None


def fixtures(code: str) -> dict[str, Any]:
    """The user's objects the examples in ``code`` mention, as small real ones."""
    sys.path.insert(0, str(HERE))
    module = types.ModuleType("docs_example")  # a real module: dataclasses and pickle look it up
    sys.modules[module.__name__] = module
    ns: dict[str, Any] = module.__dict__
    if _uses(code, "unit") or _uses(code, "train_dataloader"):
        from toy import StatefulLoader, ToyUnit, make_data

        ns["unit"] = ToyUnit()
        ns["train_dataloader"] = StatefulLoader(make_data(40), batch_size=4)  # 10 steps an epoch
    if _uses(code, "model") or _uses(code, "dm"):
        import pytorch_lightning as pl
        from lightning_toy import ToyModule, plain_loader

        class DataModule(pl.LightningDataModule):
            def train_dataloader(self) -> Any:
                return plain_loader(40, batch_size=4)

        ns["model"] = ToyModule()
        ns["dm"] = DataModule()
    return ns


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    codes = runnable(path.read_text())
    namespace = fixtures("\n".join(codes))
    for i, code in enumerate(codes, 1):
        print(f"--- {path.name}, block {i} of {len(codes)}", flush=True)
        exec(compile(code, f"{path} (python block {i})", "exec"), namespace)
    print(f"ran {len(codes)} blocks of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
