"""The PyTorch Lightning adapter: one callback, and resume through Lightning's own ``ckpt_path``.

::

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    # ModelCheckpoint's arguments, with ModelCheckpoint's meanings
    saver = TorchSnapshotSaver("/ckpts/run1", monitor="val_loss", save_top_k=2, every_n_epochs=1)
    trainer = Trainer(max_epochs=10, callbacks=[saver])
    trainer.fit(model, datamodule=dm, ckpt_path="last")  # resumes if /ckpts/run1 holds a snapshot

The package: ``saver`` (the callback), ``options`` (``ModelCheckpoint``'s arguments checked and
mapped), ``engine`` (the core saver, made once ``dirpath`` is known), ``best`` (best-k),
``resume`` (``ckpt_path``, the RNG around a resume), ``io`` (the CheckpointIO that reads
snapshots), ``restore`` (restores outside ``fit``) and ``demo`` (the demo job).
"""

from .saver import (
    LIGHTNING_KEYS,
    NEVER_REPLICATED,
    NOT_APPLICABLE,
    InvalidArgumentError,
    MonitorNotFoundError,
    Restored,
    SnapshotCheckpointIO,
    TorchSnapshotSaver,
    snapshot_path,
)

__all__ = [
    "LIGHTNING_KEYS", "NEVER_REPLICATED", "NOT_APPLICABLE", "InvalidArgumentError", "MonitorNotFoundError",
    "Restored", "SnapshotCheckpointIO", "TorchSnapshotSaver", "snapshot_path",
]
