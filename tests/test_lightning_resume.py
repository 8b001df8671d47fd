"""Lightning: exact resume with global-RNG randomness whatever the train loader does, and the
checkpoint's user additions (hyper-parameters, ``on_save_checkpoint``) round-trip."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
import pytorch_lightning as pl
from lightning_toy import (
    ResumableLoader,
    ToyModule,
    assert_bitwise_equal,
    make_trainer,
    optimizer_tensors,
    seed_everything,
    weights,
)

from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data


class LazyLoader:
    """A resumable loader whose ``__iter__`` is a generator: the DataLoader's iterator starts (and
    draws its base seed from the global RNG) only at the first ``next()``, inside the first fetch."""

    def __init__(self, inner: ResumableLoader) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        yield from self.inner

    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def make_loader(kind: str) -> Any:
    eager = ResumableLoader(make_data(40), seed=3)  # 10 batches per epoch
    return eager if kind == "eager" else LazyLoader(eager)


@pytest.mark.parametrize("kind", ["eager", "lazy"])
def test_resume_with_dropout_is_bitwise_for_eager_and_lazy_loaders(tmp_path, kind):
    """Mid-epoch (step 6 of 10) and at the epoch boundary (end of epoch 1), resumed in a fresh
    Trainer from other seeds, end bitwise equal to the uninterrupted run."""
    seed_everything(7)
    reference = ToyModule(seed=0)
    ref_trainer = make_trainer(tmp_path / "ref", [], enable_checkpointing=False)
    ref_trainer.fit(reference, make_loader(kind))

    dirpath = str(tmp_path / "snaps")
    seed_everything(7)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=6, save_every_n_epochs=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(ToyModule(seed=0, fail_at_step=13), make_loader(kind))

    for snapshot in ("epoch_0_step_6", "epoch_1_step_10"):  # mid-epoch, epoch boundary
        seed_everything(999)
        module = ToyModule(seed=42)
        trainer = make_trainer(tmp_path, [TorchSnapshotSaver(dirpath, save_on_train_end=False)])
        trainer.fit(module, make_loader(kind), ckpt_path=os.path.join(dirpath, snapshot))
        assert trainer.global_step == ref_trainer.global_step == 20
        assert_bitwise_equal(weights(module), weights(reference))
        assert_bitwise_equal(optimizer_tensors(trainer), optimizer_tensors(ref_trainer))


MODULE_EXTRA = {"note": "kept", "count": 3, "ratio": 0.25, "nested": {"ids": [1, 2, 3], "flag": True}}
DATAMODULE_STATE = {"served": 7, "source": "synthetic", "weights": [0.5, 1.5]}


class WithExtras(ToyModule):
    """Hyper-parameters saved by ``save_hyperparameters`` and an ``on_save_checkpoint`` addition."""

    def __init__(self, seed: int = 0, lr: float = 0.01, name: str = "toy", schedule: Any = None) -> None:
        super().__init__(seed=seed)
        self.save_hyperparameters()
        self.loaded: dict[str, Any] = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["module_extra"] = MODULE_EXTRA

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = dict(checkpoint)


class ExtrasData(pl.LightningDataModule):
    """A datamodule with hyper-parameters and its own state (Lightning 2.6's datamodules add to
    the checkpoint through ``state_dict``; they have no ``on_save_checkpoint`` hook)."""

    def __init__(self, batch_size: int = 4, tag: str = "dm") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loaded_state: Any = None

    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(make_data(12), batch_size=self.hparams.batch_size, seed=3)

    def state_dict(self) -> dict[str, Any]:
        return DATAMODULE_STATE

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded_state = state_dict


def test_hyperparameters_and_on_save_checkpoint_additions_round_trip(tmp_path):
    from tnt_snapshot_plugin.adapters.lightning import SnapshotCheckpointIO

    hparams = {"seed": 1, "lr": 0.003, "name": "run-a", "schedule": {"gamma": 0.5, "milestones": [2, 4]}}
    dirpath = str(tmp_path / "snaps")
    make_trainer(tmp_path, [TorchSnapshotSaver(dirpath, save_every_n_epochs=1)], max_epochs=1).fit(
        WithExtras(**hparams), datamodule=ExtrasData(batch_size=4, tag="dm-a")
    )
    snapshot = os.path.join(dirpath, "epoch_1_step_3")

    checkpoint = SnapshotCheckpointIO().load_checkpoint(snapshot)
    assert checkpoint["hyper_parameters"] == hparams
    assert checkpoint["datamodule_hyper_parameters"] == {"batch_size": 4, "tag": "dm-a"}
    assert checkpoint["module_extra"] == MODULE_EXTRA
    assert checkpoint["ExtrasData"] == DATAMODULE_STATE
    assert type(checkpoint["module_extra"]["count"]) is int
    assert type(checkpoint["module_extra"]["nested"]["flag"]) is bool

    # resumed by a fresh Trainer: the module and the datamodule get them back through their hooks
    module, data = WithExtras(seed=9), ExtrasData()
    make_trainer(tmp_path, [TorchSnapshotSaver(dirpath)], max_epochs=2).fit(
        module, datamodule=data, ckpt_path=snapshot
    )
    assert module.loaded["hyper_parameters"] == hparams
    assert module.loaded["module_extra"] == MODULE_EXTRA
    assert data.loaded_state == DATAMODULE_STATE
