"""No silent start: every path that trains from scratch, or restores less than it was asked to,
says so once, naming the dirpath and what was found there.

Real torchtnt ``train()`` runs and real directories on disk; a real Lightning ``Trainer.fit``;
object stores are moto's S3 server on 127.0.0.1 (tests/test_s3.py's fixtures) and fsspec's
``memory://`` filesystem.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import pytest
import torch
from moto_s3 import BUCKET, s3_client
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

from tnt_snapshot_plugin import (
    ConfigError,
    DataLoaderReplayWarning,
    InterruptedCommitWarning,
    NothingToRestoreWarning,
    ProgressOnlyWarning,
    SnapshotCorruptError,
    SnapshotFallbackWarning,
    StateMismatchError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, train_toy, weights

pytestmark = [pytest.mark.frameworks, pytest.mark.usefixtures("no_aws_environment")]


def _only(seen: Any, category: type[Warning]) -> str:
    """The one warning of ``category`` among ``seen``: its message, checked to be one line."""
    found = [str(w.message) for w in seen if issubclass(w.category, category)]
    assert len(found) == 1, found
    assert "\n" not in found[0]
    return found[0]


def _truncate_largest(snapshot: Any) -> None:
    """Damage a snapshot as a torn write would: its largest payload file cut to 10 bytes."""
    victim = max((p for p in snapshot.rglob("*") if p.is_file() and not p.name.startswith(".")), key=os.path.getsize)
    victim.write_bytes(victim.read_bytes()[:10])


def _plain_loader(n: int = 24) -> DataLoader:
    return DataLoader(TensorDataset(*make_data(n)), batch_size=4, shuffle=True)  # 6 steps an epoch


# -- restore_from_latest finds nothing to restore ------------------------------------------------


def test_a_dirpath_that_does_not_exist_is_named_as_missing(tmp_path):
    misspelt = tmp_path / "ck" / "run_1"
    with pytest.warns(NothingToRestoreWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(misspelt), ToyUnit()) is False
    message = _only(seen, NothingToRestoreWarning)
    assert message.startswith(f"restore_from_latest: dirpath {misspelt} does not exist: nothing was restored")
    assert "training starts from the beginning" in message and "check the path" in message
    assert not misspelt.exists()  # restore creates nothing


def test_the_readme_order_construct_restore_train_says_the_dirpath_is_empty(tmp_path):
    # README: the saver is made, restore_from_latest runs, then train. The constructor creates the
    # dirpath, so a misspelt one exists by the time restore looks: it is named as empty.
    dirpath = tmp_path / "checkpoints" / "run1"
    saver = TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)
    unit = ToyUnit()
    with pytest.warns(NothingToRestoreWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), unit, train_dataloader=StatefulLoader(make_data(8))) is False
    message = _only(seen, NothingToRestoreWarning)
    assert f"dirpath {dirpath} is empty: nothing was restored" in message
    assert "constructor creates its dirpath" in message
    assert not [w for w in seen if issubclass(w.category, DataLoaderReplayWarning)]  # nothing restored
    train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
    assert sorted(os.listdir(dirpath)) == ["epoch_1_step_2"]


def test_a_dirpath_of_other_tools_checkpoints_names_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    torch.save({"state_dict": torch.nn.Linear(2, 2).state_dict()}, dirpath / "last.ckpt")  # Lightning's
    torch.save({"state_dict": torch.nn.Linear(2, 2).state_dict()}, dirpath / "epoch=0-step=4.ckpt")
    dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=str(dirpath / "dcp_step_4"))
    (dirpath / "epoch_0_train_step_4").mkdir()  # torchtnt's name, never completed
    (dirpath / "epoch_0_train_step_4" / "0").mkdir()
    (dirpath / "notes.txt").write_text("run 1")
    with pytest.warns(NothingToRestoreWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), ToyUnit()) is False
    message = _only(seen, NothingToRestoreWarning)
    assert f"dirpath {dirpath} holds no snapshot to restore, only " in message
    assert "other tools' checkpoint files (epoch=0-step=4.ckpt, last.ckpt)" in message
    assert "torch.distributed.checkpoint checkpoints under names that order nothing, restored by path only (dcp_step_4)" in message
    assert (
        "other tools' checkpoints without their metadata file (.snapshot_metadata or .metadata), which nothing "
        "says are complete (epoch_0_train_step_4)"
    ) in message
    assert "other files (notes.txt): nothing was restored" in message
    assert "pass the dirpath the saver wrote to, or restore a checkpoint by path" in message


def test_a_dirpath_whose_snapshots_are_all_damaged_raises_and_names_each(tmp_path):
    dirpath = tmp_path / "run"
    train(ToyUnit(), StatefulLoader(make_data(8)), max_epochs=2,
          callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)])
    for name in ("epoch_1_step_2", "epoch_2_step_4"):
        _truncate_largest(dirpath / name)
    with pytest.warns(SnapshotFallbackWarning) as seen, pytest.raises(SnapshotCorruptError, match="every snapshot in .* is damaged"):
        TorchSnapshotSaver.restore_from_latest(str(dirpath), ToyUnit())
    skipped = [str(w.message) for w in seen if issubclass(w.category, SnapshotFallbackWarning)]
    assert len(skipped) == 2
    for message in skipped:
        assert message.startswith(f"skipping damaged snapshot {dirpath}/epoch_")
        assert "\n" not in message
    assert not [w for w in seen if issubclass(w.category, NothingToRestoreWarning)]


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_newest_snapshot_is_one_line_naming_it_once(tmp_path, damage):
    dirpath = tmp_path / "run"
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(8)), max_epochs=2,
          callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)])
    newest = dirpath / "epoch_2_step_4"
    if damage == "truncated":  # found by the check before loading
        _truncate_largest(newest)
        said = "file batched/0-0 has 10 bytes"
    else:  # found by a checksum while loading, inside the restore's own error
        victim = newest / "batched" / "0-0"
        data = bytearray(victim.read_bytes())
        data[100] ^= 1
        victim.write_bytes(bytes(data))
        said = f"{newest}/batched/0-0 (entry model/0.weight): bytes 0-256 do not match the xxh3_64 checksum"
    fresh = ToyUnit(seed=3)
    with pytest.warns(SnapshotFallbackWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), fresh)
    message = _only(seen, SnapshotFallbackWarning)
    assert message.startswith(f"skipping damaged snapshot {newest}: ")
    assert said in message
    assert message.count(f"snapshot {newest}") == 1  # not repeated inside the problem
    for nested in ("could not load", "SnapshotCorruptError", "Restore an older snapshot"):
        assert nested not in message
    assert message.endswith("; falling back to the previous snapshot")
    assert fresh.train_progress.num_steps_completed == 2


# -- interrupted commits -------------------------------------------------------------------------


def _train_into(url: str, storage_options: dict[str, Any]) -> ToyUnit:
    return train_toy(url, ToyUnit(), 2, epochs=2, save_every_n_epochs=1, storage_options=storage_options)


@pytest.mark.slow
def test_an_interrupted_commit_on_s3_is_named_so_and_the_previous_snapshot_restored(s3_options, tmp_path):
    url = f"s3://{BUCKET}/interrupted-{tmp_path.name}"
    _train_into(url, s3_options)
    # A writer that died between the index PUT and the metadata PUT leaves exactly this.
    prefix = url[len(f"s3://{BUCKET}/"):]
    s3_client(s3_options).delete_object(Bucket=BUCKET, Key=f"{prefix}/epoch_2_step_4/.snapshot_metadata")
    fresh = ToyUnit(seed=5)
    with pytest.warns(InterruptedCommitWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(url, fresh, storage_options=s3_options)
    message = _only(seen, SnapshotFallbackWarning)  # the interrupted commit's, and no other
    assert message.startswith(f"snapshot {url}/epoch_2_step_4 is an interrupted commit (the writer is gone: ")
    assert "nothing committed is lost" in message and "damaged" not in message
    assert f"the newest complete snapshot before it, {url}/epoch_1_step_2, is restored" in message
    assert fresh.train_progress.num_steps_completed == 2


def test_an_interrupted_commit_on_fsspec_is_named_so(tmp_path):
    pytest.importorskip("fsspec")
    url = f"memory://interrupted-{tmp_path.name}"
    _train_into(url, {})
    import fsspec

    fsspec.filesystem("memory").rm(f"/interrupted-{tmp_path.name}/epoch_2_step_4/.snapshot_metadata")
    fresh = ToyUnit(seed=5)
    with pytest.warns(InterruptedCommitWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(url, fresh)
    message = _only(seen, SnapshotFallbackWarning)
    assert "is an interrupted commit" in message and "damaged" not in message
    assert fresh.train_progress.num_steps_completed == 2


def test_on_local_disk_a_removed_metadata_is_damage_and_an_interrupted_write_says_nothing(tmp_path):
    dirpath = tmp_path / "run"
    unit = _train_into(str(dirpath), {})
    # An interrupted write on local disk: a staging directory, which restore never picks, quietly.
    shutil.copytree(dirpath / "epoch_2_step_4", dirpath / ".tnt_staging.epoch_3_step_6.0123456789ab")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = ToyUnit(seed=5)
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), fresh)
    assert_bitwise_equal(weights(fresh), weights(unit))
    # A final name appears only by renaming a complete snapshot: a missing metadata is damage.
    (dirpath / "epoch_2_step_4" / ".snapshot_metadata").unlink()
    with pytest.warns(SnapshotFallbackWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), ToyUnit(seed=5))
    message = _only(seen, SnapshotFallbackWarning)
    assert message.startswith(f"skipping damaged snapshot {dirpath}/epoch_2_step_4: ")
    assert not [w for w in seen if issubclass(w.category, InterruptedCommitWarning)]


# -- the train dataloader's position ---------------------------------------------------------------


class _StopAt(Exception):
    pass


class _StoppingUnit(ToyUnit):
    def __init__(self, stop_after: int) -> None:
        super().__init__()
        self.stop_after = stop_after

    def train_step(self, state: State, data: Any) -> None:
        if self.train_progress.num_steps_completed == self.stop_after:
            raise _StopAt()
        super().train_step(state, data)


def test_a_mid_epoch_resume_with_a_plain_loader_says_how_many_batches_it_replays(tmp_path):
    dirpath = tmp_path / "run"
    crashed = _StoppingUnit(stop_after=9)  # epoch 2 of 6 steps, 3 steps in
    with pytest.raises(_StopAt):
        train(crashed, _plain_loader(), max_epochs=2,
              callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_train_steps=3, save_on_train_end=False)])
    assert "epoch_1_step_9" in os.listdir(dirpath)

    unit = ToyUnit()
    with pytest.warns(DataLoaderReplayWarning) as seen:
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), unit, train_dataloader=_plain_loader())
    message = _only(seen, DataLoaderReplayWarning)
    assert message.startswith(f"snapshot {dirpath}/epoch_1_step_9 was taken 3 batches into an epoch")
    assert "train_dataloader has no state_dict/load_state_dict, so its position is not restored" in message
    assert "runs 3 batches more than an uninterrupted run" in message and "StatefulDataLoader" in message
    # What it says happens: the resumed epoch runs all 6 batches after the 3 already done.
    train(unit, _plain_loader(), max_epochs=2, callbacks=[])
    assert unit.train_progress.num_steps_completed == 9 + 6

    # Progress not restored (fine-tuning from the weights): nothing replays, nothing is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TorchSnapshotSaver.restore(str(dirpath / "epoch_1_step_9"), ToyUnit(), train_dataloader=_plain_loader(),
                                   restore_train_progress=False)


def test_a_mid_epoch_resume_with_a_resumable_loader_is_quiet(tmp_path):
    dirpath = tmp_path / "run"
    with pytest.raises(_StopAt):
        train(_StoppingUnit(stop_after=9), StatefulLoader(make_data(24)), max_epochs=2,
              callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_train_steps=3, save_on_train_end=False)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unit, loader = ToyUnit(), StatefulLoader(make_data(24))
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), unit, train_dataloader=loader)
    train(unit, loader, max_epochs=2, callbacks=[])
    assert unit.train_progress.num_steps_completed == 12  # as an uninterrupted run


def test_an_epoch_end_resume_with_a_plain_loader_is_quiet(tmp_path):
    dirpath = tmp_path / "run"
    train(ToyUnit(), _plain_loader(), max_epochs=1, callbacks=[TorchSnapshotSaver(str(dirpath), save_every_n_epochs=1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TorchSnapshotSaver.restore_from_latest(str(dirpath), ToyUnit(), train_dataloader=_plain_loader())


# -- what a unit is --------------------------------------------------------------------------------


class _ProgressOnly(TrainUnit[Any]):
    """A unit that keeps its model in a local variable: torchtnt tracks nothing but its progress."""

    def train_step(self, state: State, data: Any) -> None:
        pass


def test_a_unit_with_nothing_but_progress_warns_once_at_train_start(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path / "run"), save_every_n_epochs=1)
    unit = _ProgressOnly()
    with pytest.warns(ProgressOnlyWarning) as seen:
        train(unit, StatefulLoader(make_data(8)), max_epochs=1, callbacks=[saver])
        train(unit, StatefulLoader(make_data(8)), max_epochs=2, callbacks=[saver])  # the same saver again
    message = _only(seen, ProgressOnlyWarning)
    assert message.startswith("the unit _ProgressOnly tracks no modules, optimizers")
    assert "self.model = ..." in message
    # A unit that tracks a module: quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProgressOnlyWarning)
        train(ToyUnit(), StatefulLoader(make_data(8)), max_epochs=1,
              callbacks=[TorchSnapshotSaver(str(tmp_path / "other"), save_every_n_epochs=1)])


@pytest.mark.parametrize("method", ["restore", "restore_from_latest", "restore_from_best"])
def test_a_restore_target_that_is_not_a_unit_fails_at_once_saying_what_to_pass(tmp_path, method):
    args: list[Any] = [str(tmp_path / "nowhere"), torch.nn.Linear(2, 2)]
    if method == "restore_from_best":
        args += ["loss", "min"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError) as info:
            getattr(TorchSnapshotSaver, method)(*args)
    message = str(info.value)
    assert message.startswith("unit must be a torchtnt unit (a TrainUnit, EvalUnit or other AppStateMixin), "
                              "got a torch.nn.modules.linear.Linear")
    assert "tnt_snapshot_plugin.restore(path, {'model': module})" in message
    assert "\n" not in message


# -- Lightning's ckpt_path="last" --------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_last_on_a_last_ckpt_that_is_no_lightning_checkpoint_says_so_naming_it(tmp_path):
    """ckpt_path="last" resumes from the newest ModelCheckpoint file of the dirpath when no
    snapshot is newer; a file of that name that Lightning did not write is refused, named, before
    Lightning reads it, never a KeyError from inside Lightning, never a silent fresh start."""
    from lightning_toy import ToyModule, make_trainer, plain_loader

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    torch.save({"state_dict": {}}, dirpath / "last.ckpt")  # named as ModelCheckpoint's, not written by it
    saver = LightningSaver(str(dirpath), every_n_epochs=1)
    with pytest.raises(StateMismatchError) as refused:
        make_trainer(tmp_path, [saver], max_epochs=1).fit(ToyModule(), plain_loader(8), ckpt_path="last")
    message = str(refused.value)
    assert message.startswith(f"{dirpath / 'last.ckpt'} is not a Lightning checkpoint (no pytorch-lightning_version in it)")
    assert "pass another ckpt_path" in message
    assert not [p for p in dirpath.iterdir() if p.name.startswith("epoch_")]  # nothing was trained
