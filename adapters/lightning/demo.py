"""The demo job for PyTorch Lightning: train, get interrupted, resume with ``ckpt_path="last"``.

Run it through the demo command: ``tnt-snapshot-demo --framework lightning``.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import Batch, ResumableLoader, make_data


class Interrupted(RuntimeError):
    """Stands in for whatever kills a real job (a node failure, an OOM, a bug)."""


class DemoModule(pl.LightningModule):
    def __init__(self, seed: int, interrupt_at: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1),
        )  # fmt: skip
        self.interrupt_at = interrupt_at

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.interrupt_at:
            raise Interrupted(f"simulated crash before step {self.interrupt_at + 1}")
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y) * (1.0 + 1e-6 * random.random())

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class _LightningEpoch:
    """Lightning calls ``sampler.set_epoch(epoch)`` at each epoch start; the loader shuffles by it.

    (Lightning loads a loader's state only when it resumes mid-epoch; at an epoch boundary the
    epoch number must come from Lightning.)
    """

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.epoch = epoch


def _loader(steps_per_epoch: int) -> ResumableLoader:
    loader = ResumableLoader(make_data(8 * steps_per_epoch, seed=1, features=16), batch_size=8, seed=2)
    loader.sampler = _LightningEpoch(loader)  # type: ignore[attr-defined]
    return loader


def _trainer(epochs: int, callbacks: list[Any], root: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=root,
    )


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


class _Timing(pl.Callback):
    """When the resumed fit started, finished loading the snapshot, and where it stood then."""

    def __init__(self) -> None:
        self.setup_at = self.loaded_at = 0.0
        self.step = self.epoch = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.setup_at = time.perf_counter()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self.loaded_at = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step, self.epoch = trainer.global_step, trainer.current_epoch


class Paced(pl.Callback):
    """Stands in for a real step's length. The demo's steps take a millisecond, less than writing
    a snapshot; a real step takes longer. Before a snapshot is due (Lightning runs checkpoint
    callbacks last, so this runs before the saver), it waits for the previous one to be written,
    as a longer step would, so the saver never waits on its own previous snapshot (no
    ``SnapshotBusyWarning``)."""

    def __init__(self, saver: TorchSnapshotSaver, every: int, steps_per_epoch: int) -> None:
        self.saver, self.every, self.steps_per_epoch = saver, every, steps_per_epoch

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every == 0 or (batch_idx + 1) % self.steps_per_epoch == 0:
            self.saver.snapshotter.wait()


def demo(dirpath: str, *, epochs: int, steps_per_epoch: int, interrupt_at: int) -> dict[str, Any]:
    """Train into ``dirpath``, crash at global step ``interrupt_at``, resume from the latest
    snapshot in a fresh Trainer with ``ckpt_path="last"``, compare with an uninterrupted run."""
    # Not a divisor of the epoch length, so a step snapshot is never followed at once by the
    # epoch-end snapshot (which would have to wait for it).
    every = max(1, steps_per_epoch // 2 - 1)
    report: dict[str, Any] = {"framework": "lightning", "dirpath": dirpath, "every_n_steps": every}
    root = dirpath  # Lightning writes nothing there: no logger, no ModelCheckpoint
    quiet = logging.getLogger("pytorch_lightning")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # Lightning's advice for real jobs (dataloader workers, log intervals) is noise here.
            warnings.filterwarnings("ignore", module="pytorch_lightning")
            warnings.filterwarnings("ignore", module="lightning_fabric")
            _run(report, dirpath, root, every, epochs, steps_per_epoch, interrupt_at)
    finally:
        quiet.setLevel(level)
    return report


def _run(
    report: dict[str, Any],
    dirpath: str,
    root: str,
    every: int,
    epochs: int,
    steps_per_epoch: int,
    interrupt_at: int,
) -> None:
    _seed(0)
    saver = TorchSnapshotSaver(dirpath, every_n_train_steps=every, every_n_epochs=1)
    started = time.perf_counter()
    try:
        _trainer(epochs, [Paced(saver, every, steps_per_epoch), saver], root).fit(
            DemoModule(seed=0, interrupt_at=interrupt_at), _loader(steps_per_epoch)
        )
    except Interrupted as exc:
        report["interrupted"] = str(exc)
    report["first_run_s"] = time.perf_counter() - started
    report["saved"] = list(saver.snapshotter.stats.committed)
    report["busy_waits"] = saver.snapshotter.stats.busy_waits

    _seed(12345)  # a new process would not share the crashed one's RNG state
    resumed = DemoModule(seed=999)
    saver = TorchSnapshotSaver(dirpath, every_n_train_steps=every, every_n_epochs=1)
    timing = _Timing()
    trainer = _trainer(epochs, [timing, Paced(saver, every, steps_per_epoch), saver], root)
    started = time.perf_counter()
    trainer.fit(resumed, _loader(steps_per_epoch), ckpt_path="last")
    report["resumed_run_s"] = time.perf_counter() - started
    report["resumed_from"] = trainer.ckpt_path
    report["restore_s"] = timing.loaded_at - timing.setup_at if timing.loaded_at else 0.0
    report["restored_step"] = timing.step
    report["restored_epoch"] = timing.epoch
    report["saved_after_resume"] = list(saver.snapshotter.stats.committed)
    report["busy_waits"] += saver.snapshotter.stats.busy_waits
    report["final_step"] = trainer.global_step

    _seed(0)
    reference = DemoModule(seed=0)
    _trainer(epochs, [], root).fit(reference, _loader(steps_per_epoch))
    report["bitwise_identical"] = all(
        torch.equal(a, b)
        for a, b in zip(
            reference.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
        )
    )
