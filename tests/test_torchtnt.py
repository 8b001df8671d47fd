"""The torchtnt adapter with real torchtnt train()/fit() runs and real torchsnapshot writes."""

from __future__ import annotations

import pytest
import torch
from dir_listing import staging_by_name, visible_by_name
from torchtnt.framework.fit import fit
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    KeyCollisionError,
    NothingToRestoreWarning,
    SnapshotNotFoundError,
    StateMismatchError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import Knobs
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights


def test_names_written_by_two_epochs_of_five_steps(tmp_path):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])

    assert visible_by_name(tmp_path) == sorted(
        [
            "epoch_0_step_2",
            "epoch_0_step_4",
            "epoch_1_step_5",  # end of epoch 1
            "epoch_1_step_6",
            "epoch_1_step_8",
            "epoch_1_step_10",
            "epoch_2_step_10",  # end of epoch 2; on_train_end finds it saved already
        ]
    )
    for name in visible_by_name(tmp_path):
        assert (tmp_path / name / ".snapshot_metadata").is_file()
    assert staging_by_name(tmp_path) == []


def test_restore_chosen_snapshot_gives_that_moments_state(tmp_path):
    unit = ToyUnit()
    captured = {}

    class Capture(TorchSnapshotSaver):
        def on_train_step_end(self, state, unit):
            super().on_train_step_end(state, unit)
            if unit.train_progress.num_steps_completed == 4:
                captured["model"] = weights(unit)
                captured["optim"] = {
                    k: v.clone() for k, v in unit.optimizer.state_dict()["state"][0].items()
                }
                captured["lr"] = unit.lr_scheduler.get_last_lr()

    saver = Capture(str(tmp_path), save_every_n_train_steps=4)
    train(unit, StatefulLoader(make_data(40)), max_epochs=2, callbacks=[saver])

    fresh = ToyUnit(seed=123)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_0_step_4"), fresh)
    assert_bitwise_equal(weights(fresh), captured["model"])
    restored_optim = fresh.optimizer.state_dict()["state"][0]
    assert_bitwise_equal(restored_optim, captured["optim"])
    assert fresh.lr_scheduler.get_last_lr() == captured["lr"]
    assert fresh.train_progress.num_steps_completed == 4
    assert fresh.train_progress.num_epochs_completed == 0


def run_uninterrupted(epochs: int) -> dict[str, torch.Tensor]:
    seed_everything(7)
    unit = ToyUnit(seed=0)
    train(unit, StatefulLoader(make_data(40), seed=3), max_epochs=epochs)
    return weights(unit)


@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize("fail_at_step", [7, 10, 13])  # mid-epoch, epoch boundary, mid-epoch 2
def test_resume_after_exception_is_bitwise_identical(tmp_path, fail_at_step, writer):
    expected = run_uninterrupted(epochs=2)

    seed_everything(7)
    unit = ToyUnit(seed=0, fail_at_step=fail_at_step)
    saver = TorchSnapshotSaver(
        str(tmp_path), save_every_n_train_steps=3, save_every_n_epochs=1, knob_options=Knobs(writer=writer)
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        train(unit, StatefulLoader(make_data(40), seed=3), max_epochs=2, callbacks=[saver])

    # A new process would start from other seeds and a fresh loader.
    seed_everything(999)
    resumed = ToyUnit(seed=42)
    loader = StatefulLoader(make_data(40), seed=3)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), resumed, train_dataloader=loader)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=3, save_every_n_epochs=1)
    train(resumed, loader, max_epochs=2, callbacks=[saver])

    assert_bitwise_equal(weights(resumed), expected)
    assert resumed.train_progress.num_steps_completed == 20


def test_fit_saves_and_restores_eval_progress(tmp_path):
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)
    fit(
        unit,
        train_dataloader=StatefulLoader(make_data(20)),
        eval_dataloader=StatefulLoader(make_data(8)),
        max_epochs=2,
        callbacks=[saver],
    )
    assert unit.eval_progress.num_steps_completed == 4
    # fit() evaluates after on_train_epoch_end, so the snapshot of epoch 2's end holds the
    # eval progress of epoch 1's evaluation (2 steps).
    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert fresh.eval_progress.num_steps_completed == 2
    assert fresh.train_progress.num_steps_completed == 10
    untouched = ToyUnit(seed=5)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_2_step_10"), untouched, restore_eval_progress=False)
    assert untouched.eval_progress.num_steps_completed == 0
    assert untouched.train_progress.num_steps_completed == 10


