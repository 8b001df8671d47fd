"""Retention catches up at train start: a run killed after a commit and before its retention
leaves one snapshot more than it keeps; the next run trims to what retention keeps before it
writes, so repeated kills never pile snapshots up."""

from __future__ import annotations

from dir_listing import snapshots_by_step
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, make_data


def test_the_next_run_trims_to_what_retention_keeps_before_it_writes(tmp_path):
    # As if each of these commits had been followed by a kill before its retention ran.
    train(ToyUnit(), StatefulLoader(make_data(20)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1, save_on_train_end=False)])
    assert len(snapshots_by_step(tmp_path)) == 5

    class StopAtStart(TorchSnapshotSaver):
        def on_train_start(self, state, unit):
            super().on_train_start(state, unit)
            seen.extend(snapshots_by_step(tmp_path))

    seen: list[str] = []
    unit = ToyUnit()
    saver = StopAtStart(str(tmp_path), save_every_n_train_steps=1, keep_last_n_snapshots=2, save_on_train_end=False)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])
    assert seen == ["epoch_0_step_4", "epoch_0_step_5"]  # trimmed before the first write of the run
    final = snapshots_by_step(tmp_path)
    assert len(final) == 2 and int(final[-1].rsplit("_", 1)[1]) > 5  # the run's own two newest
