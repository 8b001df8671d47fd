"""The Lightning quickstart: train with snapshots; run again, and ``fit`` resumes where it stopped.

The model and the data are the script's own, tiny, on CPU; it runs in seconds:

    python examples/lightning_quickstart.py

The snapshots go to ``checkpoints/lightning`` in the working directory, which must not exist yet.
The script runs the quickstart twice. The first run stops at step 35, as a killed job would. The
second run resumes with ``ckpt_path="last"`` and trains to the end. The script then checks that
the result is bitwise equal to a run that was never interrupted.
"""

import argparse
import os
import sys

# --8<-- [start:imports]
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

# --8<-- [end:imports]


# --8<-- [start:model]
class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
# --8<-- [end:model]


# --8<-- [start:data]
x = torch.randn(200, 4)
train_dataloader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)
# --8<-- [end:data]


def fit_or_resume() -> Regressor:
    """The quickstart: resume from the newest snapshot if there is one, then train to 2 epochs."""
    # --8<-- [start:quickstart]
    model = Regressor()
    saver = TorchSnapshotSaver("checkpoints/lightning", every_n_epochs=1, keep_last_n_snapshots=2)
    trainer = pl.Trainer(max_epochs=2, callbacks=[saver])
    trainer.fit(model, train_dataloader, ckpt_path="last")  # a first run starts fresh; a rerun resumes
    # --8<-- [end:quickstart]
    return model


class Crash(RuntimeError):
    """The interruption this script simulates."""


def crash_at_step(step: int) -> torch.utils.hooks.RemovableHandle:
    """Make the model's forward pass raise at train step ``step``, as if the job died there."""
    steps = 0

    def count(module: torch.nn.Module, args: tuple) -> None:
        nonlocal steps
        if isinstance(module, torch.nn.Sequential):
            steps += 1
            if steps == step:
                raise Crash(f"stopped at step {step}")

    return torch.nn.modules.module.register_module_forward_pre_hook(count)


def main(argv=None) -> int:
    argparse.ArgumentParser(description="Train with snapshots, stop, resume.").parse_args(argv)
    if os.path.exists("checkpoints/lightning"):
        print("checkpoints/lightning exists already: run the example in another directory", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    crash = crash_at_step(35)
    try:
        fit_or_resume()
    except Crash as stopped:
        print(f"first run: {stopped}; snapshots: {sorted(os.listdir('checkpoints/lightning'))}")
    finally:
        crash.remove()

    torch.manual_seed(1234)  # as in a new process: other initial weights, another RNG state
    model = fit_or_resume()
    print(f"second run: resumed and trained to step {model.trainer.global_step}")

    torch.manual_seed(0)
    uninterrupted = Regressor()
    reference = pl.Trainer(
        max_epochs=2, enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False
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
