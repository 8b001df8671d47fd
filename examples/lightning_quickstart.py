"""Train a LightningModule with snapshots, then resume with ``ckpt_path="last"`` in a new Trainer.

The script checks that the resumed run ends bitwise equal to a run that was never interrupted.
It runs on CPU in seconds:

    python examples/lightning_quickstart.py [--dirpath DIR]

DIR (a new or empty directory) defaults to a new temporary one; the snapshots stay there
(``tnt-snapshot ls DIR`` lists them).
"""

import argparse
import sys
import tempfile

import pytorch_lightning as pl
import torch
from pytorch_lightning import Trainer
from torch.utils.data import DataLoader, TensorDataset

# --8<-- [start:imports]
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

# --8<-- [end:imports]

class Regressor(pl.LightningModule):
    """Learns y = sum(x). Dropout draws from torch's RNG: a bitwise resume restores it too."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def make_dataloader() -> DataLoader:
    """25 shuffled batches an epoch; the order comes from torch's RNG."""
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train with snapshots, then resume with ckpt_path='last'.")
    parser.add_argument("--dirpath", help="where the snapshots go (default: a new temporary directory)")
    dirpath = parser.parse_args(argv).dirpath or tempfile.mkdtemp(prefix="lightning-quickstart-")
    train_dataloader = make_dataloader()

    torch.manual_seed(0)
    model = Regressor()
    # --8<-- [start:quickstart]
    saver = TorchSnapshotSaver(
        dirpath,
        every_n_train_steps=35,      # trainer.global_step: optimizer steps; and a final snapshot
        keep_last_n_snapshots=2,     # the newest 2 are kept, and the one a run resumed from
    )
    trainer = Trainer(max_epochs=2, callbacks=[saver], logger=False, enable_progress_bar=False)
    trainer.fit(model, train_dataloader, ckpt_path="last")  # a first run starts fresh; a rerun resumes
    # --8<-- [end:quickstart]
    print(f"trained 2 epochs ({trainer.global_step} steps) into {dirpath}")

    torch.manual_seed(1234)  # a new process: other initial weights, another RNG state
    model = Regressor()
    saver = TorchSnapshotSaver(dirpath, every_n_train_steps=35, keep_last_n_snapshots=2)
    trainer = Trainer(
        max_epochs=4, callbacks=[saver], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(model, train_dataloader, ckpt_path="last")  # two more epochs
    print(f"resumed and trained on to step {trainer.global_step}")

    torch.manual_seed(0)
    uninterrupted = Regressor()
    reference = Trainer(
        max_epochs=4, enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    reference.fit(uninterrupted, train_dataloader)
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), uninterrupted.state_dict().values(), strict=True)
    )
    print(f"the resumed run equals an uninterrupted one bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
