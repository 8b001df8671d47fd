"""The torchtnt adapter's three static restores run one RestoreRequest each: the collective
timeout is checked alike in all three (ConfigError before anything is loaded), and a valid one
restores, in a real train() and a new unit."""

from __future__ import annotations

import math

import pytest
from torchtnt.framework.train import train

from tnt_snapshot_plugin import ConfigError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights


class Scored(ToyUnit):
    """A unit with a metric for best_checkpoint_config (higher at each epoch)."""

    def on_train_epoch_end(self, state):
        super().on_train_epoch_end(state)
        self.score = float(self.train_progress.num_epochs_completed)


def test_every_restore_checks_the_collective_timeout_and_restores_with_a_valid_one(tmp_path):
    from torchtnt.utils.checkpoint import BestCheckpointConfig

    dirpath = str(tmp_path / "s")
    saved = Scored()
    saver = TorchSnapshotSaver(
        dirpath, save_every_n_epochs=1, best_checkpoint_config=BestCheckpointConfig("score", "max")
    )
    train(saved, StatefulLoader(make_data(12)), max_epochs=2, callbacks=[saver])
    path = saver.snapshotter.stats.committed[-1].path

    unit = ToyUnit(seed=9)
    before = weights(unit)
    for bad in (0, -1.0, math.inf, "10"):
        with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
            TorchSnapshotSaver.restore(path, unit, collective_timeout_s=bad)
        with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
            TorchSnapshotSaver.restore_from_latest(dirpath, unit, collective_timeout_s=bad)
        with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
            TorchSnapshotSaver.restore_from_best(dirpath, unit, "score", "max", collective_timeout_s=bad)
    assert_bitwise_equal(weights(unit), before)  # nothing was loaded

    TorchSnapshotSaver.restore(path, unit, collective_timeout_s=5)
    assert_bitwise_equal(weights(unit), weights(saved))
    unit = ToyUnit(seed=9)
    assert TorchSnapshotSaver.restore_from_latest(dirpath, unit, collective_timeout_s=5)
    assert unit.train_progress.num_steps_completed == 6
    unit = ToyUnit(seed=9)
    assert TorchSnapshotSaver.restore_from_best(dirpath, unit, "score", "max", collective_timeout_s=5)
    assert unit.train_progress.num_steps_completed == 6  # the best: epoch 2's score
    assert_bitwise_equal(weights(unit), weights(saved))
