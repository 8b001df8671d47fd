"""Quiet by default: the README's quickstarts run without a word from the plugin, and each
warning fires when there is something to do about it, once per cause.

Real torchtnt ``train()`` and Lightning ``Trainer.fit`` runs, real directories on disk; a slow or
failing disk is the real one behind a FaultyStore hook (tests/conftest.py's ``faulty_local``).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.callback import Callback
from torchtnt.framework.train import train

import tnt_snapshot_plugin
from tnt_snapshot_plugin import SnapshotBusyWarning, SnapshotFailedWarning, errors
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.saving.jobs import BUSY_WARNING_S, BUSY_WARNING_SHARE
from toy import StatefulLoader, ToyUnit, make_data

pytestmark = pytest.mark.frameworks

#: Where the plugin's code lives: a warning attributed to a file under these is the plugin's.
_PLUGIN_DIRS = (
    str(Path(tnt_snapshot_plugin.__file__).parent),
    str(Path(__file__).resolve().parent.parent / "adapters"),
)
#: Every warning category the plugin defines.
CATEGORIES = tuple(
    obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, Warning)
)


def _from_plugin(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, CATEGORIES) or str(w.filename).startswith(_PLUGIN_DIRS)
    ]


def test_every_warning_category_is_exported_and_documented():
    documented = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
    assert len(CATEGORIES) >= 9
    for category in CATEGORIES:
        assert issubclass(category, UserWarning), category
        assert getattr(tnt_snapshot_plugin, category.__name__) is category
        assert category.__name__ in tnt_snapshot_plugin.__all__
        assert f"| `{category.__name__}`" in documented, category


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["resumable", "plain"])
def test_the_readme_torchtnt_quickstart_prints_no_warning_from_the_plugin(tmp_path, monkeypatch, loader):
    monkeypatch.chdir(tmp_path)

    def train_dataloader() -> Any:  # 10 steps an epoch, as the docs' runner gives the README
        if loader == "resumable":
            return StatefulLoader(make_data(40), batch_size=4)
        return DataLoader(TensorDataset(*make_data(40)), batch_size=4, shuffle=True)

    def new_saver() -> TorchSnapshotSaver:  # the README's cadences
        return TorchSnapshotSaver(
            "checkpoints/run1", save_every_n_train_steps=5, save_every_n_epochs=1, keep_last_n_snapshots=3
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for category in CATEGORIES:
            warnings.simplefilter("error", category)
        train(ToyUnit(), train_dataloader(), max_epochs=2, callbacks=[new_saver()])
        # "To resume in a new process, restore before calling train again"
        unit, resumed_loader = ToyUnit(seed=1), train_dataloader()
        saver = new_saver()
        restored = TorchSnapshotSaver.restore_from_latest("checkpoints/run1", unit, train_dataloader=resumed_loader)
        train(unit, resumed_loader, max_epochs=3, callbacks=[saver])
    assert restored is True
    assert unit.train_progress.num_steps_completed == 30
    assert _from_plugin(caught) == []
    assert saver.snapshotter.stats.committed  # it did snapshot


@pytest.mark.slow
def test_the_readme_lightning_quickstart_prints_no_warning_from_the_plugin(tmp_path, monkeypatch):
    import pytorch_lightning as pl
    from lightning_toy import ToyModule, make_trainer, plain_loader

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    monkeypatch.chdir(tmp_path)

    class DataModule(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            return plain_loader(40, batch_size=4)

    def fit(max_epochs: int) -> LightningSaver:
        saver = LightningSaver("checkpoints/lightning", every_n_train_steps=5, every_n_epochs=1, keep_last_n_snapshots=3)
        trainer = make_trainer(tmp_path, [saver], max_epochs=max_epochs)
        trainer.fit(ToyModule(), datamodule=DataModule(), ckpt_path="last")  # a first run starts fresh; a rerun resumes
        return saver

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for category in CATEGORIES:
            warnings.simplefilter("error", category)
        fit(2)
        rerun = fit(3)
    assert _from_plugin(caught) == []
    assert [r.step for r in rerun.snapshotter.stats.committed][-1] == 30  # resumed at step 20


# -- SnapshotBusyWarning: only for a wait a user notices -------------------------------------------


def _slow_disk(faulty_local, path: Path, seconds: float) -> str:
    """The real disk at ``path``, where each snapshot's packed file takes ``seconds`` longer to
    write: longer than a toy step, so every snapshot due at a step end finds the previous one
    still being written."""
    faulty, dirpath = faulty_local(path)
    faulty.hook("write_payload", before=lambda name, rel: time.sleep(seconds), match=lambda name, rel: rel.startswith("batched/"))
    return dirpath


def test_short_busy_waits_are_counted_and_never_warned(tmp_path, faulty_local):
    # Every step snapshots, and each write takes 20 ms longer than a toy step: training waits at
    # almost every snapshot, far less than a second in all.
    saver = TorchSnapshotSaver(_slow_disk(faulty_local, tmp_path, 0.02), save_every_n_train_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotBusyWarning)
        train(ToyUnit(), StatefulLoader(make_data(24)), max_epochs=1, callbacks=[saver])
    stats = saver.snapshotter.stats
    assert stats.busy_waits >= 1  # counted (snapshot/busy_waits), logged at DEBUG
    assert stats.busy_wait_s > 0


def test_long_busy_waits_warn_once_per_run(tmp_path, faulty_local, caplog):
    caplog.set_level(logging.DEBUG, logger="tnt_snapshot_plugin")
    saver = TorchSnapshotSaver(_slow_disk(faulty_local, tmp_path, 0.6), save_every_n_train_steps=1, save_on_train_end=False)
    unit = ToyUnit()
    with pytest.warns(SnapshotBusyWarning) as seen:
        train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])  # 3 waits of >= 0.6 s
        first = len([w for w in seen if issubclass(w.category, SnapshotBusyWarning)])
        train(unit, StatefulLoader(make_data(16)), max_epochs=2, callbacks=[saver])  # a second run
    warned = [str(w.message) for w in seen if issubclass(w.category, SnapshotBusyWarning)]
    assert first == 1 and len(warned) == 2, warned
    assert warned[0].startswith("training has waited ") and "snapshot less often" in warned[0]
    assert "\n" not in warned[0]
    waited = float(warned[0].split("training has waited ", 1)[1].split("s", 1)[0])
    assert waited > BUSY_WARNING_S
    assert saver.snapshotter.stats.busy_waits >= 6
    debug = [r for r in caplog.records if "was still being written; training waited" in r.getMessage()]
    assert len(debug) == saver.snapshotter.stats.busy_waits and all(r.levelno == logging.DEBUG for r in debug)
    assert 0 < BUSY_WARNING_SHARE < 1


# -- SnapshotFailedWarning: once per cause until a snapshot commits -----------------------------------


class _Faults(Callback):
    """Before the saver's step-end hook: what the disk does from each step on."""

    def __init__(self, faulty: Any, plan: dict[int, Any]) -> None:
        self.faulty, self.plan = faulty, plan

    def on_train_step_end(self, state: Any, unit: Any) -> None:
        step = unit.train_progress.num_steps_completed
        if step in self.plan:
            self.faulty.clear()
            if self.plan[step] is not None:
                self.faulty.inject("write_payload", self.plan[step], times=None)


