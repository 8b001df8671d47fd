"""Resuming from the checkpoints users already have: torchtitan's ``step-N`` directories, stock
``dcp.save`` directories under other names, checkpoints that torchtnt's own savers wrote before a
switch to the plugin, and Lightning ``ModelCheckpoint`` files under ``ckpt_path="last"``.

Real parts throughout: stock ``torch.distributed.checkpoint.save`` writing torchtitan's layout
(its keys, its flattened optimizer state), torchtnt 0.2.4's own ``TorchSnapshotSaver`` and
``DistributedCheckpointSaver`` in real ``train`` runs, a real Lightning ``Trainer.fit`` with
``ModelCheckpoint``, real files on disk.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torchtnt.framework.callback import Callback
from torchtnt.framework.callbacks.checkpointer_types import RestoreOptions
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    NothingToRestoreWarning,
    PartialRestoreWarning,
    PassedOverWarning,
    SnapshotsAheadWarning,
    UnrestorableStateError,
    restore,
    restore_from_latest,
)
from tnt_snapshot_plugin.adapters.torchtnt import DistributedCheckpointSaver, TorchSnapshotSaver
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.restoring import latest_snapshot
from tnt_snapshot_plugin.stores import LocalStore
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights

INDEX = ".tnt_snapshot_index.json"


@pytest.fixture(autouse=True)
def quiet_stock_dcp():
    """Stock DCP warns that it runs without a process group (it then assumes one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()
    tensors = {f"{p}/{k}": v.clone() for p, per in state["state"].items() for k, v in per.items()}
    return {"tensors": tensors, "groups": state["param_groups"]}


def assert_same_optimizer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert_bitwise_equal(a["tensors"], b["tensors"])
    assert a["groups"] == b["groups"]


# ------------------------------------------------------------------------------------------------
# torchtitan's layout


class TitanRun:
    """A model trained step by step, saved at chosen steps as torchtitan's CheckpointManager lays
    a checkpoint out: the parameters at the top level by name, ``optimizer`` flattened by name,
    ``lr_scheduler`` ({"last_epoch"}), ``dataloader`` (per data-parallel rank) and
    ``train_state`` ({"step", "ntokens_seen"}), in ``dirpath/step-N``."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        seed_everything(0)
        self.unit = ToyUnit(seed=0)
        self.saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any], list[float]]] = {}
        self.train_state_extra: dict[str, Any] = {}  # what else train_state holds

    def train_to(self, steps: int, save_at: tuple[int, ...]) -> None:
        unit = self.unit
        for step in range(1, steps + 1):
            x = torch.randn(8, 4)
            unit.model(x).pow(2).mean().backward()
            unit.optimizer.step()
            unit.optimizer.zero_grad()
            unit.lr_scheduler.step()
            if step in save_at:
                self.save(step)

    def save(self, step: int) -> None:
        unit = self.unit
        state: dict[str, Any] = dict(unit.model.state_dict())
        state["optimizer"] = get_optimizer_state_dict(
            unit.model, unit.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        state["lr_scheduler"] = {"last_epoch": unit.lr_scheduler.last_epoch}
        state["dataloader"] = {"dp_rank_0": b"opaque loader state", "world_size": 1}
        state["train_state"] = {"step": step, "ntokens_seen": 32 * step, **self.train_state_extra}
        dcp.save(state, checkpoint_id=str(self.dirpath / f"step-{step}"))
        self.saved[step] = (weights(unit), optimizer_state(unit.optimizer), unit.lr_scheduler.get_last_lr())


def test_torchtitan_checkpoints_resume_in_step_order_and_the_next_snapshot_is_the_plugins(tmp_path):
    run = TitanRun(tmp_path)
    run.train_to(10, save_at=(5, 9, 10))  # "step-10" sorts before "step-5" and "step-9" as text
    seed_everything(1)
    unit = ToyUnit(seed=7)
    with pytest.warns(PartialRestoreWarning, match=r"step-10 restored what maps onto the unit .*dataloader state") as caught:
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)
    assert len(caught) == 1
    model, optim, lr = run.saved[10]
    assert_bitwise_equal(weights(unit), model)
    assert_same_optimizer(optimizer_state(unit.optimizer), optim)
    assert unit.lr_scheduler.last_epoch == 10 and unit.lr_scheduler.get_last_lr() == lr
    assert unit.train_progress.num_steps_completed == 10

    # the run goes on with the plugin's saver: its snapshots follow torchtitan's checkpoints
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1)
    train(unit, StatefulLoader(make_data(40)), max_steps=12, callbacks=[saver])
    ours = sorted(n for n in os.listdir(tmp_path) if (tmp_path / n / INDEX).is_file())
    assert ours[0] == "epoch_0_step_11" and ours[-1].endswith("_step_12")
    after = ToyUnit(seed=8)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), after)  # no warning: the plugin's own
    assert after.train_progress.num_steps_completed == 12
    assert_bitwise_equal(weights(after), weights(unit))


def test_a_torchtitan_checkpoint_restored_by_path_honours_restore_options(tmp_path):
    run = TitanRun(tmp_path)
    run.train_to(5, save_at=(5,))
    unit = ToyUnit(seed=7)
    before = optimizer_state(unit.optimizer)
    with pytest.warns(PartialRestoreWarning, match="step-5 restored what maps onto the unit"):
        DistributedCheckpointSaver.restore(
            str(tmp_path / "step-5"), unit,
            restore_options=RestoreOptions(restore_optimizers=False, restore_train_progress=False),
        )
    assert_bitwise_equal(weights(unit), run.saved[5][0])
    assert_same_optimizer(optimizer_state(unit.optimizer), before)
    assert unit.train_progress.num_steps_completed == 0


def test_an_older_torchtitan_train_state_the_allow_list_refuses_is_left_unread_when_progress_is_skipped(tmp_path):
    """Older torchtitan versions pickled ``BytesIO`` lists into ``train_state``: refused by the
    allow-list, naming it; with ``restore_train_progress=False`` it is not read, and the rest
    restores."""
    import io

    run = TitanRun(tmp_path)
    run.train_state_extra = {"log_steps": io.BytesIO(b"older torchtitan")}
    run.train_to(3, save_at=(3,))
    path = str(tmp_path / "step-3")
    with pytest.raises(UnrestorableStateError, match="train_state"):
        TorchSnapshotSaver.restore(path, ToyUnit(seed=7))
    unit = ToyUnit(seed=7)
    with pytest.warns(PartialRestoreWarning):
        TorchSnapshotSaver.restore(path, unit, restore_options=RestoreOptions(restore_train_progress=False))
    assert_bitwise_equal(weights(unit), run.saved[3][0])
    assert_same_optimizer(optimizer_state(unit.optimizer), run.saved[3][1])
    assert unit.train_progress.num_steps_completed == 0


def test_a_torchtitan_checkpoint_that_does_not_fit_the_unit_is_refused_by_name(tmp_path):
    run = TitanRun(tmp_path)
    run.train_to(1, save_at=(1,))
    unit = ToyUnit()
    unit.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    from tnt_snapshot_plugin import StateMismatchError

    with pytest.raises(StateMismatchError, match=r"cannot restore torchtitan checkpoint \S*step-1 into the unit's model"):
        TorchSnapshotSaver.restore(str(tmp_path / "step-1"), unit)


# ------------------------------------------------------------------------------------------------
# What restore_from_latest cannot consider is named


def plugin_snapshot(dirpath: Path, steps: int = 2) -> dict[str, torch.Tensor]:
    """A plugin snapshot ``epoch_0_step_{steps}`` of a short run; its weights."""
    seed_everything(3)
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(dirpath), save_on_train_end=False, save_every_n_train_steps=steps)
    train(unit, StatefulLoader(make_data(4 * steps)), max_epochs=1, callbacks=[saver])
    return weights(unit)


def test_a_dcp_checkpoint_whose_name_orders_nothing_is_named_and_restores_by_path(tmp_path):
    saved = plugin_snapshot(tmp_path)
    final = ToyUnit(seed=9)
    dcp.save({"app_state": {"model": final.model.state_dict()}}, checkpoint_id=str(tmp_path / "final"))
    unit = ToyUnit(seed=5)
    with pytest.warns(PassedOverWarning, match=r"restored \S*epoch_0_step_2 and passed over.*names order nothing \(final\): restore one by path") as caught:
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)
    assert len(caught) == 1
    assert_bitwise_equal(weights(unit), saved)
    restore(str(tmp_path / "final"), {"model": unit.model})
    assert_bitwise_equal(weights(unit), weights(final))


def test_another_tools_checkpoint_without_its_metadata_is_named_where_it_would_come_first(tmp_path):
    run = TitanRun(tmp_path)
    run.train_to(5, save_at=(5,))
    (tmp_path / "step-8").mkdir()
    (tmp_path / "step-8" / "__0_0.distcp").write_bytes(b"half a write")
    (tmp_path / "step-2").mkdir()  # older than the one restored: not passed over
    unit = ToyUnit(seed=5)
    with pytest.warns(PartialRestoreWarning), pytest.warns(
        PassedOverWarning, match=r"restored \S*step-5 .*hold no metadata file.*\(step-8\)"
    ) as caught:
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)
    passed = [w for w in caught if w.category is PassedOverWarning]
    assert len(passed) == 1 and "step-2" not in str(passed[0].message)
    assert unit.train_progress.num_steps_completed == 5

    only = tmp_path / "only"
    only.mkdir()
    (tmp_path / "step-8").rename(only / "step-8")
    with pytest.warns(NothingToRestoreWarning, match=r"other tools' checkpoints without their metadata file .*\(step-8\)"):
        assert not TorchSnapshotSaver.restore_from_latest(str(only), ToyUnit())


def test_other_tools_checkpoints_order_by_name_before_the_plugins_by_commit(tmp_path):
    """A dirpath holding torchtnt's DCP checkpoints, torchtitan's and the plugin's: the plugin's
    come last whatever their steps (each run that switched resumes from its own newest);
    the others order by (epoch, step), torchtitan's as epoch 0."""
    run = TitanRun(tmp_path)
    run.train_to(40, save_at=(40,))
    tnt = ToyUnit(seed=4)
    dcp.save({"app_state": {"model": tnt.model.state_dict()}}, checkpoint_id=str(tmp_path / "epoch_3_train_step_30"))
    dcp.save({"app_state": {"model": tnt.model.state_dict()}}, checkpoint_id=str(tmp_path / "epoch_0_train_step_30"))
    with pytest.warns(SnapshotsAheadWarning, match="epoch_0_train_step_30, epoch_3_train_step_30"):
        saved = plugin_snapshot(tmp_path)  # committed last, at step 2
    order = [r.text for r in listing.listed(LocalStore(str(tmp_path)), torchtitan=True)]
    assert order == ["epoch_0_train_step_30", "step-40", "epoch_3_train_step_30", "epoch_0_step_2"]
    unit = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), unit)
    assert_bitwise_equal(weights(unit), saved)

    shutil.rmtree(tmp_path / "epoch_0_step_2")  # without the plugin's: torchtnt's newest by name
    model = ToyUnit(seed=5).model
    restored = restore_from_latest(str(tmp_path), {"model": model})
    assert restored == str(tmp_path / "epoch_3_train_step_30")
    assert_bitwise_equal(dict(model.state_dict()), weights(tnt))


