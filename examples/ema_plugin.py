"""A plugin: an exponential moving average (EMA) of the weights, saved with every snapshot.

The plugin implements the five snapshot hooks: it adds the EMA model to each snapshot, asks for
one more snapshot at step 60, puts the last loss into each snapshot's name, reports each
committed snapshot, and is told what a restore loaded. It is also a torchtnt callback, which
updates the EMA after every step. The script trains 2 epochs, resumes in a fresh unit and plugin,
and checks that the weights and the EMA end bitwise equal to a run that was never interrupted.
It runs on CPU in seconds:

    python examples/ema_plugin.py [--dirpath DIR]

DIR (a new or empty directory) defaults to a new temporary one.
"""

import argparse
import sys
import tempfile

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

# --8<-- [start:imports]
from tnt_snapshot_plugin import hookimpl
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

# --8<-- [end:imports]

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(TrainUnit[Batch]):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.loss = float("nan")

    def train_step(self, state: State, data: Batch) -> None:
        x, y = data
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.loss = loss.item()


# --8<-- [start:plugin]
class EMAPlugin(Callback):
    """Keep an exponential moving average of the weights; save it with every snapshot."""

    def __init__(self, unit: Regressor, decay: float = 0.9):
        self.unit = unit
        self.ema_model = AveragedModel(unit.model, multi_avg_fn=get_ema_multi_avg_fn(decay))

    def on_train_step_end(self, state: State, unit: TrainUnit[Batch]) -> None:  # torchtnt's hook
        self.ema_model.update_parameters(self.unit.model)

    @hookimpl
    def tnt_snapshot_plugin_extra_state(self, event):
        return {"ema": self.ema_model}        # saved, and restored into, under key "ema"

    @hookimpl
    def tnt_snapshot_plugin_should_snapshot(self, event, step, default):
        return True if step == 60 else None   # also snapshot step 60; otherwise the cadence decides

    @hookimpl
    def tnt_snapshot_plugin_snapshot_name(self, default):
        return f"{default}_loss={self.unit.loss:.4f}"  # epoch_1_step_40_loss=0.1234

    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path, epoch, step):
        print(f"committed {path}")            # complete and visible to restore from now on

    @hookimpl
    def tnt_snapshot_plugin_after_restore(self, path, keys):
        print(f"resumed from {path}: {sorted(keys)}")
# --8<-- [end:plugin]


def make_dataloader() -> DataLoader:
    """40 shuffled batches an epoch; the order comes from torch's RNG."""
    x = torch.randn(320, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Snapshots that carry an EMA of the weights.")
    parser.add_argument("--dirpath", help="where the snapshots go (default: a new temporary directory)")
    dirpath = parser.parse_args(argv).dirpath or tempfile.mkdtemp(prefix="ema-plugin-")
    train_dataloader = make_dataloader()

    torch.manual_seed(0)
    unit = Regressor()
    # --8<-- [start:register]
    ema = EMAPlugin(unit)
    saver = TorchSnapshotSaver(dirpath, save_every_n_epochs=1)
    saver.register(ema)  # this saver only; a misspelt hook name raises ConfigError here
    train(unit, train_dataloader, max_epochs=2, callbacks=[ema, saver])  # ema updates before the saver saves
    # --8<-- [end:register]

    torch.manual_seed(1234)  # a new process: other initial weights, another RNG state
    unit = Regressor()
    # --8<-- [start:resume]
    ema = EMAPlugin(unit)
    saver = TorchSnapshotSaver(dirpath, save_every_n_epochs=1)
    saver.register(ema)
    # the restore asks the saver's plugins for their state too: the EMA is restored with the unit
    TorchSnapshotSaver.restore_from_latest(dirpath, unit, plugin_manager=saver.snapshotter.plugin_manager)
    train(unit, train_dataloader, max_epochs=4, callbacks=[ema, saver])
    # --8<-- [end:resume]

    torch.manual_seed(0)
    uninterrupted = Regressor()
    uninterrupted_ema = EMAPlugin(uninterrupted)
    train(uninterrupted, train_dataloader, max_epochs=4, callbacks=[uninterrupted_ema])
    resumed = [*unit.model.state_dict().values(), *ema.ema_model.state_dict().values()]
    reference = [*uninterrupted.model.state_dict().values(), *uninterrupted_ema.ema_model.state_dict().values()]
    same = all(torch.equal(a, b) for a, b in zip(resumed, reference, strict=True))
    print(f"weights and EMA equal an uninterrupted run's bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