def test_failures_warn_once_per_cause_until_a_snapshot_commits(tmp_path, faulty_local, caplog):
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    faulty, dirpath = faulty_local(tmp_path)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, async_snapshot=False, save_on_train_end=False)
    plan = {
        2: OSError(28, "No space left on device"),  # steps 2-3: the storage
        4: ValueError("a state the writer cannot encode"),  # steps 4-5: another cause
        6: None,  # step 6 commits
        7: OSError(28, "No space left on device"),  # step 7: the storage again, after a commit
        8: None,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ToyUnit(), StatefulLoader(make_data(32)), max_epochs=1, callbacks=[_Faults(faulty, plan), saver])
    failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    assert len(failed) == 3, failed
    assert "epoch_0_step_2 (epoch 0, step 2) failed" in failed[0] and "No space left on device" in failed[0]
    assert "epoch_0_step_4 (epoch 0, step 4) failed" in failed[1] and "cannot encode" in failed[1]
    assert "epoch_0_step_7 (epoch 0, step 7) failed" in failed[2]
    assert all("further failures of this cause are counted and logged at INFO" in m for m in failed)
    assert all("\n" not in m for m in failed)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "failed and was not committed" in r.getMessage()]
    assert len(info) == 2, info
    assert "epoch_0_step_3" in info[0] and "(2 failed and 0 skipped since the last commit)" in info[0]
    assert "epoch_0_step_5" in info[1] and "(4 failed and 0 skipped since the last commit)" in info[1]
    assert [r.step for r in saver.snapshotter.stats.committed] == [1, 6, 8]
    assert saver.snapshotter.stats.failures == 5
