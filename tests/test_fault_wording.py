"""What a failed save says: the failure that caused it, and what became of older snapshots.

* A write refused because an earlier write of the same snapshot failed is never the error
  reported: the earlier one is, however the writer's threads were scheduled (the race a loaded
  machine decides is forced here at the exact point).
* Out of space, the failure names the storage's own words (``No space left on device``) and the
  file whose write failed.
* Out of space with retention set, the save deletes early what retention would delete after its
  commit and writes again; when that write fails too, the failure says which snapshots are gone
  and that the newest committed one is intact.

The disk is a real small tmpfs mounted for the test (the tests run as root; test_disk_full.py),
filled by real torchtnt ``train()`` runs.
"""

from __future__ import annotations

import errno
import os
import re
import time
import warnings
from typing import Any

import pytest
import torch
from dir_listing import complete_by_step, staging_by_name
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotFailedWarning, SnapshotWriteError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.saving import payloads as writer_job
from toy import (
    Holder,
    StatefulLoader,
    ToyUnit,
    footprint,
    make_data,
    small_disk,
    snapshot_footprint,
    unit_with_payload,
)

#: a tensor written to a file of its own (the format packs tensors under 4 MiB together)
OWN_FILE = 1_200_000


def test_a_write_refused_after_a_failed_one_is_never_the_error_reported(tmp_path, faulty_local, monkeypatch):
    """The first file of step 1 fails on an I/O thread; the planning thread submits the next
    file only once that failure is recorded, so the next file is refused ("not written: an
    earlier write of this snapshot failed"). The error raised is the first file's."""
    faulty, dirpath = faulty_local(tmp_path / "run")
    failed: list[str] = []

    def no_space(staging: str, rel: str) -> None:
        if "epoch_0_step_1" in staging:
            path = os.path.join(faulty.child(staging), rel)
            failed.append(rel)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    faulty.hook("write_payload", before=no_space)
    submit = writer_job.PayloadWrites.submit
    submitted: list[str] = []

    def submit_after_the_failure(self: Any, payload: Any) -> None:
        if submitted:  # the race, forced: the first write's failure is recorded by now
            deadline = time.monotonic() + 60
            while self._broken is None and time.monotonic() < deadline:
                time.sleep(0.001)
        submitted.append(payload.rel)
        submit(self, payload)

    monkeypatch.setattr(writer_job.PayloadWrites, "submit", submit_after_the_failure)
    unit = ToyUnit()
    unit.payload = Holder({"big": torch.randn(OWN_FILE)})
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, async_snapshot=False, on_save_error="raise")
    with pytest.raises(SnapshotWriteError) as caught:
        train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])

    assert len(submitted) == 2 and len(failed) == 1  # the second file was refused, not written
    message = str(caught.value)
    assert "epoch_0_step_1 (epoch 0, step 1) failed and was not committed" in message
    assert f"writing {failed[0]} of " in message
    assert "[Errno 28] No space left on device" in message
    assert "an earlier write" not in message
    assert "Older snapshots are intact" in message


def test_a_save_out_of_space_names_no_space_left_and_the_file(tmp_path):
    """No retention, a disk with room for half a snapshot: the warning names the storage's error
    and the file, not a write refused after it."""
    one = snapshot_footprint(tmp_path)
    with small_disk(tmp_path / "disk", one // 2) as disk:
        saver = TorchSnapshotSaver(str(disk), save_every_n_train_steps=1, save_on_train_end=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit_with_payload(), StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        first = next(m for m in failed if "epoch_0_step_1 (epoch 0, step 1) failed" in m)
        assert "[Errno 28] No space left on device" in first, first
        # the file: its name in the snapshot, and the staging directory it was written in
        assert re.search(rf"writing \S+ of {re.escape(str(disk))}/\.tnt_staging\.epoch_0_step_1\.\S+ failed: OSError", first), first
        assert "an earlier write" not in first, first
        assert "Older snapshots are intact" in first
        assert complete_by_step(disk) == []


class Growing(ToyUnit):
    """A unit whose payload grows to ``factor`` times its size at step 3."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.payload = unit_with_payload().payload
        self.factor = factor

    def train_step(self, state: Any, data: Any) -> None:
        super().train_step(state, data)
        if self.train_progress.num_steps_completed == 2:  # this is step 3
            big = self.payload.state["big"]
            self.payload.state = {"big": big.repeat(self.factor)}


@pytest.mark.parametrize("async_snapshot", [True, False], ids=["async", "sync"])
def test_a_retry_that_fails_too_says_which_snapshots_were_deleted_early(tmp_path, async_snapshot):
    """keep_last_n_snapshots=2 with room for two snapshots and a half. Step 3's state is three
    times larger: its write fails, step 1 (which retention deletes once step 3 commits) is
    deleted to make room, and the write fails again. The warning says that step 1 is gone and
    that step 2, the newest committed snapshot, is intact; restore finds step 2."""
    one = snapshot_footprint(tmp_path)
    with small_disk(tmp_path / "disk", 2 * one + one // 2) as disk:
        unit = Growing(factor=3)
        saver = TorchSnapshotSaver(
            str(disk),
            save_every_n_train_steps=1,
            keep_last_n_snapshots=2,
            async_snapshot=async_snapshot,
            save_on_train_end=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, StatefulLoader(make_data(12)), max_epochs=1, callbacks=[saver])  # 3 steps

        messages = [str(w.message) for w in caught]
        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        message = failed[0]  # then repeated at later hooks until a snapshot succeeds
        assert all(m.startswith(message) for m in failed), failed
        assert "epoch_0_step_3 (epoch 0, step 3) failed and was not committed" in message
        assert "[Errno 28] No space left on device" in message
        assert (
            "The storage ran out of space, so epoch_0_step_1 was deleted before this snapshot's "
            "commit to make room for it" in message
        )
        assert "epoch_0_step_1 is gone" in message
        assert "The newest committed snapshot, epoch_0_step_2, and the other older snapshots are intact" in message
        assert "Older snapshots are intact" not in message
        assert "one snapshot more than it keeps" in message
        assert not [m for m in messages if "wrote it again" in m], messages  # it was not written
        assert [(r.epoch, r.step) for r in saver.snapshotter.stats.committed] == [(0, 1), (0, 2)]
        assert complete_by_step(disk) == ["epoch_0_step_2"]
        assert staging_by_name(disk) == []
        assert footprint(disk) < 2 * one  # step 3's attempts left nothing behind

        fresh = unit_with_payload(seed=99)
        assert TorchSnapshotSaver.restore_from_latest(str(disk), fresh)
        assert fresh.train_progress.num_steps_completed == 2
