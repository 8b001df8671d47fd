"""Work-arounds for torchsnapshot-nightly 2024.7.26, applied when the plugin first uses it.

Import torchsnapshot's ``Snapshot`` from here, never directly, so the fixes below are in place.

1. torchsnapshot tags each take/restore/read_object with an id drawn from Python's *global*
   ``random`` module (``torchsnapshot.snapshot._generate_random_int64``). Every snapshot thus
   advances the training's Python RNG, and an asynchronous write does so from a background thread
   at an unpredictable moment: a run with snapshots would draw different numbers than one
   without, and no resume could be bitwise exact. The id only labels log events, so it is drawn
   from a private generator instead. Tested in tests/test_compat.py.

2. (storage.py) its S3 plugin ignores ``storage_options`` and its fs plugin never fsyncs: the
   plugin serves both through its own ``tnts3://`` / ``tntfs://`` storage plugins.

3. (snapshotter.py) ``Snapshot.async_take`` fails without a process group on hosts whose
   localhost is IPv4-only (meta-pytorch/torchsnapshot#178): the plugin never calls it; it stages
   its own copy and runs ``Snapshot.take`` on a background thread.
"""

from __future__ import annotations

import random

import torchsnapshot.snapshot as _snapshot_module
from torchsnapshot import Snapshot

_ids = random.Random()


def _event_id() -> int:
    return _ids.getrandbits(63)


_snapshot_module._generate_random_int64 = _event_id  # type: ignore[attr-defined]

__all__ = ["Snapshot"]
