"""The Lightning adapter's best-k: ``monitor`` / ``mode`` / ``save_top_k`` with ModelCheckpoint's
meaning, ``best_model_path`` / ``best_model_score`` read from the directory, and
``ckpt_path="best"`` for ``fit`` / ``validate`` / ``test``, with real ``Trainer.fit`` runs on CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from dir_listing import CommitRecorder, visible_by_name
from lightning_fabric.utilities.exceptions import MisconfigurationException
from lightning_toy import ResumableLoader, ToyModule, make_trainer, weights
from pytorch_lightning.callbacks import Callback

from tnt_snapshot_plugin import ConfigError, MonitorNotLoggedWarning
from tnt_snapshot_plugin.adapters.lightning import MonitorNotFoundError, TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data
from tnt_snapshot_plugin.hooks import get_plugin_manager

#: the val_loss each validation run logs, by the epoch it runs in
VAL_LOSS = [0.5, 0.3, 0.4, 0.6, 0.45]


def loader(n: int = 12) -> ResumableLoader:
    return ResumableLoader(make_data(n), seed=3)


class Scored(ToyModule):
    """Logs ``val_loss`` from VAL_LOSS (by epoch); records the weights it evaluates and tests."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", VAL_LOSS[self.trainer.current_epoch])
        self.validated = weights(self)

    def test_step(self, batch, batch_idx):
        self.tested = weights(self)


def restored_weights(path: str) -> dict[str, torch.Tensor]:
    module = ToyModule(seed=7)
    TorchSnapshotSaver.restore(path, module)
    return weights(module)


def test_save_top_k_with_keep_last_n_and_ckpt_path_best_for_fit_validate_test(tmp_path):
    d = tmp_path / "snaps"
    pm = get_plugin_manager()
    recorder = CommitRecorder(d)
    pm.register(recorder)
    try:
        saver = TorchSnapshotSaver(
            str(d), save_every_n_epochs=1, monitor="val_loss", mode="min", save_top_k=1,
            keep_last_n_snapshots=2, plugin_manager=pm,
        )
        trainer = make_trainer(tmp_path, [saver], max_epochs=4, limit_val_batches=1)
        trainer.fit(Scored(), loader(), loader(4))
    finally:
        pm.unregister(recorder)

    e = {i: f"epoch_{i}_step_{3 * i}_val_loss={VAL_LOSS[i - 1]}" for i in range(1, 5)}
    # After each commit: the best (0.3, epoch 2) and the newest two; epoch 1 went only once
    # better and newer ones were committed.
    assert recorder.seen == [
        (e[1], [e[1]]),
        (e[2], sorted([e[1], e[2]])),
        (e[3], sorted([e[2], e[3]])),
        (e[4], sorted([e[2], e[3], e[4]])),
    ]
    assert saver.best_model_path == str(d / e[2])
    assert float(saver.best_model_score) == pytest.approx(0.3)

    # A new process's saver finds the same best from the directory alone.
    fresh = TorchSnapshotSaver(str(d), monitor="val_loss", mode="min")
    assert fresh.best_model_path == str(d / e[2])
    best = restored_weights(fresh.best_model_path)

    module = Scored(seed=5)
    make_trainer(tmp_path, [fresh], limit_val_batches=1).validate(module, loader(4), ckpt_path="best")
    torch.testing.assert_close(module.validated, best, rtol=0, atol=0)

    module = Scored(seed=6)
    tester = TorchSnapshotSaver(str(d), monitor="val_loss", mode="min")
    make_trainer(tmp_path, [tester], limit_test_batches=1).test(module, loader(4), ckpt_path="best")
    torch.testing.assert_close(module.tested, best, rtol=0, atol=0)

    # fit(ckpt_path="best") resumes from the best snapshot (epoch 2, step 6), not the newest
    class StartsAt(Callback):
        def on_train_start(self, trainer, pl_module):
            self.step, self.epoch = trainer.global_step, trainer.current_epoch

    starts = StartsAt()
    resumer = TorchSnapshotSaver(str(d), save_every_n_epochs=1, monitor="val_loss", mode="max")
    # mode="max" ranks the other way: 0.6 (epoch 4) is the best then
    assert resumer.best_model_path == str(d / e[4])
    resumer = TorchSnapshotSaver(str(d), save_every_n_epochs=1, monitor="val_loss", mode="min")
    trainer = make_trainer(tmp_path, [resumer, starts], max_epochs=3, limit_val_batches=1)
    trainer.fit(Scored(seed=8), loader(), loader(4), ckpt_path="best")
    assert (starts.step, starts.epoch) == (6, 2)
    assert trainer.global_step == 9


