"""Train a torchtnt unit with snapshots, then resume from the latest one in a fresh unit.

The script checks that the resumed run ends bitwise equal to a run that was never interrupted.
It runs on CPU in seconds:

    python examples/torchtnt_quickstart.py [--dirpath DIR]

DIR (a new or empty directory) defaults to a new temporary one; the snapshots stay there
(``tnt-snapshot ls DIR`` lists them).
"""

import argparse
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

# --8<-- [start:imports]
from tnt_snapshot_plugin import latest_snapshot
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

# --8<-- [end:imports]

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(TrainUnit[Batch]):
    """Learns y = sum(x). Dropout draws from torch's RNG: a bitwise resume restores it too."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def train_step(self, state: State, data: Batch) -> None:
        x, y = data
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def make_dataloader() -> DataLoader:
    """25 shuffled batches an epoch; the order comes from torch's RNG."""
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train with snapshots, then resume from the latest.")
    parser.add_argument("--dirpath", help="where the snapshots go (default: a new temporary directory)")
    dirpath = parser.parse_args(argv).dirpath or tempfile.mkdtemp(prefix="torchtnt-quickstart-")
    train_dataloader = make_dataloader()

    torch.manual_seed(0)
    unit = Regressor()
    # --8<-- [start:quickstart]
    saver = TorchSnapshotSaver(
        dirpath,
        save_every_n_train_steps=35,  # and a final snapshot when training ends
        keep_last_n_snapshots=2,      # older ones are deleted once a newer one is complete
    )
    train(unit, train_dataloader, max_epochs=2, callbacks=[saver])
    # --8<-- [end:quickstart]
    print(f"trained 2 epochs ({unit.train_progress.num_steps_completed} steps) into {dirpath}")

    torch.manual_seed(1234)  # a new process: other initial weights, another RNG state
    # --8<-- [start:resume]
    unit = Regressor()
    if TorchSnapshotSaver.restore_from_latest(dirpath, unit):  # False: nothing to resume from
        print(f"resumed from {latest_snapshot(dirpath)}")
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=35, keep_last_n_snapshots=2)
    train(unit, train_dataloader, max_epochs=4, callbacks=[saver])  # two more epochs
    # --8<-- [end:resume]

    torch.manual_seed(0)
    uninterrupted = Regressor()
    train(uninterrupted, train_dataloader, max_epochs=4)
    same = all(
        torch.equal(a, b)
        for a, b in zip(unit.model.state_dict().values(), uninterrupted.model.state_dict().values(), strict=True)
    )
    print(f"the resumed run equals an uninterrupted one bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