# ------------------------------------------------------------------------------------------------
# torchtnt's own savers, then the switch


class Capture(Callback):
    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_step_end(self, state: Any, unit: ToyUnit) -> None:
        self.at[unit.train_progress.num_steps_completed] = weights(unit)


@pytest.mark.parametrize("kind", ["TorchSnapshotSaver", "DistributedCheckpointSaver"])
def test_torchtnts_own_checkpoints_resume_and_the_next_snapshot_is_the_plugins(tmp_path, kind):
    if kind == "TorchSnapshotSaver":
        from torchtnt.framework.callbacks.torchsnapshot_saver import TorchSnapshotSaver as Theirs
    else:
        from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver as Theirs
    seed_everything(2)
    unit = ToyUnit()
    capture = Capture()
    loader = StatefulLoader(make_data(16))  # 4 steps an epoch
    theirs = Theirs(str(tmp_path), save_every_n_train_steps=2, async_checkpoint=False)
    train(unit, loader, max_epochs=1, callbacks=[capture, theirs])
    names = sorted(os.listdir(tmp_path))
    assert "epoch_0_train_step_4" in names and not any((tmp_path / n / INDEX).exists() for n in names)

    resumed = ToyUnit(seed=9)
    ours = DistributedCheckpointSaver if kind == "DistributedCheckpointSaver" else TorchSnapshotSaver
    # the newest, epoch_1_train_step_4, is torchtnt's final checkpoint: it holds no loader state
    with pytest.warns(PartialRestoreWarning, match=r"train_dataloader was passed to restore but snapshot \S*epoch_1_train_step_4"):
        assert ours.restore_from_latest(str(tmp_path), resumed, train_dataloader=loader)
    assert resumed.train_progress.num_steps_completed == 4
    assert_bitwise_equal(weights(resumed), capture.at[4])

    train(resumed, loader, max_epochs=2, callbacks=[ours(str(tmp_path), save_every_n_train_steps=2)])
    committed = sorted(n for n in os.listdir(tmp_path) if (tmp_path / n / INDEX).is_file())
    assert committed[0] == "epoch_1_step_6" and all(n.startswith("epoch_") and "_train_" not in n for n in committed)
    after = ToyUnit(seed=10)
    restored = restore_from_latest(str(tmp_path), {"model": after.model}, strict=False)
    assert restored is not None and os.path.basename(restored) in committed
    assert_bitwise_equal(weights(after), weights(resumed))


