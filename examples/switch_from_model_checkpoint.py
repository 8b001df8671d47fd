"""Switch from Lightning's ``ModelCheckpoint`` to ``TorchSnapshotSaver``: the same arguments.

Two identical runs, one with each callback, keep the 2 best checkpoints by ``val_loss``; each
reports its ``best_model_path`` and validates it again with ``ckpt_path="best"``. The script
checks that both pick the same step with the same score. The saver also keeps its newest
snapshot (what ``ckpt_path="last"`` and a crash resume from). It runs on CPU in seconds:

    python examples/switch_from_model_checkpoint.py [--dirpath DIR]

DIR (a new or empty directory) defaults to a new temporary one; each run writes under its own
``default_root_dir`` there (``DIR/model_checkpoint`` and ``DIR/snapshots``).
"""

import argparse
import os
import re
import sys
import tempfile

import pytorch_lightning as pl
import torch
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

# --8<-- [start:imports]
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

# --8<-- [end:imports]

class Regressor(pl.LightningModule):
    """Learns y = sum(x) and logs ``val_loss`` after every epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def make_dataloader(seed: int, shuffle: bool) -> DataLoader:
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=shuffle)


def fit_and_validate_best(checkpoint: ModelCheckpoint, root: str) -> tuple[int, float, float]:
    """Train with ``checkpoint``; return the step and score of the best checkpoint it reports,
    and the val_loss of validating that checkpoint again."""
    torch.manual_seed(0)  # both runs train identically
    model, train_dataloader, val_dataloader = Regressor(), make_dataloader(0, True), make_dataloader(1, False)
    # --8<-- [start:best]
    trainer = Trainer(
        max_epochs=5, callbacks=[checkpoint], default_root_dir=root, logger=False, enable_progress_bar=False
    )
    trainer.fit(model, train_dataloader, val_dataloader)
    print(f"{type(checkpoint).__name__}: best {checkpoint.best_model_path}")
    # ckpt_path="best" loads best_model_path: a checkpoint file, or a snapshot directory
    validated = trainer.validate(model, val_dataloader, ckpt_path="best", verbose=False)
    # --8<-- [end:best]
    best = checkpoint.best_model_score
    score, again = float("nan") if best is None else best.item(), validated[0]["val_loss"]
    print(f"  val_loss {score:.6f}; validated again: {again:.6f}")
    kept = sorted(os.listdir(checkpoint.dirpath), key=step_of)
    print(f"  kept in {checkpoint.dirpath}: {', '.join(kept)}")
    return step_of(checkpoint.best_model_path), score, again


def step_of(path: str) -> int:
    """The step in a checkpoint's name (``epoch=4-step=60.ckpt``) or a snapshot's (``epoch_5_step_60_...``)."""
    match = re.search(r"step[=_](\d+)", os.path.basename(path))
    return int(match[1]) if match else -1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The same run with ModelCheckpoint and with TorchSnapshotSaver.")
    parser.add_argument("--dirpath", help="where both runs write (default: a new temporary directory)")
    root = parser.parse_args(argv).dirpath or tempfile.mkdtemp(prefix="switch-from-model-checkpoint-")

    # --8<-- [start:switch]
    before = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, every_n_epochs=1)
    after = TorchSnapshotSaver(monitor="val_loss", mode="min", save_top_k=2, every_n_epochs=1)
    # --8<-- [end:switch]
    theirs = fit_and_validate_best(before, os.path.join(root, "model_checkpoint"))
    ours = fit_and_validate_best(after, os.path.join(root, "snapshots"))
    same = theirs == ours and ours[1] == ours[2]
    print(f"both pick the same best step with the same val_loss: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