def test_restore_progress_flags(tmp_path):
    unit = ToyUnit()
    train(
        unit,
        StatefulLoader(make_data(20)),
        max_epochs=1,
        callbacks=[TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)],
    )
    fresh = ToyUnit(seed=1)
    TorchSnapshotSaver.restore(
        str(tmp_path / "epoch_1_step_5"),
        fresh,
        restore_train_progress=False,
        restore_eval_progress=False,
    )
    assert fresh.train_progress.num_steps_completed == 0
    assert_bitwise_equal(weights(fresh), weights(unit))
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_1_step_5"), fresh)
    assert fresh.train_progress.num_steps_completed == 5


def test_restore_from_latest_false_for_missing_or_empty_dirpath(tmp_path):
    unit = ToyUnit()
    with pytest.warns(NothingToRestoreWarning, match="missing does not exist"):  # a misspelt path is not quiet
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "missing"), unit) is False
    with pytest.warns(NothingToRestoreWarning, match="is empty"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit) is False
    # a directory that looks like a snapshot but was never committed is not picked
    (tmp_path / "epoch_3_step_30").mkdir()
    with pytest.warns(NothingToRestoreWarning, match=r"snapshots never committed, without \.snapshot_metadata or \.metadata \(epoch_3_step_30\)"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit) is False


@pytest.mark.parametrize("reserved", ["rng_state", "train_dataloader"])
def test_key_collision_raises_at_train_start_and_restore(tmp_path, reserved):
    unit = ToyUnit()
    setattr(unit, reserved, torch.nn.Linear(1, 1))  # tracked under the reserved key
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1)
    with pytest.raises(KeyCollisionError, match=reserved):
        train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
    assert visible_by_name(tmp_path) == []  # nothing was written
    with pytest.raises(RuntimeError, match="Detected collision for key in app state"):
        TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)


def test_restore_errors_name_the_problem(tmp_path):
    unit = ToyUnit()
    train(
        unit,
        StatefulLoader(make_data(8)),
        max_epochs=1,
        callbacks=[TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)],
    )
    with pytest.raises(SnapshotNotFoundError, match="does not exist"):
        TorchSnapshotSaver.restore(str(tmp_path / "epoch_9_step_99"), unit)

    other = ToyUnit()
    other.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    with pytest.raises(StateMismatchError, match=r"model\.0\.weight: shape \[32, 4\] in the module, \[16, 4\]"):
        TorchSnapshotSaver.restore(str(tmp_path / "epoch_1_step_2"), other)


def test_dirpath_property_and_sync_mode(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1, async_snapshot=False)
    assert saver.dirpath == str(tmp_path)
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
    assert visible_by_name(tmp_path) == ["epoch_0_step_1", "epoch_0_step_2", "epoch_1_step_2"]


def test_optimizer_state_is_created_only_to_be_loaded_and_leaves_the_weights(tmp_path):
    """Restore creates a fresh optimizer's lazy state (as torchtnt's init_optim_state does) only
    when a snapshot is loaded into it: with nothing to resume from, the optimizer and weights stay
    untouched (a zero-gradient step with weight decay would move the weights)."""
    def adamw_unit(seed: int) -> ToyUnit:
        unit = ToyUnit(seed=seed)
        unit.optimizer = torch.optim.AdamW(unit.model.parameters(), lr=0.1, weight_decay=0.5)
        unit.lr_scheduler = torch.optim.lr_scheduler.StepLR(unit.optimizer, step_size=1)
        return unit

    unit = adamw_unit(0)
    before = weights(unit)
    (tmp_path / "empty").mkdir()
    with pytest.warns(NothingToRestoreWarning, match="is empty"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "empty"), unit) is False
    assert unit.optimizer.state_dict()["state"] == {}
    assert_bitwise_equal(weights(unit), before)

    train(unit, StatefulLoader(make_data(8), seed=1), max_epochs=1,
          callbacks=[TorchSnapshotSaver(str(tmp_path / "run"), async_snapshot=False)])
    fresh = adamw_unit(5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "run"), fresh) is True
    assert_bitwise_equal(weights(fresh), weights(unit))
    saved, restored = unit.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys() and saved
    for index in saved:
        assert_bitwise_equal(restored[index], saved[index])
