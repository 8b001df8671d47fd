"""The snapshot-reading CheckpointIO the Lightning saver installs for a stage is put back at the
stage's end: after fit, validate, an exception, with a real Trainer. A SnapshotCheckpointIO the
Trainer was given itself stays."""

from __future__ import annotations

import pytest
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_toy import ResumableLoader, ToyModule, make_trainer

from tnt_snapshot_plugin.adapters.lightning import SnapshotCheckpointIO, TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data


def loader(n: int = 12) -> ResumableLoader:
    return ResumableLoader(make_data(n), seed=3)


class SeesIO(TorchSnapshotSaver):
    """Records the Trainer's CheckpointIO while training."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.seen = trainer.strategy.checkpoint_io


class Validating(ToyModule):
    def validation_step(self, batch, batch_idx):
        self.seen = {k: v.detach().clone() for k, v in self.state_dict().items()}


def test_the_trainers_checkpoint_io_is_put_back_after_fit_and_validate(tmp_path):
    saver = SeesIO(str(tmp_path / "s"), save_every_n_epochs=1)
    trainer = make_trainer(tmp_path, [saver], max_epochs=1)
    own = trainer.strategy.checkpoint_io
    assert isinstance(own, TorchCheckpointIO)
    trainer.fit(ToyModule(), loader())
    assert isinstance(saver.seen, SnapshotCheckpointIO) and saver.seen.checkpoint_io is own
    assert trainer.strategy.checkpoint_io is own

    # the same Trainer again: installed for the stage (a snapshot loads), put back after it
    snapshot = str(tmp_path / "s" / "epoch_1_step_3")
    module = Validating(seed=1)
    trainer.validate(module, loader(4), ckpt_path=snapshot)
    expected = ToyModule(seed=3)
    TorchSnapshotSaver.restore(snapshot, expected)
    assert all(torch.equal(module.seen[k], v) for k, v in expected.state_dict().items())
    assert trainer.strategy.checkpoint_io is own

    # resuming a new Trainer from a snapshot
    saver = SeesIO(str(tmp_path / "s"), save_every_n_epochs=1)
    trainer = make_trainer(tmp_path, [saver], max_epochs=2)
    own = trainer.strategy.checkpoint_io
    trainer.fit(ToyModule(seed=2), loader(), ckpt_path=str(tmp_path / "s" / "epoch_1_step_3"))
    assert trainer.global_step == 6
    assert trainer.strategy.checkpoint_io is own


def test_put_back_after_an_exception(tmp_path):
    saver = SeesIO(str(tmp_path / "s"), save_every_n_train_steps=1)
    trainer = make_trainer(tmp_path, [saver], max_epochs=1)
    own = trainer.strategy.checkpoint_io
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(ToyModule(fail_at_step=2), loader())
    assert isinstance(saver.seen, SnapshotCheckpointIO)
    assert trainer.strategy.checkpoint_io is own


def test_a_snapshot_checkpoint_io_given_to_the_trainer_stays(tmp_path):
    given = SnapshotCheckpointIO()
    saver = SeesIO(str(tmp_path / "s"), save_every_n_epochs=1)
    trainer = make_trainer(tmp_path, [saver], max_epochs=1, plugins=[given])
    trainer.fit(ToyModule(), loader())
    assert saver.seen is given
    assert trainer.strategy.checkpoint_io is given
