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

4. torchsnapshot resolves a protocol it does not know (``tntfs://``, ``tnts3://``) by listing the
   ``storage_plugins`` entry points of every installed distribution, on every take, restore and
   metadata read: 20-25 ms each on the project's machine (three times per restore), more the more
   packages are installed. The plugin's own two protocols are resolved directly to the same
   factories the entry points name; every other URL still goes through torchsnapshot's lookup.

5. ``Snapshot.restore`` reads every entry of the snapshot once for *each* key it restores
   (``_load_stateful`` hands the whole manifest to ``_get_state_dict_for_manifest``, which reads
   it all, and ``inflate`` then keeps only the key's own entries): restoring a unit's model,
   progress and RNG state read the model three times. The plugin's ``Snapshot`` gives it only the
   entries ``inflate`` keeps.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torchsnapshot
import torchsnapshot.snapshot as _snapshot_module
from torchsnapshot.flatten import _encode

_ids = random.Random()


def _event_id() -> int:
    return _ids.getrandbits(63)


_snapshot_module._generate_random_int64 = _event_id  # type: ignore[attr-defined]


def _install_direct_lookup() -> None:
    import torchsnapshot.storage_plugin as lookup_module

    from .storage import fs_storage_factory, s3_storage_factory

    original = lookup_module.url_to_storage_plugin
    if getattr(original, "_tnt_direct", False):
        return
    factories = {"tntfs": fs_storage_factory, "tnts3": s3_storage_factory}

    def url_to_storage_plugin(url_path: str, storage_options: Optional[dict[str, Any]] = None) -> Any:
        protocol, sep, path = url_path.partition("://")
        factory = factories.get(protocol) if sep else None
        if factory is None:
            return original(url_path, storage_options)
        return factory(path, storage_options)

    url_to_storage_plugin._tnt_direct = True  # type: ignore[attr-defined]
    lookup_module.url_to_storage_plugin = url_to_storage_plugin


_install_direct_lookup()


class Snapshot(torchsnapshot.Snapshot):
    """torchsnapshot's ``Snapshot`` with its restore reading only the entries it loads (item 5).

    A subclass, not a patch: torchsnapshot used directly elsewhere in the process is unchanged.
    """

    @staticmethod
    def _get_state_dict_for_manifest(  # type: ignore[override]
        stateful_key: str, manifest: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        prefix = _encode(stateful_key)  # the test torchsnapshot's inflate() keeps entries by
        own = {path: entry for path, entry in manifest.items() if path.split("/", 1)[0] == prefix}
        return torchsnapshot.Snapshot._get_state_dict_for_manifest(stateful_key, own, *args, **kwargs)


__all__ = ["Snapshot"]
