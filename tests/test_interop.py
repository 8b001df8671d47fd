"""Snapshots move both ways between this plugin and torchtnt's own TorchSnapshotSaver."""

from __future__ import annotations

import os

from torchtnt.framework.callbacks import TorchSnapshotSaver as TorchtntSaver
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights


def test_torchtnt_restores_a_snapshot_this_plugin_wrote(tmp_path):
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)])
    fresh = ToyUnit(seed=3)
    TorchtntSaver.restore(str(tmp_path / "epoch_1_step_2"), fresh)
    assert_bitwise_equal(weights(fresh), weights(unit))
    assert fresh.train_progress.num_steps_completed == 2


def test_this_plugin_resumes_from_snapshots_torchtnt_wrote(tmp_path):
    unit = ToyUnit(seed=1)
    saver = TorchtntSaver(str(tmp_path), save_every_n_epochs=1, async_checkpoint=False)
    train(unit, StatefulLoader(make_data(8)), max_epochs=2, callbacks=[saver])
    assert sorted(os.listdir(tmp_path)) == ["epoch_1_train_step_2", "epoch_2_train_step_4"]

    fresh = ToyUnit(seed=4)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert_bitwise_equal(weights(fresh), weights(unit))
    assert fresh.train_progress.num_steps_completed == 4
