"""Room for exactly N snapshots with keep_last_n_snapshots=N: every due snapshot still commits.

Retention deletes old snapshots only after a commit, and the commit needs room for one snapshot
more than retention keeps. A write that fails for lack of space (ENOSPC) deletes the snapshots
retention would delete once it commits, never the newest committed one, and is written once more.
The disk is a real small tmpfs mounted for the test (the tests run as root); real torchtnt
``train()`` runs fill it.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dir_listing import complete_by_step, everything_by_name, staging_by_name
from torchtnt.framework.train import train

from tnt_snapshot_plugin import OutOfSpaceWarning, SnapshotFailedWarning
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.stores import open_store
from toy import (
    PAGE,
    StatefulLoader,
    assert_bitwise_equal,
    make_data,
    seed_everything,
    small_disk,
    snapshot_footprint,
    unit_with_payload,
    weights,
)


@pytest.mark.parametrize("async_snapshot", [True, False], ids=["async", "sync"])
def test_room_for_exactly_n_snapshots_keeps_committing(tmp_path, async_snapshot):
    keep = 2
    one = snapshot_footprint(tmp_path)
    # room for the lock file and exactly `keep` snapshots, not one more
    with small_disk(tmp_path / "disk", keep * one + one // 2) as disk:
        seed_everything(5)
        unit = unit_with_payload()
        saver = TorchSnapshotSaver(
            str(disk),
            save_every_n_train_steps=1,
            keep_last_n_snapshots=keep,
            async_snapshot=async_snapshot,
            save_on_train_end=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, StatefulLoader(make_data(24)), max_epochs=1, callbacks=[saver])  # 6 steps

        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        assert not failed, failed
        stats = saver.snapshotter.stats
        assert stats.failures == 0
        # every due snapshot committed, the ones after the keep-th too
        assert [(r.epoch, r.step) for r in stats.committed] == [(0, s) for s in range(1, 7)]
        # ... and they had to make room: the disk holds no more than `keep`
        early = [str(w.message) for w in caught if issubclass(w.category, OutOfSpaceWarning)]
        assert len(early) == 1, [str(w.message) for w in caught]
        assert complete_by_step(disk) == ["epoch_0_step_5", "epoch_0_step_6"]
        assert staging_by_name(disk) == []

        fresh = unit_with_payload(seed=99)
        assert TorchSnapshotSaver.restore_from_latest(str(disk), fresh)
        assert fresh.train_progress.num_steps_completed == 6
        assert_bitwise_equal(weights(fresh), weights(unit))
        assert torch.equal(fresh.payload.state["big"], unit.payload.state["big"])


def test_the_newest_committed_snapshot_is_never_freed(tmp_path):
    """keep_last_n_snapshots=1 with room for one snapshot and a half: the second snapshot cannot
    be written without deleting the only committed one, so it fails, and the first stays whole."""
    one = snapshot_footprint(tmp_path)
    with small_disk(tmp_path / "disk", one + one // 2) as disk:
        unit = unit_with_payload()
        saver = TorchSnapshotSaver(
            str(disk),
            save_every_n_train_steps=2,
            keep_last_n_snapshots=1,
            async_snapshot=False,
            save_on_train_end=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])  # 4 steps
        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        assert failed and "epoch_0_step_4" in failed[0], failed
        assert "No space left" in failed[0], failed[0]
        stats = saver.snapshotter.stats
        assert [(r.epoch, r.step) for r in stats.committed] == [(0, 2)]
        assert stats.failures == 1
        assert complete_by_step(disk) == ["epoch_0_step_2"]
        assert staging_by_name(disk) == []
        fresh = unit_with_payload(seed=99)
        assert TorchSnapshotSaver.restore_from_latest(str(disk), fresh)
        assert fresh.train_progress.num_steps_completed == 2


def test_a_snapshot_is_deleted_on_a_disk_with_no_room_left(tmp_path):
    """Deleting unpublishes the snapshot first; on a disk with not a byte left (no room for the
    deletion's marker file) it still goes, and nothing of it stays listed."""
    one = snapshot_footprint(tmp_path)
    with small_disk(tmp_path / "disk", 2 * one + one // 2) as disk:
        unit = unit_with_payload()
        saver = TorchSnapshotSaver(str(disk), save_every_n_train_steps=1, async_snapshot=False)
        train(unit, StatefulLoader(make_data(4)), max_epochs=1, callbacks=[saver])
        assert complete_by_step(disk) == ["epoch_0_step_1", "epoch_1_step_1"]
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill every byte left
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * PAGE)
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="No space left"):
            (disk / "probe").write_bytes(b"x")
        (disk / "probe").unlink()  # empty: it held no page
        store = open_store(str(disk))
        listing.remove(store, "epoch_0_step_1")
        assert complete_by_step(disk) == ["epoch_1_step_1"]
        assert everything_by_name(disk) == ["epoch_1_step_1", "filler"]
