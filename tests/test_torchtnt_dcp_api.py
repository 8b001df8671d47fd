"""The behaviours torchtnt 0.2.4's own tests check of its ``DistributedCheckpointSaver``
(``tests/framework/callbacks/test_dcp_saver.py`` in pytorch/tnt), checked against the drop-in
``tnt_snapshot_plugin.adapters.torchtnt.DistributedCheckpointSaver`` with real ``train`` runs,
real files and, for DDP, two real gloo processes (this file run as a worker).

Where the drop-in differs on purpose (names, the dataloader saved at every snapshot, the save
planner and storage writer, storage readers), docs/torchtnt.md lists it; the tests here check
the drop-in's side of each.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torchtnt.framework.callbacks.checkpointer_types import KnobOptions, RestoreOptions
from torchtnt.framework.train import train

from tnt_snapshot_plugin import ConfigError, PartialRestoreWarning
from tnt_snapshot_plugin.adapters.torchtnt import DistributedCheckpointSaver
from toy import ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights


def plain_loader(n: int = 20) -> Any:
    """5 batches of 4, no state_dict: a plain DataLoader."""
    x, y = make_data(n)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return {f"{p}/{k}": v.clone() for p, per in state.items() for k, v in per.items()}


@pytest.fixture
def quiet_stock_dcp() -> Iterator[None]:
    """Stock DCP warns that it runs without a process group (it then assumes one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class Trained:
    """What a unit held at the end of its run (copies: the tests restore into units of their own)."""

    def __init__(self, unit: ToyUnit) -> None:
        self.weights = weights(unit)
        self.optimizer = optimizer_state(unit.optimizer)
        self.lr_scheduler = unit.lr_scheduler.state_dict()
        self.steps = unit.train_progress.num_steps_completed


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory) -> tuple[Path, Trained]:
    """A unit trained 2 epochs of 5 steps, a snapshot every 2 steps, with the drop-in."""
    dirpath = tmp_path_factory.mktemp("dcp_api")
    seed_everything(0)
    unit = ToyUnit()
    saver = DistributedCheckpointSaver(str(dirpath), save_every_n_train_steps=2, knob_options=KnobOptions(1))
    train(unit, plain_loader(), max_epochs=2, callbacks=[saver])
    return dirpath, Trained(unit)


def test_one_import_line_switches_and_the_constructor_keeps_torchtnts_meanings(tmp_path):
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver as Theirs
    from torchtnt.utils.checkpoint import BestCheckpointConfig

    assert DistributedCheckpointSaver.metadata_fname == Theirs.metadata_fname == ".metadata"
    saver = DistributedCheckpointSaver(
        str(tmp_path), save_every_n_train_steps=2, save_every_n_epochs=1, save_every_n_eval_epochs=1,
        keep_last_n_checkpoints=2, best_checkpoint_config=BestCheckpointConfig("loss", "min"),
        process_group=None, async_checkpoint=True, knob_options=KnobOptions(max_per_rank_io_concurrency=2),
    )
    config = saver.snapshotter.config
    assert saver.dirpath == str(tmp_path)
    assert config.format == "dcp" and config.async_snapshot is True and config.knobs.max_per_rank_io_concurrency == 2
    # torchtnt's DCP saver writes synchronously unless asked (its TorchSnapshotSaver does not)
    assert DistributedCheckpointSaver(str(tmp_path / "b")).snapshotter.config.async_snapshot is False
    with pytest.raises(TypeError, match="format"):
        DistributedCheckpointSaver(str(tmp_path / "c"), format="torchsnapshot")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="save_every_n_train_steps"):
        DistributedCheckpointSaver(str(tmp_path / "d"), save_every_n_train_steps=0)


def test_save_restore(two_epochs):
    """torchtnt's test_save_restore: a snapshot every N steps; restoring the first brings the
    progress back to N. The drop-in names them epoch_E_step_S (torchtnt: epoch_E_train_step_S)."""
    dirpath, unit = two_epochs
    names = sorted(os.listdir(dirpath), key=lambda n: (int(n.split("_")[1]), int(n.split("_")[3])))
    assert names == ["epoch_0_step_2", "epoch_0_step_4", "epoch_1_step_6", "epoch_1_step_8", "epoch_1_step_10", "epoch_2_step_10"]
    assert all((dirpath / n / ".metadata").is_file() for n in names)
    assert unit.steps == 10
    fresh = ToyUnit(seed=4)
    DistributedCheckpointSaver.restore(str(dirpath / "epoch_0_step_2"), fresh)
    assert fresh.train_progress.num_steps_completed == 2


