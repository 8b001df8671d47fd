"""The adapters beside the savers users switch from, in the same test: Lightning's
``ModelCheckpoint`` (``best_model_path`` without ``monitor``, ``kth_best_model_path`` among equal
values) and torchtnt 0.2.4's own ``TorchSnapshotSaver`` (no final snapshot under ``fit()`` when
the eval snapshot has saved the last optimizer step already).

Each test trains real runs (a CPU ``Trainer.fit``; torchtnt's ``fit``) once with the original
and once with the plugin's saver, and compares what each reports or writes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from dir_listing import complete_by_step
from lightning_toy import ResumableLoader, ToyModule, make_trainer, seed_everything
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torchtnt.framework.callbacks import TorchSnapshotSaver as TorchtntSaver
from torchtnt.framework.fit import fit

from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data
from tnt_snapshot_plugin.naming import SnapshotName
from toy import StatefulLoader, ToyUnit
from toy import make_data as toy_data

# -- Lightning: ModelCheckpoint ------------------------------------------------------------------


class Logs(ToyModule):
    """Logs ``values[current_epoch]`` as ``val_loss`` at each validation."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(seed=0)
        self.values = values

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.values[min(self.trainer.current_epoch, len(self.values) - 1)])


def side_by_side(tmp_path: Path, values: list[float], max_epochs: int, **arguments: Any) -> tuple[Any, Any, Any]:
    """(ModelCheckpoint, saver, the saver's trainer), each given ``arguments`` and trained on the
    same run (3 steps an epoch, one validation batch after each epoch)."""
    callbacks: list[Any] = [
        ModelCheckpoint(dirpath=str(tmp_path / "mc"), **arguments),
        LightningSaver(str(tmp_path / "snaps"), **arguments),
    ]
    trainer = None
    for callback in callbacks:
        seed_everything(0)
        trainer = make_trainer(tmp_path, [callback], max_epochs=max_epochs, limit_val_batches=1)
        trainer.fit(
            Logs(values), ResumableLoader(make_data(12), seed=3), ResumableLoader(make_data(4), seed=3)
        )
    return callbacks[0], callbacks[1], trainer


def step_of(path: str) -> Optional[int]:
    """The global step of a ModelCheckpoint file (``...step=6.ckpt``) or a snapshot directory."""
    name = os.path.basename(path)
    parsed = SnapshotName.parse(name)
    if parsed is not None:
        return parsed.step
    if "step=" in name:
        return int(name.split("step=")[1].split(".")[0].split("-")[0])
    return None


@pytest.mark.parametrize("save_top_k", [1, -1])
def test_best_model_path_without_monitor_is_the_newest_as_model_checkpoints(tmp_path, save_top_k):
    mc, saver, trainer = side_by_side(tmp_path, [0.5], max_epochs=2, every_n_train_steps=2, save_top_k=save_top_k)
    assert mc.monitor is None and saver.monitor is None
    assert step_of(mc.best_model_path) == step_of(saver.best_model_path) == 6
    assert saver.best_model_path == str(tmp_path / "snaps" / "epoch_1_step_6")
    assert mc.best_model_score is None and saver.best_model_score is None
    assert mc.best_k_models == {} and saver.best_k_models == {}
    # ckpt_path="best" reads it: Lightning loads the newest snapshot
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.validate(Logs([0.5]), ResumableLoader(make_data(4), seed=3), ckpt_path="best")
    assert trainer.ckpt_path == saver.best_model_path


def test_best_model_path_without_monitor_is_empty_before_any_snapshot(tmp_path):
    saver = LightningSaver(str(tmp_path / "snaps"))
    seen: list[str] = []

    class Before(Callback):  # at train start: the saver is set up, nothing is saved yet
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.append(saver.best_model_path)

    seed_everything(0)
    trainer = make_trainer(tmp_path, [Before(), saver], max_epochs=1)
    trainer.fit(ToyModule(), ResumableLoader(make_data(12), seed=3))
    assert seen == [""]
    assert saver.best_model_path == str(tmp_path / "snaps" / "epoch_1_step_3")


