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
   (``_load_stateful`` deep-copies the whole manifest and reads every entry in it, and
   ``inflate`` then keeps only the key's own entries): restoring a unit's model, progress and
   RNG state read the model three times. The plugin's ``Snapshot`` shows ``_load_stateful`` only
   the entries ``inflate`` keeps.

6. Its metadata (``.snapshot_metadata``, one entry per saved value) is converted with
   ``dataclasses.asdict`` and indented JSON (pure-Python encoder) when written, and parsed with a
   YAML parser when read: 1.2 s and 5 s for a state of 10,000 tensors on the project's machine.
   The plugin writes the same JSON without indentation, with the C encoder walking the
   dataclasses' fields (no ``asdict`` deep copy), and reads
   JSON with ``json``; any other text (YAML from older versions) still goes to torchsnapshot's
   parser, and torchsnapshot itself reads what the plugin writes.

7. Restoring the plugin's ``RNGState`` last took a second ``Snapshot.restore`` (a second event
   loop, storage plugin and metadata pass: 30-60 ms). The plugin's ``Snapshot`` restores it last
   within the one call, as torchsnapshot does with its own ``RNGState``.

8. Restore spends about 0.25 ms of bookkeeping per entry (asyncio task, executor job,
   intermediate buffer), seconds for 10,000 small tensors, and deep-copies the whole manifest
   for every restored key. Raw CPU tensors are read straight into the stateful's tensors
   (``direct_read.py``: ``preadv`` from local files, a few large ranged GETs from S3); every
   other entry goes through torchsnapshot's reader,
   and the manifest is filtered without copying when no sharded tensor needs the copy.

9. ``take`` raised on a bfloat16 tensor of an odd number of elements (its bytes were viewed as
   float32, dropping the last two) and on an empty tensor of two or more dimensions. Its
   ``tensor_as_memoryview`` is replaced by one that views any contiguous CPU tensor as bytes; the
   bytes written are those torchsnapshot writes wherever it did not raise.

