"""The demo job for torchtnt: train, get interrupted, resume from the latest snapshot.

Run it through the demo command: ``tnt-snapshot-demo --framework torchtnt``.
(No ``from __future__ import annotations`` here: torchtnt inspects ``train_step``'s annotations
and logs a complaint on every step when they are strings.)
"""

import random
import time
from typing import Any, Optional

import torch
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import Batch, ResumableLoader, make_data


class Interrupted(RuntimeError):
    """Stands in for whatever kills a real job (a node failure, an OOM, a bug)."""


class DemoUnit(TrainUnit[Batch]):
    def __init__(self, seed: int, interrupt_at: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1),
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.interrupt_at = interrupt_at

    def train_step(self, state: State, data: Batch) -> None:
        if self.train_progress.num_steps_completed == self.interrupt_at:
            raise Interrupted(f"simulated crash before step {self.interrupt_at + 1}")
        x, y = data
        loss = torch.nn.functional.mse_loss(self.model(x), y) * (1.0 + 1e-6 * random.random())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def on_train_epoch_end(self, state: State) -> None:
        self.lr_scheduler.step()


class Paced(Callback):
    """Stands in for a real step's length. The demo's steps take a millisecond, less than writing
    a snapshot; a real step takes longer. Before a snapshot is due (listed before the saver, this
    runs first), it waits for the previous one to be written, as a longer step would, so the
    saver never waits on its own previous snapshot (no ``SnapshotBusyWarning``)."""

    def __init__(self, saver: TorchSnapshotSaver, every: int, steps_per_epoch: int) -> None:
        self.saver, self.every, self.steps_per_epoch = saver, every, steps_per_epoch

    def on_train_step_end(self, state: State, unit: TrainUnit[Batch]) -> None:
        step = unit.train_progress.num_steps_completed
        if step % self.every == 0 or step % self.steps_per_epoch == 0:
            self.saver.snapshotter.wait()


def _loader(steps_per_epoch: int) -> ResumableLoader:
    return ResumableLoader(make_data(8 * steps_per_epoch, seed=1, features=16), batch_size=8, seed=2)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def demo(dirpath: str, *, epochs: int, steps_per_epoch: int, interrupt_at: int) -> dict[str, Any]:
    """Train into ``dirpath``, crash at ``interrupt_at``, resume, compare with an uninterrupted run."""
    # Not a divisor of the epoch length, so a step snapshot is never followed at once by the
    # epoch-end snapshot (which would have to wait for it).
    every = max(1, steps_per_epoch // 2 - 1)
    report: dict[str, Any] = {"framework": "torchtnt", "dirpath": dirpath, "every_n_steps": every}

    _seed(0)
    unit = DemoUnit(seed=0, interrupt_at=interrupt_at)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=every, save_every_n_epochs=1)
    paced = Paced(saver, every, steps_per_epoch)
    started = time.perf_counter()
    try:
        train(unit, _loader(steps_per_epoch), max_epochs=epochs, callbacks=[paced, saver])
    except Interrupted as exc:
        report["interrupted"] = str(exc)
    report["first_run_s"] = time.perf_counter() - started
    report["saved"] = list(saver.snapshotter.stats.committed)
    report["busy_waits"] = saver.snapshotter.stats.busy_waits

    _seed(12345)  # a new process would not share the crashed one's RNG state
    resumed = DemoUnit(seed=999)
    loader = _loader(steps_per_epoch)
    started = time.perf_counter()
    TorchSnapshotSaver.restore_from_latest(dirpath, resumed, train_dataloader=loader)
    report["restore_s"] = time.perf_counter() - started
    report["restored_step"] = resumed.train_progress.num_steps_completed
    report["restored_epoch"] = resumed.train_progress.num_epochs_completed
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=every, save_every_n_epochs=1)
    started = time.perf_counter()
    train(resumed, loader, max_epochs=epochs, callbacks=[Paced(saver, every, steps_per_epoch), saver])
    report["resumed_run_s"] = time.perf_counter() - started
    report["saved_after_resume"] = list(saver.snapshotter.stats.committed)
    report["busy_waits"] += saver.snapshotter.stats.busy_waits
    report["final_step"] = resumed.train_progress.num_steps_completed

    _seed(0)
    reference = DemoUnit(seed=0)
    train(reference, _loader(steps_per_epoch), max_epochs=epochs)
    report["bitwise_identical"] = all(
        torch.equal(a, b)
        for a, b in zip(
            reference.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
        )
    )
    return report
