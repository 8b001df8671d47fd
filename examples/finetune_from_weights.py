"""Fine-tune from a snapshot's weights only: a new optimizer, training progress from zero.

A first run trains a torchtnt unit on one task and snapshots it. A second unit then loads only
the model weights from the latest snapshot (not the optimizer, not the progress), gets a new
optimizer and trains on a related task. It runs on CPU in seconds:

    python examples/finetune_from_weights.py [--dirpath DIR]

DIR (a new or empty directory) defaults to a new temporary one; the pre-training snapshots go to
``DIR/pretrain``, the fine-tuning ones to ``DIR/finetune``.
"""

import argparse
import os
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.callbacks.checkpointer_types import RestoreOptions
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

# --8<-- [start:imports]
from tnt_snapshot_plugin import latest_snapshot
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

# --8<-- [end:imports]

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(TrainUnit[Batch]):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.optimizer: torch.optim.Optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def train_step(self, state: State, data: Batch) -> None:
        x, y = data
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def make_data(offset: float) -> TensorDataset:
    """The task: y = sum(x) + offset * x[:, 0]."""
    x = torch.randn(160, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + offset * x[:, :1])


def loss_on(unit: Regressor, data: TensorDataset) -> float:
    with torch.no_grad():
        x, y = data.tensors
        return torch.nn.functional.mse_loss(unit.model(x), y).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Fine-tune from a snapshot's weights only.")
    parser.add_argument("--dirpath", help="where the snapshots go (default: a new temporary directory)")
    root = parser.parse_args(argv).dirpath or tempfile.mkdtemp(prefix="finetune-from-weights-")
    pretrain_dir, finetune_dir = os.path.join(root, "pretrain"), os.path.join(root, "finetune")

    torch.manual_seed(0)
    pretrained = Regressor()
    pretrain_data = DataLoader(make_data(0.0), batch_size=8, shuffle=True)
    # no cadence given: one snapshot, when training ends
    train(pretrained, pretrain_data, max_epochs=3, callbacks=[TorchSnapshotSaver(pretrain_dir)])
    path = latest_snapshot(pretrain_dir)
    print(f"pre-trained {pretrained.train_progress.num_steps_completed} steps; latest snapshot: {path}")

    # --8<-- [start:finetune]
    unit = Regressor()
    unit.optimizer = torch.optim.SGD(unit.model.parameters(), lr=0.01)  # a new optimizer
    TorchSnapshotSaver.restore(
        path,
        unit,
        restore_options=RestoreOptions(restore_train_progress=False, restore_optimizers=False),
    )  # the snapshot's weights; the unit keeps its own optimizer and starts at step 0
    # --8<-- [end:finetune]
    loaded = all(
        torch.equal(a, b)
        for a, b in zip(unit.model.state_dict().values(), pretrained.model.state_dict().values(), strict=True)
    )
    fresh = unit.train_progress.num_steps_completed == 0 and not unit.optimizer.state
    print(f"weights loaded: {loaded}; progress and optimizer new: {fresh}")

    new_task = make_data(0.5)
    print(f"loss on the new task before fine-tuning: {loss_on(unit, new_task):.4f}")
    finetune_dataloader = DataLoader(new_task, batch_size=8, shuffle=True)
    train(unit, finetune_dataloader, max_epochs=2, callbacks=[TorchSnapshotSaver(finetune_dir)])
    print(f"loss on the new task after fine-tuning:  {loss_on(unit, new_task):.4f}")
    print(f"fine-tuned {unit.train_progress.num_steps_completed} steps; snapshots: {sorted(os.listdir(finetune_dir))}")
    return 0 if loaded and fresh else 1


if __name__ == "__main__":
    sys.exit(main())