# ------------------------------------------------------------------------------------------------
# Lightning: from ModelCheckpoint to the plugin's saver


class AtTrainStart(__import__("pytorch_lightning").Callback):
    """The module's weights, the optimizer's tensors and the global step when training starts."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_toy import optimizer_tensors
        from lightning_toy import weights as module_weights

        self.seen = {"step": trainer.global_step, "weights": module_weights(pl_module), "optim": optimizer_tensors(trainer)}


def test_a_lightning_run_switched_from_model_checkpoint_resumes_from_its_ckpt_once(tmp_path, caplog):
    from lightning_toy import ResumableLoader, ToyModule, make_trainer
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    dirpath = tmp_path / "ckpts"
    seed_everything(7)
    first = make_trainer(tmp_path, [ModelCheckpoint(dirpath=str(dirpath), save_last=True, every_n_train_steps=3)], max_steps=6)
    first.fit(ToyModule(seed=0), ResumableLoader(make_data(40), seed=3))
    last = dirpath / "last.ckpt"
    assert last.is_file() and (dirpath / "epoch=0-step=6.ckpt").is_file()
    saved = torch.load(last, weights_only=False)  # the test's own file
    expected_optim = {f"{p}.{k}": v for p, per in saved["optimizer_states"][0]["state"].items() for k, v in per.items()}

    seen = AtTrainStart()
    second = make_trainer(tmp_path, [LightningSaver(str(dirpath), save_every_n_train_steps=2), seen], max_steps=10)
    with caplog.at_level(logging.INFO):
        second.fit(ToyModule(seed=1), ResumableLoader(make_data(40), seed=3), ckpt_path="last")
    assert second.ckpt_path == str(last)
    assert any("resuming from ModelCheckpoint's" in r.getMessage() and "last.ckpt" in r.getMessage() for r in caplog.records)
    assert seen.seen["step"] == 6
    assert_bitwise_equal(seen.seen["weights"], dict(saved["state_dict"]))
    assert_bitwise_equal(seen.seen["optim"], expected_optim)
    snapshots = sorted((p for p in dirpath.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    assert snapshots and snapshots[0].name == "epoch_0_step_8" and (snapshots[0] / INDEX).is_file()

    newest = latest_snapshot(str(dirpath))
    assert newest is not None and os.path.basename(newest).startswith("epoch_")
    seen = AtTrainStart()
    third = make_trainer(tmp_path, [LightningSaver(str(dirpath)), seen], max_steps=12)
    third.fit(ToyModule(seed=2), ResumableLoader(make_data(40), seed=3), ckpt_path="last")
    assert third.ckpt_path == newest  # the plugin's snapshot, not the .ckpt
    assert seen.seen["step"] == 10 and third.global_step == 12


def test_lightning_passes_over_a_torchtitan_checkpoint_it_cannot_take(tmp_path):
    """torchtitan's checkpoints map onto a torchtnt unit, not a LightningModule: on a dirpath
    holding only one, ckpt_path="last" starts from the beginning, with the warning that says
    nothing was found to resume from, and snapshots onward."""
    from lightning_toy import ResumableLoader, ToyModule, make_trainer

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    dirpath = tmp_path / "ckpts"
    TitanRun(dirpath).train_to(2, save_at=(2,))
    seen = AtTrainStart()
    trainer = make_trainer(tmp_path, [LightningSaver(str(dirpath), save_every_n_train_steps=2), seen], max_steps=4)
    with pytest.warns(NothingToRestoreWarning):
        trainer.fit(ToyModule(seed=1), ResumableLoader(make_data(40), seed=3), ckpt_path="last")
    assert seen.seen["step"] == 0 and trainer.global_step == 4
    assert (dirpath / "epoch_0_step_4").is_dir()


class Opaque:
    """A class no allow-list admits."""


def test_a_ckpt_that_needs_more_than_the_allow_list_is_refused_naming_the_class(tmp_path):
    from lightning_toy import ResumableLoader, ToyModule, make_trainer
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    dirpath = tmp_path / "ckpts"
    make_trainer(tmp_path, [ModelCheckpoint(dirpath=str(dirpath), save_last=True)], max_steps=2).fit(
        ToyModule(), ResumableLoader(make_data(8), seed=3)
    )
    checkpoint = torch.load(dirpath / "last.ckpt", weights_only=False)
    checkpoint["extra"] = Opaque()
    torch.save(checkpoint, dirpath / "last.ckpt")
    trainer = make_trainer(tmp_path, [LightningSaver(str(dirpath))], max_steps=4)
    with pytest.raises(UnrestorableStateError, match=r"last\.ckpt holds an object .*Opaque.*add_safe_globals.*weights_only=False"):
        trainer.fit(ToyModule(), ResumableLoader(make_data(8), seed=3), ckpt_path="last")