def test_kth_best_model_path_among_equal_values_is_the_oldest_as_model_checkpoints(tmp_path):
    # three equal values, k=2: ModelCheckpoint keeps the first two (the third does not beat the
    # k-th) and names the older of them k-th
    mc, saver, _ = side_by_side(
        tmp_path, [0.5, 0.5, 0.5], max_epochs=3, monitor="val_loss", save_top_k=2, every_n_epochs=1
    )

    def by_step(models: dict[str, torch.Tensor]) -> dict[Optional[int], float]:
        return {step_of(path): float(value) for path, value in models.items()}

    assert by_step(saver.best_k_models) == by_step(mc.best_k_models) == {3: 0.5, 6: 0.5}
    assert step_of(mc.kth_best_model_path) == step_of(saver.kth_best_model_path) == 3
    assert step_of(mc.best_model_path) == step_of(saver.best_model_path) == 3


def test_kth_best_model_path_is_the_worst_when_values_differ(tmp_path):
    mc, saver, _ = side_by_side(
        tmp_path, [0.2, 0.5, 0.3], max_epochs=3, monitor="val_loss", save_top_k=2, every_n_epochs=1
    )
    assert step_of(mc.kth_best_model_path) == step_of(saver.kth_best_model_path) == 9
    assert step_of(mc.best_model_path) == step_of(saver.best_model_path) == 3


# -- torchtnt: its own TorchSnapshotSaver --------------------------------------------------------


def run_fit(saver: Any, **schedule: Any) -> ToyUnit:
    """torchtnt's fit() of a ToyUnit: 3 train steps an epoch, 2 eval steps an evaluation."""
    unit = ToyUnit()
    fit(
        unit,
        StatefulLoader(toy_data(12)),
        StatefulLoader(toy_data(8, seed=1)),
        callbacks=[saver],
        **schedule,
    )
    return unit


def progress_of(dirpath: Path) -> list[tuple[int, int, Optional[int]]]:
    """(epoch, train step, eval step) of each complete snapshot in ``dirpath``, oldest first."""
    names = [SnapshotName.parse(n) for n in complete_by_step(dirpath)]
    return [(n.epoch, n.step, n.eval_step) for n in names if n is not None]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # the last eval runs after the last train step: its snapshot saved that step
        (dict(max_epochs=2, evaluate_every_n_epochs=1), [(1, 3, 2), (2, 6, 4)]),
        # the last eval runs before the last train step: the final snapshot is new state
        (
            dict(max_epochs=1, evaluate_every_n_steps=2, evaluate_every_n_epochs=None),
            [(0, 2, 2), (1, 3, None)],
        ),
    ],
    ids=["eval-after-the-last-step", "eval-before-the-last-step"],
)
def test_train_end_under_fit_writes_what_torchtnts_saver_writes(tmp_path, schedule, expected):
    torchtnt_dir, plugin_dir = tmp_path / "torchtnt", tmp_path / "plugin"
    theirs = TorchtntSaver(str(torchtnt_dir), save_every_n_eval_epochs=1, async_checkpoint=False)
    run_fit(theirs, **schedule)
    ours = TorchSnapshotSaver(str(plugin_dir), save_every_n_eval_epochs=1)
    run_fit(ours, **schedule)

    # torchtnt names its final snapshot under fit() with the eval steps too; by (epoch, step)
    # both wrote the same snapshots
    def by_step(progress: list[tuple[int, int, Optional[int]]]) -> list[tuple[int, int]]:
        return [(epoch, step) for epoch, step, _eval in progress]

    assert progress_of(plugin_dir) == expected
    assert by_step(progress_of(torchtnt_dir)) == by_step(expected)
    assert [r.step for r in ours.snapshotter.stats.committed] == [step for _epoch, step, _eval in expected]


def test_equal_values_at_the_kth_place_keep_the_older_a_deliberate_difference(tmp_path):
    # ModelCheckpoint's top k depends on the order values came in: of two equal values at the
    # k-th place, a better value later evicts the older. The saver ranks what dirpath holds
    # (every run's, in a new process too) by value, then commit order: the older stays.
    mc, saver, _ = side_by_side(
        tmp_path, [0.4, 0.4, 0.2], max_epochs=3, monitor="val_loss", save_top_k=2, every_n_epochs=1
    )
    assert sorted(step_of(path) for path in mc.best_k_models) == [6, 9]
    assert sorted(step_of(path) for path in saver.best_k_models) == [3, 9]
    assert step_of(mc.kth_best_model_path) == 6 and step_of(saver.kth_best_model_path) == 3
