"""The snapshot a Lightning run resumed from is kept on a full disk too.

When a snapshot fails for lack of space, the saver deletes what retention would delete once it
commits and writes it again (tests/test_disk_full.py). The snapshot the run resumed from is not
among those, as retention never deletes it. The disk is a real small tmpfs mounted for the test
(the tests run as root); real ``Trainer.fit`` runs fill it.
"""

from __future__ import annotations

import warnings

import torch
from dir_listing import visible_by_name
from lightning_toy import ResumableLoader, ToyModule, make_trainer

from tnt_snapshot_plugin import SnapshotFailedWarning
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data
from toy import footprint, small_disk


class Heavy(ToyModule):
    """A module whose 1 MiB buffer dominates the size of its snapshots."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.register_buffer("big", torch.randn(256 * 1024, generator=torch.Generator().manual_seed(seed)))


def loader() -> ResumableLoader:
    return ResumableLoader(make_data(16), seed=3)  # 4 batches an epoch


def test_a_full_disk_does_not_free_the_snapshot_the_run_resumed_from(tmp_path):
    probe = tmp_path / "probe"
    saver = TorchSnapshotSaver(str(probe), every_n_train_steps=2, async_snapshot=False, save_on_train_end=False)
    make_trainer(tmp_path, [saver], max_epochs=1).fit(Heavy(), loader())
    one = max(footprint(probe / name) for name in visible_by_name(probe))

    # room for two snapshots and a half
    with small_disk(tmp_path / "disk", 2 * one + one // 2) as disk:
        first = TorchSnapshotSaver(
            str(disk), every_n_train_steps=2, keep_last_n_snapshots=2, async_snapshot=False,
            save_on_train_end=False,
        )
        make_trainer(tmp_path, [first], max_epochs=1).fit(Heavy(), loader())
        assert visible_by_name(disk) == ["epoch_0_step_2", "epoch_0_step_4"]

        # resumed from the older one: the next snapshot (step 3) finds no room, and the only
        # snapshot retention could free for it is the one this run resumed from
        resumed_from = str(disk / "epoch_0_step_2")
        again = TorchSnapshotSaver(
            str(disk), every_n_train_steps=3, keep_last_n_snapshots=2, async_snapshot=False,
            save_on_train_end=False,
        )
        trainer = make_trainer(tmp_path, [again], max_epochs=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Heavy(seed=1), loader(), ckpt_path=resumed_from)
        assert trainer.ckpt_path == resumed_from and trainer.global_step == 4
        failed = [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)]
        assert failed and "epoch_0_step_3" in failed[0] and "No space left" in failed[0], failed
        assert "epoch_0_step_2" in visible_by_name(disk)  # kept
        assert not [str(w.message) for w in caught if "deleted epoch_0_step_2" in str(w.message)]
        # it is still whole: a new run resumes from it
        module = Heavy(seed=2)
        TorchSnapshotSaver.restore(resumed_from, module)
        torch.testing.assert_close(module.big, Heavy(seed=0).big, rtol=0, atol=0)
