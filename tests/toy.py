"""Small real training setups shared by the tests: a torchtnt unit, a stateful loader, a toy run
with a saver, and a small real disk to fill."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
from dir_listing import snapshots_by_step
from torchtnt.framework.state import State
from torchtnt.framework.unit import EvalUnit, TrainUnit

from tnt_snapshot_plugin.demo_data import Batch, ResumableLoader, make_data  # noqa: F401  (re-exported)

# The tests' name for the package's resumable loader.
StatefulLoader = ResumableLoader


class ToyUnit(TrainUnit[Batch], EvalUnit[Batch]):
    """A regression unit whose step draws from every RNG: dropout (torch), random, numpy."""

    def __init__(self, seed: int = 0, fail_at_step: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.fail_at_step = fail_at_step

    def train_step(self, state: State, data: Batch) -> None:
        if self.fail_at_step is not None and self.train_progress.num_steps_completed == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.fail_at_step}")
        x, y = data
        # Python's and numpy's RNGs scale the loss (and so the gradients): their state must
        # resume exactly for the weights to match.
        scale = 1.0 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.mse_loss(self.model(x), y) * scale
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def on_train_epoch_end(self, state: State) -> None:
        self.lr_scheduler.step()

    def eval_step(self, state: State, data: Batch) -> None:
        with torch.no_grad():
            self.model(data[0])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def weights(unit: ToyUnit) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in unit.model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


class Holder:
    """A Stateful returning whatever state dict the test sets."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def train_toy(dirpath: Any, unit: ToyUnit, steps: int, *, epochs: int = 1, callbacks: Iterable[Any] = (),
              **saver_kwargs: Any) -> ToyUnit:
    """Train ``unit`` for ``epochs`` epochs of ``steps`` steps (batches of 4 from
    ``make_data(4 * steps)``) with a TorchSnapshotSaver on ``dirpath`` given ``saver_kwargs``,
    followed by ``callbacks``; the unit."""
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    saver = TorchSnapshotSaver(str(dirpath), **saver_kwargs)
    train(unit, StatefulLoader(make_data(4 * steps)), max_epochs=epochs, callbacks=[saver, *callbacks])
    return unit


def dead_pid() -> int:
    """The pid of a process of this host that has exited: a writer that is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


# -- a small real disk ---------------------------------------------------------------------------

PAGE = 4096
#: the payload that dominates the size of a unit_with_payload() snapshot (1 MiB of float32)
BIG = 256 * 1024


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes (whole pages) mounted at ``where``; unmounted afterwards."""
    import pytest

    where.mkdir()
    pages = -(-size // PAGE)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE // 1024}k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"these tests mount a small tmpfs and need root: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def footprint(path: Path) -> int:
    """Bytes a directory tree takes on tmpfs: every file rounded up to whole pages."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += -(-os.path.getsize(os.path.join(root, name)) // PAGE) * PAGE
    return total


def unit_with_payload(seed: int = 0) -> ToyUnit:
    """A ToyUnit holding BIG float32 values besides its model, so its size is known."""
    unit = ToyUnit(seed=seed)
    unit.payload = Holder({"big": torch.randn(BIG, generator=torch.Generator().manual_seed(seed))})
    return unit


def snapshot_footprint(tmp_path: Path) -> int:
    """The tmpfs footprint of one snapshot of unit_with_payload() (written on ordinary disk)."""
    probe = tmp_path / "probe"
    train_toy(probe, unit_with_payload(), 1, save_every_n_train_steps=1, async_snapshot=False)
    return max(footprint(probe / name) for name in snapshots_by_step(probe))
