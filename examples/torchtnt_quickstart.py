"""The torchtnt quickstart: train with snapshots; run again, and training resumes where it stopped.

The model and the data are the script's own, tiny, on CPU; it runs in seconds:

    python examples/torchtnt_quickstart.py

The snapshots go to ``checkpoints/run1`` in the working directory, which must not exist yet.
The script runs the quickstart twice. The first run stops at step 35, as a killed job would. The
second run resumes from the newest snapshot and trains to the end. The script then checks that
the result is bitwise equal to a run that was never interrupted.
"""

import argparse
import os
import sys

# --8<-- [start:imports]
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

from tnt_snapshot_plugin import latest_snapshot
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

# --8<-- [end:imports]


# --8<-- [start:model]
class Regressor(TrainUnit):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def train_step(self, state: State, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = data
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
# --8<-- [end:model]


# --8<-- [start:data]
x = torch.randn(200, 4)
train_dataloader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)
# --8<-- [end:data]


def train_or_resume() -> Regressor:
    """The quickstart: resume from the newest snapshot if there is one, then train to 2 epochs."""
    # --8<-- [start:quickstart]
    unit = Regressor()
    saver = TorchSnapshotSaver("checkpoints/run1", save_every_n_epochs=1, keep_last_n_snapshots=2)
    if latest_snapshot("checkpoints/run1"):  # a rerun resumes where the last run stopped
        TorchSnapshotSaver.restore_from_latest("checkpoints/run1", unit)
    train(unit, train_dataloader, max_epochs=2, callbacks=[saver])
    # --8<-- [end:quickstart]
    return unit


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
    if os.path.exists("checkpoints/run1"):
        print("checkpoints/run1 exists already: run the example in another directory", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    crash = crash_at_step(35)
    try:
        train_or_resume()
    except Crash as stopped:
        print(f"first run: {stopped}; newest snapshot: {latest_snapshot('checkpoints/run1')}")
    finally:
        crash.remove()

    torch.manual_seed(1234)  # as in a new process: other initial weights, another RNG state
    unit = train_or_resume()
    print(f"second run: resumed and trained to step {unit.train_progress.num_steps_completed}")

    torch.manual_seed(0)
    uninterrupted = Regressor()
    train(uninterrupted, train_dataloader, max_epochs=2)
    same = all(
        torch.equal(a, b)
        for a, b in zip(unit.model.state_dict().values(), uninterrupted.model.state_dict().values(), strict=True)
    )
    print(f"the resumed run equals an uninterrupted one bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