10. Small tensors are packed into shared files ("slabs"): torchsnapshot stages each one with an
    asyncio task and copies it into a new slab buffer (a second copy of the state, and most of a
    take's time for 10,000 tensors). In the plugin's own writes (``storage.recording`` active on
    the thread) a slab of plain CPU tensors is handed to the storage plugin as a ``Gathered``
    list of the tensors' own bytes, written with ``writev``. Files and manifest are unchanged.

11. A take or restore allocates several container objects per entry, so Python's cyclic garbage
    collector runs about 170 times during a take of 10,000 tensors, each time walking every live
    object: 0.15-0.3 s of a 0.5 s take on the project's machine. The plugin pauses the collector
    while its restores and its synchronous takes run (``gc_paused``): while training waits. An
    asynchronous take, which training runs alongside, leaves it alone.

12. Its I/O concurrency knob is an environment variable (``override_max_per_rank_io_concurrency``
    sets it for the whole process). The scheduler asks ``storage.current_io_concurrency()`` first,
    a limit set per thread (``storage.io_concurrency``) for one take or restore.

13. Its restore calls each stateful's ``state_dict()`` and ``load_state_dict()`` inside the read,
    so an exception from the user's own code looked like a read failure. The plugin's
    ``Snapshot`` raises :class:`StatefulError` (the key, the method, the original exception as
    ``__cause__``) for those, and restoring.py tells the user's errors from damaged files.

14. Its object entries are read with a bare ``torch.load`` (``weights_only=True`` by torch 2.13's
    default, with no way to pass the load settings): numpy arrays, ``datetime`` or an
    ``argparse.Namespace`` then never load. The plugin's ``Snapshot`` reads them through
    ``loading.load_object`` with the restore's ``weights_only`` and the plugin's safe globals.

15. ``take`` raised ``ZeroDivisionError`` on a DTensor whose local shard is empty (FSDP2 gives
    rank 1 of 2 nothing of a one-element bias): ``subdivide_shard`` divides by the shard's length.
    An empty shard is written as one empty chunk (as no chunk at all, torchsnapshot's
    partitioner, which takes a 2-d DTensor sharded on one dimension for a replicated one, drops
    the rank's entry). Tested in tests/test_fsdp.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import random
import threading
from typing import Any, Iterator, Optional

import torch
import torchsnapshot
import torchsnapshot.snapshot as _snapshot_module
from torchsnapshot.flatten import _encode

from .errors import SnapshotError

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


def _install_scoped_io_concurrency() -> None:
    """torchsnapshot's scheduler reads its I/O concurrency from an environment variable (one
    value for the whole process); it asks the plugin's per-thread limit first (item 12)."""
    import torchsnapshot.scheduler as scheduler

    from .storage import current_io_concurrency

    original = scheduler.get_max_per_rank_io_concurrency
    if getattr(original, "_tnt_scoped", False):
        return

    def get_max_per_rank_io_concurrency() -> int:
        limit = current_io_concurrency()
        return limit if limit is not None else original()

    get_max_per_rank_io_concurrency._tnt_scoped = True  # type: ignore[attr-defined]
    scheduler.get_max_per_rank_io_concurrency = get_max_per_rank_io_concurrency


_install_scoped_io_concurrency()


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (item 11) while training waits for the plugin.

    Process-wide, as the collector is (memory freed by reference counting, nearly all of it, is
    freed as usual meanwhile). Re-enabled when the last pauser leaves, if it was enabled.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as a flat unsigned-byte memoryview over its memory (over a
    contiguous copy if it is not contiguous)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    array: Any
    if tensor.dtype is not torch.bfloat16 and tensor.dim() and tensor.numel():
        array = tensor.numpy()  # the faster way, where numpy has the dtype and the shape casts
        return memoryview(array).cast("B")
    array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def _install_tensor_bytes_fix() -> None:
    import torchsnapshot.io_preparers.tensor as tensor_module
    import torchsnapshot.serialization as serialization

    original = serialization.tensor_as_memoryview
    if getattr(original, "_tnt_fixed", False):
        return

    def tensor_as_memoryview(tensor: torch.Tensor) -> memoryview:
        if (
            tensor.dtype not in serialization.BUFFER_PROTOCOL_SUPPORTED_DTYPES
            or tensor.device.type != "cpu"
        ):
            return original(tensor)  # torchsnapshot's own error
        return byte_view(tensor).cast("b")

    tensor_as_memoryview._tnt_fixed = True  # type: ignore[attr-defined]
    serialization.tensor_as_memoryview = tensor_as_memoryview
    tensor_module.tensor_as_memoryview = tensor_as_memoryview  # imported there by name


_install_tensor_bytes_fix()


def _install_gathered_slabs() -> None:
    from torchsnapshot.batcher import BatchedBufferStager
    from torchsnapshot.io_preparers.tensor import TensorBufferStager
    from torchsnapshot.uvm_tensor import is_uvm_tensor

    from .storage import Gathered, _current_recorder

    original = BatchedBufferStager.stage_buffer
    if getattr(original, "_tnt_gathered", False):
        return

    async def stage_buffer(self: Any, executor: Any = None) -> Any:
        if _current_recorder() is None:  # not one of the plugin's writes: torchsnapshot's way
            return await original(self, executor)
        views = []
        end = 0
        for (lower, upper), stager in self.byte_range_to_buffer_stager.items():
            if (
                type(stager) is not TensorBufferStager
                or stager._tensor_prepare_func is not None
                or stager.is_async_snapshot  # async_take wants copies: the plugin never asks it
                or stager.entry.serializer != "buffer_protocol"
                or stager.tensor.device.type != "cpu"
                or is_uvm_tensor(stager.tensor)
                or lower != end
            ):
                return await original(self, executor)
            view = byte_view(stager.tensor)
            if view.nbytes != upper - lower:
                raise AssertionError(
                    f"a packed tensor has {view.nbytes} bytes, its byte range {lower}-{upper} says "
                    f"{upper - lower}"
                )
            views.append(view)
            end = upper
        return Gathered(views)

    stage_buffer._tnt_gathered = True  # type: ignore[attr-defined]
    BatchedBufferStager.stage_buffer = stage_buffer  # type: ignore[method-assign]


_install_gathered_slabs()


def _install_empty_shard_fix() -> None:
    from torchsnapshot.io_preparers.sharded_tensor import ShardedTensorIOPreparer

    original = ShardedTensorIOPreparer.subdivide_shard
    if getattr(original, "_tnt_fixed", False):
        return

    def subdivide_shard(shard: torch.Tensor, offsets: Any, sizes: Any, dim: int, max_shard_sz_bytes: int) -> Any:
        if 0 in list(sizes):
            return [(shard, list(offsets), list(sizes))]  # one empty chunk (item 12)
        return original(shard, offsets, sizes, dim, max_shard_sz_bytes)

    subdivide_shard._tnt_fixed = True  # type: ignore[attr-defined]
    ShardedTensorIOPreparer.subdivide_shard = staticmethod(subdivide_shard)  # type: ignore[method-assign]


_install_empty_shard_fix()


class Snapshot(torchsnapshot.Snapshot):
    """torchsnapshot's ``Snapshot``, with its restore reading only the entries it loads (item 5)
    and its metadata written and read as plain JSON (item 6).

    A subclass, not a patch: torchsnapshot used directly elsewhere in the process is unchanged.

    Object entries are loaded by :func:`loading.load_object` with this instance's
    ``weights_only`` (default True: torch's restricted unpickler, with the plugin's safe globals).
    """

    #: How object entries are unpickled (loading.py); set by restoring.restore.
    weights_only: bool = True
    #: A list: failures to read an entry's bytes (a damaged or truncated file) are appended here
    #: as ``(key, exception)`` and the restore goes on, so every rank makes the same collective
    #: calls and the ranks can agree afterwards (restoring.restore); None: raised at once.
    read_errors: Optional[list[tuple[str, BaseException]]] = None

    @staticmethod
    def _write_snapshot_metadata(  # type: ignore[override]
        snapshot_metadata: Any, storage: Any, event_loop: Any
    ) -> None:
        from torchsnapshot.io_types import WriteIO

        text = json.dumps(snapshot_metadata, default=_fields)
        storage.sync_write(
            write_io=WriteIO(path=_snapshot_module.SNAPSHOT_METADATA_FNAME, buf=text.encode("utf-8")),
            event_loop=event_loop,
        )

    @staticmethod
    def _read_snapshot_metadata(storage: Any, event_loop: Any) -> Any:  # type: ignore[override]
        from torchsnapshot.io_types import ReadIO
        from torchsnapshot.manifest import SnapshotMetadata

        read_io = ReadIO(path=_snapshot_module.SNAPSHOT_METADATA_FNAME)
        try:
            storage.sync_read(read_io=read_io, event_loop=event_loop)
        except SnapshotError:
            raise  # the storage is unreachable (StorageUnavailableError): not an incomplete snapshot
        except Exception as exc:
            raise RuntimeError(
                f"Failed to read {_snapshot_module.SNAPSHOT_METADATA_FNAME}: the snapshot is "
                "incomplete or the path is wrong"
            ) from exc
        text = read_io.buf.getvalue().decode("utf-8")
        metadata = _metadata_from_json(text)
        return metadata if metadata is not None else SnapshotMetadata.from_yaml(text)

    @staticmethod
    def _pop_rng_state(app_state: dict[str, Any]) -> Any:  # type: ignore[override]
        # The plugin's RNGState is restored last, as torchsnapshot does with its own (item 7).
        from .app_state import RNGState

        ours = [key for key, value in app_state.items() if isinstance(value, RNGState)]
        if len(ours) > 1:
            raise RuntimeError(f"Multiple RNGState objects in app state: {ours}")
        if ours:
            return ours[0], app_state.pop(ours[0])
        return torchsnapshot.Snapshot._pop_rng_state(app_state)

    def _load_stateful(  # type: ignore[override]
        self,
        stateful_key: str,
        stateful: Any,
        strict: bool,
        storage: Any,
        pg: Any,
        event_loop: Any,
    ) -> None:
        if stateful is None:
            return
        if self.read_errors is None:
            self._load_stateful_now(stateful_key, stateful, strict, storage, pg, event_loop)
            return
        try:
            self._load_stateful_now(stateful_key, stateful, strict, storage, pg, event_loop)
        except StatefulError:
            raise  # the entry's own code: not the snapshot's bytes
        except Exception as exc:  # past this key's collective: later keys are still read
            self.read_errors.append((stateful_key, exc))

    def _load_stateful_now(
        self, stateful_key: str, stateful: Any, strict: bool, storage: Any, pg: Any, event_loop: Any
    ) -> None:
        if not type(stateful).__module__.startswith("tnt_snapshot_plugin.") or hasattr(
            stateful, "__wrapped__"
        ):  # the user's code, or the plugin's wrapper around it (item 13)
            stateful = _Guarded(stateful_key, stateful, strict)
        manifest = manifest_for_rank(self.metadata, pg.get_rank(), key=stateful_key)
        if manifest is None:  # sharded tensors or a new rank: torchsnapshot's own handling
            self._load_stateful_own_entries(stateful_key, stateful, strict, storage, pg, event_loop)
            return
        state_dict = self._read_state_dict(
            stateful_key, stateful, manifest, storage, pg, event_loop, self.weights_only
        )
        if isinstance(stateful, torch.nn.Module):
            stateful.load_state_dict(state_dict, strict=strict)
        else:
            stateful.load_state_dict(state_dict)

    @staticmethod
    def _read_state_dict(
        stateful_key: str,
        stateful: Any,
        manifest: dict[str, Any],
        storage: Any,
        pg: Any,
        event_loop: Any,
        weights_only: bool = True,
    ) -> Any:
        """What torchsnapshot's ``_get_state_dict_for_manifest`` builds, with the tensors that
        can be read straight from a local file read so (item 8) and the rest by torchsnapshot."""
        from torchsnapshot.batcher import batch_read_requests
        from torchsnapshot.flatten import flatten, inflate
        from torchsnapshot.io_preparer import prepare_read
        from torchsnapshot.knobs import is_batching_disabled
        from torchsnapshot.manifest import ObjectEntry
        from torchsnapshot.manifest_utils import is_container_entry
        from torchsnapshot.scheduler import get_process_memory_budget_bytes, sync_execute_read_reqs

        from .direct_read import direct_target, fetch_into, read_into

        # As torchsnapshot does: load into the tensors the stateful already holds, where it can.
        _, flattened = flatten(stateful.state_dict(), prefix=stateful_key)
        root = getattr(storage, "direct_read_root", None)  # local files
        fetch = getattr(storage, "direct_fetch", None)  # an object store
        can_read = root is not None or fetch is not None
        containers: dict[str, Any] = {}
        values: dict[str, Any] = {}
        direct = []
        read_reqs: list[Any] = []
        futures: dict[str, Any] = {}
        for path, entry in manifest.items():
            if is_container_entry(entry):
                containers[path] = entry
                continue
            target = flattened.get(path)
            if not isinstance(target, torch.Tensor):
                target = None
            found = direct_target(entry, target) if can_read and target is not None else None
            if found is not None:
                direct.append((*found, path))
                values[path] = target
                continue
            if isinstance(entry, ObjectEntry):
                reqs, future = _prepare_object_read(entry, weights_only)
            else:
                reqs, future = prepare_read(entry=entry, obj_out=target)
            read_reqs += reqs
            futures[path] = future
        read_error: Optional[BaseException] = None
        if direct:
            verifier = storage.checksum_verifier() if hasattr(storage, "checksum_verifier") else None
            try:
                if root is not None:
                    read_into(root, direct, verifier)
                elif fetch is not None:
                    fetch_into(fetch, direct, verifier)
            except Exception as exc:  # raised after the collective below, which every rank makes
                read_error = exc
        # torchsnapshot asks for the memory budget (a collective) once per stateful: so do we,
        # whatever this rank reads, so every rank makes the same collective calls.
        budget = get_process_memory_budget_bytes(pg=pg)
        if read_error is not None:
            raise read_error
        if read_reqs:
            if not is_batching_disabled():
                read_reqs = batch_read_requests(read_reqs=read_reqs)
            sync_execute_read_reqs(
                read_reqs=read_reqs,
                storage=storage,
                memory_budget_bytes=budget,
                rank=pg.get_rank(),
                event_loop=event_loop,
            )
        values.update((path, future.obj) for path, future in futures.items())
        return inflate(manifest=containers, flattened=values, prefix=stateful_key)

    def _load_stateful_own_entries(self, stateful_key: str, *args: Any) -> None:
        """torchsnapshot's ``_load_stateful``, shown only ``stateful_key``'s entries (item 5)."""
        from torchsnapshot.manifest import SnapshotMetadata

        full = self.metadata
        # Metadata paths are "RANK/KEY/...": keep every rank's entries of this key, the ones
        # torchsnapshot's inflate() would keep (it compares the encoded key the same way).
        prefix = _encode(stateful_key)
        own = {
            path: entry
            for path, entry in full.manifest.items()
            if path.split("/", 2)[1:2] == [prefix]
        }
        self._metadata = SnapshotMetadata(
            version=full.version, world_size=full.world_size, manifest=own
        )
        try:
            super()._load_stateful(stateful_key, *args)
        finally:
            self._metadata = full


class StatefulError(Exception):
    """A stateful's own ``state_dict()`` or ``load_state_dict()`` raised during a restore (item 13).

    ``key``: its app-state key; ``method``: which of the two; ``__cause__``: what it raised.
    """

    def __init__(self, key: str, method: str, target: Any, exc: BaseException) -> None:
        super().__init__(f"{key}.{method}() raised {type(exc).__name__}: {exc}")
        self.key = key
        self.method = method
        while hasattr(target, "__wrapped__"):  # the plugin's wrappers: the object they wrap
            target = target.__wrapped__
        self.target = target
        self.original = exc


class _Guarded:
    """A stateful as torchsnapshot's restore sees it: exceptions from its own methods come out
    as :class:`StatefulError`, told apart from those of reading the snapshot."""

    def __init__(self, key: str, stateful: Any, strict: bool) -> None:
        self._key = key
        self._stateful = stateful
        self._strict = strict

    def state_dict(self) -> Any:
        try:
            return self._stateful.state_dict()
        except Exception as exc:
            raise StatefulError(self._key, "state_dict", self._stateful, exc) from exc

    def load_state_dict(self, state_dict: Any) -> None:
        target = self._stateful
        try:
            if isinstance(target, torch.nn.Module):
                target.load_state_dict(state_dict, strict=self._strict)
            else:
                target.load_state_dict(state_dict)
        except Exception as exc:
            raise StatefulError(self._key, "load_state_dict", target, exc) from exc


def _prepare_object_read(entry: Any, weights_only: bool) -> tuple[list[Any], Any]:
    """torchsnapshot's read of an object entry, unpickled by ``loading.load_object`` with the
    restore's ``weights_only`` instead of a bare ``torch.load``."""
    import sys

    from torchsnapshot.io_types import BufferConsumer, Future, ReadReq

    from .loading import load_object

    class _ObjectConsumer(BufferConsumer):
        def __init__(self, fut: Any) -> None:
            self.fut = fut

        async def consume_buffer(self, buf: bytes, executor: Any = None) -> None:
            self.fut.obj = load_object(buf, weights_only=weights_only)

        def get_consuming_cost_bytes(self) -> int:
            return sys.getsizeof(self.fut.obj)

    fut: Any = Future(obj=None)
    return [ReadReq(path=entry.location, buffer_consumer=_ObjectConsumer(fut))], fut


def manifest_for_rank(metadata: Any, rank: int, key: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The entries ``rank`` restores (of ``key`` only, if given), by logical path; None where
    torchsnapshot's own ``get_manifest_for_rank`` is needed (sharded tensors, DTensors, a rank
    the snapshot did not have).

    torchsnapshot's version deep-copies the whole manifest on every call, for the sake of the
    sharded cases (0.25 s for 10,000 entries, once per restored key); the entries are only read
    here, so the dictionary is new and the entries are shared (item 5).
    """
    from torchsnapshot.manifest import DTensorEntry, ShardedTensorEntry
    from torchsnapshot.manifest_utils import is_fully_replicated_entry

    if rank >= metadata.world_size:
        return None
    own_rank = str(rank)
    prefix = None if key is None else _encode(key)
    own: dict[str, Any] = {}
    replicated: dict[str, Any] = {}
    for path, entry in metadata.manifest.items():
        if isinstance(entry, (ShardedTensorEntry, DTensorEntry)):
            return None
        entry_rank, _, logical = path.partition("/")
        if prefix is not None and logical.split("/", 1)[0] != prefix:
            continue
        if entry_rank == own_rank:
            own[logical] = entry
        if entry_rank == "0" and is_fully_replicated_entry(entry):
            replicated[logical] = entry
    own.update(replicated)  # as torchsnapshot: rank 0's copy of a replicated entry is restored
    return own


def read_entries(snapshot: Any, entries: dict[str, Any]) -> dict[str, Any]:
    """The values of manifest ``entries`` (by full path, ``RANK/...``) of ``snapshot``, read on
    this rank alone (no collective), as torchsnapshot's ``read_object`` reads one; primitives
    come from the metadata."""
    import asyncio

    from torchsnapshot.io_preparer import prepare_read
    from torchsnapshot.manifest import PrimitiveEntry
    from torchsnapshot.scheduler import sync_execute_read_reqs
    from torchsnapshot.storage_plugin import url_to_storage_plugin_in_event_loop

    values: dict[str, Any] = {}
    futures: dict[str, Any] = {}
    read_reqs: list[Any] = []
    for path, entry in entries.items():
        if isinstance(entry, PrimitiveEntry):
            values[path] = entry.get_value()
            continue
        reqs, future = prepare_read(entry=entry, obj_out=None)
        read_reqs += reqs
        futures[path] = future
    if read_reqs:
        event_loop = asyncio.new_event_loop()
        try:
            storage = url_to_storage_plugin_in_event_loop(
                url_path=snapshot.path, event_loop=event_loop, storage_options=snapshot._storage_options
            )
            try:
                sync_execute_read_reqs(
                    read_reqs=read_reqs,
                    storage=storage,
                    memory_budget_bytes=512 * 1024 * 1024,
                    rank=0,
                    event_loop=event_loop,
                )
            finally:
                storage.sync_close(event_loop=event_loop)
        finally:
            event_loop.close()
    values.update((path, future.obj) for path, future in futures.items())
    return values


_DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(obj: Any) -> dict[str, Any]:
    """``json.dumps``'s ``default``: a dataclass of torchsnapshot's metadata as the dict of its
    fields, what ``dataclasses.asdict`` gives without its deep copies; the encoder (C) walks the
    lists and dicts inside."""
    cls = type(obj)
    names = _DATACLASS_FIELDS.get(cls)
    if names is None:
        if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
            raise TypeError(f"{cls.__name__} in snapshot metadata is not JSON serializable")
        names = _DATACLASS_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


def _metadata_from_json(text: str) -> Any:
    """torchsnapshot metadata from JSON text, or None if ``text`` is not JSON this understands.

    Every torchsnapshot-nightly writes its metadata as JSON (a subset of YAML) but reads it with
    a YAML parser, which takes seconds for ten thousand entries. The entries are built by the
    same ``from_yaml_obj`` constructors torchsnapshot uses.
    """
    from torchsnapshot import manifest as m

    try:
        doc = json.loads(text)
        entries = doc["manifest"]
    except (ValueError, TypeError, KeyError):
        return None  # YAML, from an older torchsnapshot: torchsnapshot's own parser reads it
    constructors: dict[str, Any] = {
        "list": m.ListEntry,
        "dict": m.DictEntry,
        "OrderedDict": m.OrderedDictEntry,
        "Tensor": m.TensorEntry,
        "ShardedTensor": m.ShardedTensorEntry,
        "ChunkedTensor": m.ChunkedTensorEntry,
        "DTensor": m.DTensorEntry,
        "object": m.ObjectEntry,
    }
    constructors.update((name, m.PrimitiveEntry) for name in m.PrimitiveEntry.supported_types)
    manifest = {}
    for path, obj in entries.items():
        entry_type = constructors.get(str(obj.get("type"))) if isinstance(obj, dict) else None
        if entry_type is None:
            return None
        manifest[path] = entry_type.from_yaml_obj(obj)
    doc["manifest"] = manifest
    return m.SnapshotMetadata(**doc)


__all__ = ["Snapshot", "StatefulError", "manifest_for_rank", "read_entries"]
