"""Restoring snapshots: one chosen path, or the latest complete one in a directory.

Snapshots are trusted input, as a pickle is: torchsnapshot stores non-tensor objects with
``torch.save``. They are read back with ``torch.load(weights_only=True)`` and the plugin's safe
globals (``format.objects``), which run no code a snapshot carries; ``weights_only=False`` loads them with
full pickle, for snapshots you (or your own jobs) wrote.

* ``request.py``: :class:`RestoreRequest`, and one restore in phases (resolve, check, read,
  agree, load);
* ``latest.py``: which snapshot (latest, best), :func:`restore_from_latest` with its fallback;
* ``files.py``: whether a path names a complete snapshot;
* ``agreement.py``: how the ranks agree.

What a snapshot holds and how it is read is its format's (``format.base.Format.reader``).
"""

from __future__ import annotations

from tnt_snapshot_plugin.restoring.agreement import agree_on_read_errors
from tnt_snapshot_plugin.restoring.latest import best_snapshot, latest_snapshot, restore, restore_from_latest
from tnt_snapshot_plugin.restoring.request import RestoreRequest

__all__ = [
    "RestoreRequest", "agree_on_read_errors", "best_snapshot", "latest_snapshot",
    "restore", "restore_from_latest",
]
