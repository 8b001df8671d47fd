"""torchdata's StatefulDataLoader resumed mid-epoch, in both adapters, with and without workers.

A shuffling StatefulDataLoader (its order from the global RNG, its iterator drawing a base seed
from it) feeds a model with dropout; a run interrupted mid-epoch and resumed in a fresh Trainer
(or unit) from other seeds must end bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from tnt_snapshot_plugin.demo_data import make_data

pytestmark = pytest.mark.slow


def stateful_loader(num_workers: int) -> StatefulDataLoader:
    x, y = make_data(40)
    return StatefulDataLoader(
        TensorDataset(x, y), batch_size=4, shuffle=True, num_workers=num_workers
    )  # 10 batches per epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resumes_a_stateful_dataloader_mid_epoch_bitwise(tmp_path, num_workers):
    from lightning_toy import ToyModule, assert_bitwise_equal, make_trainer, seed_everything, weights

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    seed_everything(7)
    reference = ToyModule(seed=0)
    make_trainer(tmp_path / "ref", [], enable_checkpointing=False).fit(
        reference, stateful_loader(num_workers)
    )

    dirpath = str(tmp_path / "snaps")
    seed_everything(7)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=6)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(
            ToyModule(seed=0, fail_at_step=14), stateful_loader(num_workers)
        )

    seed_everything(999)
    module = ToyModule(seed=42)
    trainer = make_trainer(tmp_path, [TorchSnapshotSaver(dirpath, save_on_train_end=False)])
    trainer.fit(module, stateful_loader(num_workers), ckpt_path="last")
    assert trainer.ckpt_path == os.path.join(dirpath, "epoch_1_step_12")  # mid-epoch 2
    assert trainer.global_step == 20
    assert_bitwise_equal(weights(module), weights(reference))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchtnt_resumes_a_stateful_dataloader_mid_epoch_bitwise(tmp_path, num_workers):
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import ToyUnit, assert_bitwise_equal, seed_everything, weights

    seed_everything(7)
    reference = ToyUnit(seed=0)
    train(reference, stateful_loader(num_workers), max_epochs=2)

    seed_everything(7)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=6)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(ToyUnit(seed=0, fail_at_step=14), stateful_loader(num_workers), max_epochs=2, callbacks=[saver])

    seed_everything(999)
    resumed = ToyUnit(seed=42)
    loader = stateful_loader(num_workers)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), resumed, train_dataloader=loader)
    assert resumed.train_progress.num_steps_completed == 12  # mid-epoch 2
    train(resumed, loader, max_epochs=2, callbacks=[TorchSnapshotSaver(str(tmp_path))])
    assert resumed.train_progress.num_steps_completed == 20
    assert_bitwise_equal(weights(resumed), weights(reference))
    # the RNG state is set again right after the first fetch, by a wrapper gone after it
    assert "get_next_train_batch" not in vars(resumed)


def test_the_savers_add_no_hook_torchtnt_calls_at_every_batch():
    """torchtnt calls a per-batch hook on every callback whose class overrides it: the savers
    override only the step-end hook of the per-step ones."""
    from torchtnt.framework.callback import Callback

    from tnt_snapshot_plugin.adapters.torchtnt import DistributedCheckpointSaver, TorchSnapshotSaver

    for saver in (TorchSnapshotSaver, DistributedCheckpointSaver):
        for hook in ("on_train_get_next_batch_end", "on_train_step_start"):
            assert getattr(saver, hook) is getattr(Callback, hook), (saver.__name__, hook)
