"""Lightning: snapshots of real runs restore through ``ckpt_path``; weights_only, fallback."""

from __future__ import annotations

import argparse
import datetime
import enum
import os

import pytest
from dir_listing import visible_by_name
from lightning_toy import ResumableLoader, ToyModule, make_trainer
from pytorch_lightning.callbacks import Callback

from tnt_snapshot_plugin import UnrestorableStateError
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data


class Mode(enum.Enum):
    FAST = "fast"


class ArgsModule(ToyModule):
    """The common script shape: ``save_hyperparameters(args)`` with an argparse Namespace."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(seed=args.seed)
        self.save_hyperparameters(args)


class StartStep(Callback):
    """Records the global step a fit starts training from."""

    def __init__(self) -> None:
        self.step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def loader() -> ResumableLoader:
    return ResumableLoader(make_data(16), seed=3)  # 4 batches an epoch


def _args(**extra) -> argparse.Namespace:
    return argparse.Namespace(
        seed=0, lr=0.01, started=datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc), **extra
    )


def _fit(root, module, dirpath, max_epochs, ckpt_path=None, **fit_args) -> StartStep:
    start = StartStep()
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=2, **fit_args.pop("saver_args", {}))
    make_trainer(root, [saver, start], max_epochs=max_epochs).fit(
        module, loader(), ckpt_path=ckpt_path, **fit_args
    )
    return start


def test_save_hyperparameters_namespace_resumes_from_last(tmp_path):
    dirpath = str(tmp_path / "snaps")
    _fit(tmp_path, ArgsModule(_args()), dirpath, max_epochs=1)
    # the step snapshot at the epoch's last batch; train end does not save that step again
    assert visible_by_name(dirpath)[-1] == "epoch_0_step_4"

    resumed = ArgsModule(_args())
    start = _fit(tmp_path, resumed, dirpath, max_epochs=2, ckpt_path="last")
    assert start.step == 4  # resumed from the newest snapshot, not from scratch
    assert resumed.trainer.global_step == 8
    assert resumed.hparams.started == _args().started


def test_fit_weights_only_false_loads_trusted_snapshots_with_full_pickle(tmp_path):
    dirpath = str(tmp_path / "snaps")
    # An enum is not on the allow-list: the saver refuses it by default...
    with pytest.raises(UnrestorableStateError, match="Mode"):
        _fit(tmp_path / "refused", ArgsModule(_args(mode=Mode.FAST)), str(tmp_path / "refused"), max_epochs=1)
    # ...and writes it when told the snapshots will be loaded with full pickle.
    _fit(tmp_path, ArgsModule(_args(mode=Mode.FAST)), dirpath, max_epochs=1,
         saver_args={"weights_only": False})

    with pytest.raises(UnrestorableStateError, match="weights_only=False"):
        _fit(tmp_path, ArgsModule(_args(mode=Mode.FAST)), dirpath, max_epochs=2, ckpt_path="last",
             weights_only=True)
    resumed = ArgsModule(_args(mode=Mode.FAST))
    start = _fit(tmp_path, resumed, dirpath, max_epochs=2, ckpt_path="last", weights_only=False,
                 saver_args={"weights_only": False})
    assert start.step == 4
    assert resumed.trainer.global_step == 8


def test_last_skips_a_newest_snapshot_with_corrupt_metadata(tmp_path):
    dirpath = str(tmp_path / "snaps")
    _fit(tmp_path, ToyModule(), dirpath, max_epochs=1)
    # At steps 2 and 4 (train end does not save step 4 again): the newest gets torn metadata.
    assert visible_by_name(dirpath) == ["epoch_0_step_2", "epoch_0_step_4"]
    newest = os.path.join(dirpath, "epoch_0_step_4")

    def tear() -> None:
        with open(os.path.join(newest, ".snapshot_metadata"), "w") as f:
            f.write('{"version": "0.0.0", "world_size": 1, "manifest": {"0/x": {"type": ')

    tear()

    with pytest.warns(UserWarning) as caught:
        start = _fit(tmp_path, ToyModule(), dirpath, max_epochs=2, ckpt_path="last")
    skipped = [str(w.message) for w in caught if "skipping damaged snapshot" in str(w.message)]
    assert len(skipped) == 1 and "epoch_0_step_4" in skipped[0]
    assert start.step == 2  # the newest snapshot that loads

    # An explicit ckpt_path is not second-guessed: the damaged snapshot is reported.
    from tnt_snapshot_plugin import SnapshotCorruptError

    tear()  # (the resumed run wrote step 4 again)
    with pytest.raises(SnapshotCorruptError, match="epoch_0_step_4"):
        _fit(tmp_path, ToyModule(), str(tmp_path / "other"), max_epochs=2, ckpt_path=newest)
