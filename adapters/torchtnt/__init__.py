"""The torchtnt adapter: a drop-in replacement for torchtnt's ``TorchSnapshotSaver``.

Switch with one import line::

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    saver = TorchSnapshotSaver("/ckpts/run1", save_every_n_train_steps=100, save_every_n_epochs=1)
    train(unit, dataloader, max_epochs=10, callbacks=[saver])

    # later, in a new process
    TorchSnapshotSaver.restore_from_latest("/ckpts/run1", unit, train_dataloader=dataloader)

torchtnt's ``DistributedCheckpointSaver`` is replaced the same way (DCP's format)::

    from tnt_snapshot_plugin.adapters.torchtnt import DistributedCheckpointSaver

The package: ``saver`` (the callback), ``dcp_saver`` (the DCP saver: the callback with DCP's
format fixed), ``restore`` (their static restores), ``titan`` (torchtitan's checkpoints restored
into a unit), ``state`` (what a unit contributes to a snapshot), ``options`` (torchtnt's
arguments mapped onto the core's configuration), ``fsdp`` (optimizer state of FSDP modules) and
``demo`` (the demo job).
"""

from .dcp_saver import DistributedCheckpointSaver
from .saver import EVAL_PROGRESS_KEY, TRAIN_PROGRESS_KEY, TorchSnapshotSaver

__all__ = ["EVAL_PROGRESS_KEY", "TRAIN_PROGRESS_KEY", "DistributedCheckpointSaver", "TorchSnapshotSaver"]