class CountingLoader:
    """torchtnt's DummyStatefulDataLoader's behaviour: counts its state_dict/load_state_dict calls."""

    def __init__(self) -> None:
        self.loader = plain_loader()
        self.saves = self.loads = 0

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        return {"some_data": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads += 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def test_save_restore_dataloader_state(tmp_path):
    """torchtnt's test_save_restore_dataloader_state: the loader's state is saved and restored
    from a snapshot that holds it; restoring one that does not holds warns. The drop-in saves it
    at every snapshot (torchtnt: mid-epoch only), so the snapshot without it here is one of a run
    whose loader had none."""
    loader = CountingLoader()
    train(ToyUnit(), loader, max_steps=3, callbacks=[DistributedCheckpointSaver(str(tmp_path), save_every_n_train_steps=2)])
    assert loader.saves == 2 and loader.loads == 0  # step 2, and the final snapshot (step 3)
    DistributedCheckpointSaver.restore(str(tmp_path / "epoch_0_step_2"), ToyUnit(), train_dataloader=loader)
    assert loader.loads == 1

    other = tmp_path / "plain"
    train(ToyUnit(), plain_loader(), max_steps=3, callbacks=[DistributedCheckpointSaver(str(other), save_every_n_train_steps=2)])
    with pytest.warns(PartialRestoreWarning, match=r"train_dataloader was passed to restore but snapshot \S*epoch_0_step_2 holds no"):
        DistributedCheckpointSaver.restore(str(other / "epoch_0_step_2"), ToyUnit(), train_dataloader=loader)
    assert loader.loads == 1


def test_restore_from_latest(two_epochs):
    """torchtnt's test_restore_from_latest: the newest checkpoint is restored, True returned."""
    dirpath, unit = two_epochs
    fresh = ToyUnit(seed=4)
    assert DistributedCheckpointSaver.restore_from_latest(str(dirpath), fresh) is True
    assert fresh.train_progress.num_steps_completed == 10 and fresh.train_progress.num_epochs_completed == 2
    assert_bitwise_equal(weights(fresh), unit.weights)


def test_save_restore_no_train_progress(two_epochs):
    dirpath, _ = two_epochs
    unit = ToyUnit(seed=4)
    unit.train_progress.increment_step()
    DistributedCheckpointSaver.restore(
        str(dirpath / "epoch_0_step_2"), unit, restore_options=RestoreOptions(restore_train_progress=False)
    )
    assert unit.train_progress.num_steps_completed == 1


def test_save_restore_no_optimizer_restore(two_epochs):
    dirpath, unit = two_epochs
    fresh = ToyUnit(seed=4)
    before = optimizer_state(fresh.optimizer)
    DistributedCheckpointSaver.restore(
        str(dirpath / "epoch_2_step_10"), fresh, restore_options=RestoreOptions(restore_optimizers=False)
    )
    assert optimizer_state(fresh.optimizer) == before == {}  # Adam's state is never made
    assert_bitwise_equal(weights(fresh), unit.weights)
    DistributedCheckpointSaver.restore(str(dirpath / "epoch_2_step_10"), fresh)
    assert_bitwise_equal(optimizer_state(fresh.optimizer), unit.optimizer)


def test_save_restore_no_lr_scheduler_restore(two_epochs):
    dirpath, unit = two_epochs
    fresh = ToyUnit(seed=4)
    DistributedCheckpointSaver.restore(
        str(dirpath / "epoch_2_step_10"), fresh, restore_options=RestoreOptions(restore_lr_schedulers=False)
    )
    assert fresh.lr_scheduler.last_epoch == 0 and unit.lr_scheduler["last_epoch"] == 2
    DistributedCheckpointSaver.restore(str(dirpath / "epoch_2_step_10"), fresh)
    assert fresh.lr_scheduler.state_dict() == unit.lr_scheduler


class RecordingPlanner(DefaultLoadPlanner):
    """torchtnt's DummyLoadPlanner, recording what the restore asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.set_up = 0
        self.committed: list[str] = []

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.set_up += 1
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.fqn)


def test_restore_planner_and_storage_components(two_epochs):
    """torchtnt's test_restore_(default_)planner_storage_components: the default planner and
    reader, or the given ones, are used; the drop-in reads through its own stores, so a reader
    is accepted only where it reads the same files, and refused by name otherwise."""
    dirpath, unit = two_epochs
    path = str(dirpath / "epoch_2_step_10")
    planner = RecordingPlanner()
    fresh = ToyUnit(seed=4)
    DistributedCheckpointSaver.restore(path, fresh, planner=planner, storage_reader=FileSystemReader(path))
    assert planner.set_up >= 1 and "app_state.model.0.weight" in planner.committed
    assert "app_state.optimizer.state.0.exp_avg" in planner.committed
    assert_bitwise_equal(weights(fresh), unit.weights)
    DistributedCheckpointSaver.restore(path, ToyUnit(), storage_reader=FsspecReader(path))

    class OwnReader(FileSystemReader):
        pass

    with pytest.raises(ConfigError, match=r"storage_reader must be None, or torch.s FileSystemReader .*\(got a OwnReader\)"):
        DistributedCheckpointSaver.restore(path, ToyUnit(), storage_reader=OwnReader(path))
    with pytest.raises(ConfigError, match="storage_reader must be None"):
        DistributedCheckpointSaver.restore(path, ToyUnit(), storage_reader=FileSystemReader(str(dirpath / "epoch_0_step_2")))
    with pytest.raises(ConfigError, match="storage_reader is not accepted by restore_from_latest"):
        DistributedCheckpointSaver.restore_from_latest(str(dirpath), ToyUnit(), storage_reader=FileSystemReader(path))

    class Bytes(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match="planner Bytes overrides load_bytes, which restore never calls"):
        DistributedCheckpointSaver.restore(path, ToyUnit(), planner=Bytes())
    with pytest.raises(ConfigError, match="planner must be a torch.distributed.checkpoint LoadPlanner"):
        DistributedCheckpointSaver.restore(path, ToyUnit(), planner=object())


def test_a_planner_for_a_snapshot_in_torchsnapshots_format_is_refused(tmp_path):
    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    train(ToyUnit(), plain_loader(8), max_epochs=1, callbacks=[TorchSnapshotSaver(str(tmp_path))])
    with pytest.raises(ConfigError, match="planner plans reads of checkpoints in DCP's format; .* torchsnapshot format"):
        DistributedCheckpointSaver.restore(str(tmp_path / "epoch_1_step_2"), ToyUnit(), planner=RecordingPlanner())


def test_torchtnts_own_restore_reads_the_drop_ins_snapshots(two_epochs, quiet_stock_dcp):
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver as Theirs

    dirpath, unit = two_epochs
    fresh = ToyUnit(seed=4)
    Theirs.restore(str(dirpath / "epoch_2_step_10"), fresh)
    assert_bitwise_equal(weights(fresh), unit.weights)
    assert_bitwise_equal(optimizer_state(fresh.optimizer), unit.optimizer)
    assert fresh.train_progress.num_steps_completed == 10


def test_restore_from_best(tmp_path):
    from torchtnt.utils.checkpoint import BestCheckpointConfig

    class Scored(ToyUnit):
        def train_step(self, state: Any, data: Any) -> None:
            super().train_step(state, data)
            self.loss = [0.5, 0.2, 0.9, 0.4, 0.7][self.train_progress.num_steps_completed_in_epoch]

    saver = DistributedCheckpointSaver(
        str(tmp_path), save_every_n_train_steps=1, best_checkpoint_config=BestCheckpointConfig("loss", "min"),
        save_on_train_end=False,
    )
    unit = Scored()
    unit.loss = None
    train(unit, plain_loader(), max_epochs=1, callbacks=[saver])
    fresh = ToyUnit(seed=4)
    assert DistributedCheckpointSaver.restore_from_best(str(tmp_path), fresh, "loss", "min")
    assert fresh.train_progress.num_steps_completed == 2


@pytest.mark.slow
def test_save_restore_ddp(tmp_path):
    """torchtnt's test_save_restore_ddp: two gloo ranks (rank 0 names the directory, the other
    passes ""), a DDP unit saved each epoch, restored into new units on both ranks: module and
    optimizer equal to the trained ones, and unequal before."""
    import launching

    records = launching.run_phase(Path(__file__), "ddp", 2, tmp_path)
    for record in records:
        assert record["differed_before"] == [True, True]
        assert record["equal_after"] == [True, True]
        assert record["dirpath"] == records[0]["dirpath"]


def _ddp_worker(record: dict[str, Any], out: str) -> None:
    import torch.distributed as dist
    from torchtnt.framework.auto_unit import AutoUnit

    class Unit(AutoUnit[Any]):
        def compute_loss(self, state: Any, data: Any) -> tuple[torch.Tensor, Any]:
            x, y = data
            outputs = self.module(x)
            return torch.nn.functional.mse_loss(outputs, y), outputs

        def configure_optimizers_and_lr_scheduler(self, module: torch.nn.Module) -> tuple[Any, Any]:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)

    def unit() -> Unit:
        return Unit(module=torch.nn.Linear(4, 1), strategy="ddp", device=torch.device("cpu"))

    rank = dist.get_rank()
    seed_everything(0)
    trained = unit()
    saver = DistributedCheckpointSaver(out if rank == 0 else "", save_every_n_epochs=1)
    record["dirpath"] = saver.dirpath
    train(trained, plain_loader(), max_epochs=2, callbacks=[saver])
    seed_everything(1 + rank)
    fresh = unit()

    def equal(a: Any, b: Any) -> bool:
        mine, theirs = _tensors(a.state_dict()), _tensors(b.state_dict())
        return len(mine) == len(theirs) and all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))

    record["differed_before"] = [not equal(fresh.module, trained.module), not equal(fresh.optimizer, trained.optimizer)]
    DistributedCheckpointSaver.restore(os.path.join(out, "epoch_2_step_10") if rank == 0 else "", fresh)
    record["equal_after"] = [equal(fresh.module, trained.module), equal(fresh.optimizer, trained.optimizer)]


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


if __name__ == "__main__":  # one rank of test_save_restore_ddp (tests/launching.py)
    from gloo_worker import run_rank

    phase, rank, world, rendezvous, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    run_rank(rank, world, rendezvous, os.path.join(out, f"{phase}_rank{rank}.json"), lambda record: _ddp_worker(record, out))
