"""Lightning: exact resume with global-RNG randomness whatever the train loader does, and the
checkpoint's user additions (hyper-parameters, ``on_save_checkpoint``) round-trip."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
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