class SlashScored(Scored):
    """Logs the same values as ``val/loss`` (a name TensorBoard groups, as users log it)."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", VAL_LOSS[self.trainer.current_epoch])
        self.validated = weights(self)


def test_a_monitor_with_a_slash_ranks_and_restores_the_best_like_any_other(tmp_path):
    d = tmp_path / "snaps"
    saver = TorchSnapshotSaver(str(d), save_every_n_epochs=1, monitor="val/loss", save_top_k=1)
    make_trainer(tmp_path, [saver], max_epochs=3, limit_val_batches=1).fit(SlashScored(), loader(), loader(4))
    best = "epoch_2_step_6_val%2Floss=0.3"  # one directory: the best (0.3) and the newest
    assert visible_by_name(d) == [best, "epoch_3_step_9_val%2Floss=0.4"]
    assert saver.best_model_path == str(d / best) and float(saver.best_model_score) == pytest.approx(0.3)
    fresh = TorchSnapshotSaver(str(d), monitor="val/loss")
    assert fresh.best_model_path == str(d / best)
    module = SlashScored(seed=5)
    make_trainer(tmp_path, [fresh], limit_val_batches=1).validate(module, loader(4), ckpt_path="best")
    torch.testing.assert_close(module.validated, restored_weights(str(d / best)), rtol=0, atol=0)


def test_save_top_k_minus_one_keeps_all_and_max_mode_ranks_the_highest(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1, monitor="val_loss", mode="max", save_top_k=-1)
    make_trainer(tmp_path, [saver], max_epochs=3, limit_val_batches=1).fit(Scored(), loader(), loader(4))
    assert visible_by_name(tmp_path) == sorted(
        f"epoch_{i}_step_{3 * i}_val_loss={VAL_LOSS[i - 1]}" for i in range(1, 4)
    )
    assert saver.best_model_path.endswith("epoch_1_step_3_val_loss=0.5")
    assert float(saver.best_model_score) == pytest.approx(0.5)


def test_a_monitored_metric_never_logged_is_modelcheckpoints_error_once_validation_ran(tmp_path):
    saver = TorchSnapshotSaver(
        str(tmp_path), save_every_n_train_steps=1, save_every_n_epochs=1, monitor="val_acc", save_top_k=2
    )
    trainer = make_trainer(tmp_path, [saver], max_epochs=2, limit_val_batches=1)
    # before the first validation: warned once, saved without the metric
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(MonitorNotFoundError, match=r"self.log\('val_acc', value\)") as caught:
            trainer.fit(Scored(), loader(), loader(4))
    ours = [str(w.message) for w in seen if issubclass(w.category, MonitorNotLoggedWarning)]
    assert len(ours) == 1 and "monitor='val_acc'" in ours[0] and "No validation has run yet" in ours[0]
    assert isinstance(caught.value, MisconfigurationException)
    assert isinstance(caught.value, ConfigError)
    assert "val_loss" in str(caught.value)  # the keys that were logged
    assert visible_by_name(tmp_path) == ["epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_3"]
    assert saver.best_model_path == ""


def test_monitor_arguments_are_validated(tmp_path):
    with pytest.raises(MisconfigurationException, match="save_top_k=2 with monitor=None") as caught:
        TorchSnapshotSaver(str(tmp_path), save_top_k=2)
    assert isinstance(caught.value, ConfigError)
    with pytest.raises(ConfigError, match=r"save_top_k=0 \(ModelCheckpoint: save nothing\) has no meaning"):
        TorchSnapshotSaver(str(tmp_path), monitor="val_loss", save_top_k=0)
    with pytest.raises(ConfigError, match="mode must be 'min' or 'max'"):
        TorchSnapshotSaver(str(tmp_path), monitor="val_loss", mode="lowest")
    with pytest.raises(ConfigError, match="monitor must be a metric name usable in a directory name"):
        TorchSnapshotSaver(str(tmp_path), monitor="val loss")
    # without monitor there is no best snapshot: Lightning's own error for ckpt_path="best"
    saver = TorchSnapshotSaver(str(tmp_path))
    assert saver.best_model_path == "" and saver.best_model_score is None
    with pytest.raises(ValueError, match="not configured to save the best model"):
        make_trainer(tmp_path, [saver]).validate(Scored(), loader(4), ckpt_path="best")
