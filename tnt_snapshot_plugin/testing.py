"""Fakes of the store interface, for tests: the plugin's own, and users' tests of code that saves
or restores with it. Nothing in the plugin imports this module; importing it changes nothing until
a fake is registered.

* :class:`MemoryStore`: a snapshot directory held in this process's memory, with the full
  :class:`~tnt_snapshot_plugin.stores.Store` behaviour (listing, begin/commit under either commit
  strategy, guarded removal, verify, a dirpath lock, ``write_payload`` / ``read_into``).
* :class:`FaultyStore`: wraps any store and fails chosen operations on demand
  (:meth:`FaultyStore.inject`): the Nth ``write_payload`` raises ``OSError(ENOSPC)``, ``commit``
  raises, ``read_into`` comes back short or with a flipped byte, ... It also runs a test's own
  code around chosen operations (:meth:`FaultyStore.hook`): hold the background write until the
  test releases it, count the writes in flight, remove dirpath after a payload is written, log
  what is on disk at each commit and deletion.

Reaching them from a dirpath string (so real savers and restores run on them): :func:`register`
puts a store in this process's registry under ``NAME`` and returns its dirpath ``fake://NAME``
(the first registration also registers the ``fake`` URL scheme with
:func:`~tnt_snapshot_plugin.stores.register_store`); ``open_store("fake://NAME")`` returns that
store (a fresh :class:`MemoryStore` for a NAME not registered), and ``open_store("fake://NAME/sub")``
its child ``sub`` as a store (``nested``). For example::

    from tnt_snapshot_plugin.testing import FaultyStore, MemoryStore, register

    faulty = FaultyStore(MemoryStore())
    dirpath = register("run1", faulty)              # "fake://run1"
    faulty.inject("write_payload", OSError(errno.ENOSPC, "No space left on device"), nth=3)
    Snapshotter(dirpath, SnapshotConfig.build(...))  # writes through `faulty`

:func:`unregister` (or :func:`clear_registry`) forgets them. The registry is per process: ranks
started as separate processes each register their own. (``memory://`` URLs are fsspec's
in-memory filesystem, served by the fsspec store like any other fsspec URL.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from tnt_snapshot_plugin.errors import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
    SnapshotWriteError,
)
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.naming import is_staging_name
from tnt_snapshot_plugin.stores.base import WRITER_FNAME, Buffer, DirLock, Done, Read, Store
from tnt_snapshot_plugin.stores.commit import AtomicRename, CommitProtocol, MetadataBytes, MetadataWrittenLast
from tnt_snapshot_plugin.stores.fileio import byte_views
from tnt_snapshot_plugin.stores.ownership import busy_error, writer_of_token
from tnt_snapshot_plugin.stores.registry import register_store

#: The URL scheme of registered fakes.
SCHEME = "fake://"


class _Tree:
    """The shared contents of one memory store and its nested stores."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.files: dict[str, bytes] = {}  # "dir/.../rel" -> bytes
        self.dirs: dict[str, float] = {}  # directory path -> when it was created
        self.holders: dict[str, dict[str, Any]] = {}  # directory path -> its lock's holder


class _MemoryLock(DirLock):
    def __init__(self, tree: _Tree, path: str) -> None:
        self._tree, self._path = tree, path

    def release(self) -> None:
        with self._tree.lock:
            self._tree.holders.pop(self._path, None)


class MemoryStore(Store):
    """A snapshot directory in memory. ``atomic_rename``: commit by renaming a staging directory
    (as local disk, the default) or, False, by writing the metadata last (as object stores)."""

    def __init__(self, url: str = "fake://anonymous", *, atomic_rename: bool = True,
                 _tree: Optional[_Tree] = None, _path: str = "") -> None:
        self.url = url.rstrip("/")
        self.protocol: CommitProtocol = AtomicRename() if atomic_rename else MetadataWrittenLast()
        self._tree = _tree if _tree is not None else _Tree()
        self._path = _path  # this store's directory inside the tree ("" at the top)

    # -- paths ---------------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return f"{self._path}/{name}" if self._path else name

    def _file(self, name: str, rel: str) -> str:
        return f"{self._dir(name)}/{rel}"

    def _files_under(self, directory: str) -> list[str]:
        prefix = directory + "/"
        return [k for k in self._tree.files if k.startswith(prefix)]

    def _make_dirs(self, path: str) -> None:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            self._tree.dirs.setdefault("/".join(parts[:i]), time.time())

    # -- the Store interface -------------------------------------------------------------------

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def nested(self, name: str) -> Store:
        return MemoryStore(self.child(name), atomic_rename=self.atomic_rename, _tree=self._tree,
                           _path=self._dir(name))


    def list_names(self) -> list[str]:
        prefix = self._path + "/" if self._path else ""
        with self._tree.lock:
            return sorted(
                d[len(prefix):] for d in self._tree.dirs if d.startswith(prefix) and "/" not in d[len(prefix):]
            )

    def has_file(self, name: str, rel: str) -> bool:
        return self._file(name, rel) in self._tree.files

    def read_file(self, name: str, rel: str) -> bytes:
        try:
            return self._tree.files[self._file(name, rel)]
        except KeyError:
            raise SnapshotNotFoundError(f"{self.child(name)}/{rel}: no such file") from None

    def file_size(self, name: str, rel: str) -> Optional[int]:
        data = self._tree.files.get(self._file(name, rel))
        return None if data is None else len(data)

    def check_writable(self) -> None:
        with self._tree.lock:
            if self._path:
                self._make_dirs(self._path)

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        self._check_rel(name, rel, SnapshotWriteError)
        views = byte_views(data)
        if feed is not None:
            for view in views:
                feed(view)
        body = b"".join(views)
        with self._tree.lock:
            path = self._file(name, rel)
            self._make_dirs(path.rsplit("/", 1)[0])
            self._tree.files[path] = body

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        self._check_reads(name, reads)
        for index, (rel, offset, dest) in enumerate(reads):
            data = self._tree.files.get(self._file(name, rel))
            if data is None:
                raise SnapshotCorruptError(
                    f"{self.child(name)}/{rel}: a file the snapshot names is missing; the snapshot is damaged"
                )
            size = dest.nbytes
            if offset + size > len(data):
                raise SnapshotCorruptError(
                    f"{self.child(name)}/{rel} ends at byte {len(data)}, before the end of an entry it "
                    f"holds (bytes {offset}-{offset + size}): the file is truncated"
                )
            memoryview(dest)[:] = data[offset:offset + size]
            if done is not None:
                done([index])

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        with self._tree.lock:
            path = self._dir(staging)
            if self.atomic_rename and path in self._tree.dirs:
                raise FileExistsError(f"{self.child(staging)} exists")
            self._make_dirs(path)
        import json

        self.write_payload(staging, WRITER_FNAME, [json.dumps(writer).encode()])

    def publish(self, staging: str, final: str) -> None:
        with self._tree.lock:
            source, target = self._dir(staging), self._dir(final)
            if source not in self._tree.dirs:
                raise SnapshotWriteError(f"{self.child(staging)} is gone; the snapshot was not committed")
            if target in self._tree.dirs:
                if not self.holds_proof(final):
                    raise SnapshotWriteError(
                        f"{self.child(final)} exists and was not written by the plugin (no "
                        f"{INDEX_FNAME} or {WRITER_FNAME}); move it out of dirpath. The snapshot "
                        "was not committed"
                    )
                self._drop(target)
            for key in self._files_under(source):
                self._tree.files[target + key[len(source):]] = self._tree.files.pop(key)
            for d in [d for d in self._tree.dirs if d == source or d.startswith(source + "/")]:
                self._tree.dirs[target + d[len(source):]] = self._tree.dirs.pop(d)

    def _drop(self, directory: str) -> None:
        for key in self._files_under(directory):
            del self._tree.files[key]
        for d in [d for d in self._tree.dirs if d == directory or d.startswith(directory + "/")]:
            del self._tree.dirs[d]

    def bare_staging_writer(self, name: str) -> Optional[dict[str, Any]]:
        with self._tree.lock:
            path = self._dir(name)
            if path not in self._tree.dirs or not is_staging_name(name):
                return None
            if any(k != f"{path}/{WRITER_FNAME}" for k in self._files_under(path)):
                return None
            return writer_of_token(name.rsplit(".", 1)[1], self._tree.dirs[path])

    def lock(self, holder: dict[str, Any]) -> DirLock:
        with self._tree.lock:
            current = self._tree.holders.get(self._path)
            if current is not None and current.get("run_id") != holder.get("run_id"):
                raise busy_error(self.url, current)
            self._tree.holders[self._path] = dict(holder)
        return _MemoryLock(self._tree, self._path)

    def _delete(self, name: str, unpublish: tuple[str, ...]) -> None:
        with self._tree.lock:
            path = self._dir(name)
            # unpublished first, the proof that it is the plugin's last (as on disk and S3)
            for metadata in unpublish:
                self._tree.files.pop(f"{path}/{metadata}", None)
            self._drop(path)


# --------------------------------------------------------------------------------------------
# Faults on demand.


@dataclass
class Fault:
    """One injected fault (see :meth:`FaultyStore.inject`); ``fired`` counts the calls it failed."""

    op: str
    error: Optional[BaseException] = None
    nth: int = 1
    times: Optional[int] = 1
    match: Optional[Callable[..., bool]] = None
    short_by: int = 0
    flip: bool = False
    seen: int = 0
    fired: int = 0

    def applies(self, args: tuple[Any, ...]) -> bool:
        """Count a call of ``op`` with ``args``; whether this fault fails it."""
        if self.match is not None and not self.match(*args):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


_OPS = frozenset(
    {
        "list_names", "has_file", "read_file", "file_size", "check_writable", "write_payload",
        "read_into", "begin", "commit", "publish", "lock", "remove", "verify",
    }
)


@dataclass
class Hook:
    """Code run around every call of ``op`` that ``match(*args)`` accepts (see
    :meth:`FaultyStore.hook`); ``seen`` counts those calls."""

    op: str
    before: Optional[Callable[..., Any]] = None
    after: Optional[Callable[..., Any]] = None
    match: Optional[Callable[..., bool]] = None
    seen: int = 0


@dataclass
class _Faults:
    lock: threading.Lock = field(default_factory=threading.Lock)
    rules: list[Fault] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)


class FaultyStore(Store):
    """A store that behaves as ``inner`` except where a fault is injected.

    ``calls`` logs every operation, ``(op, args)`` (payload data left out). Nested stores share
    the faults and the log. Commit runs the inner store's commit strategy through this wrapper, so
    the index and metadata writes of a commit are ``write_payload`` calls that faults see too.
    """

    def __init__(self, inner: Store, *, _faults: Optional[_Faults] = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.protocol = inner.protocol
        self._faults = _faults if _faults is not None else _Faults()

    @property
    def calls(self) -> list[tuple[str, tuple[Any, ...]]]:
        return self._faults.calls

    def inject(
        self,
        op: str,
        error: Optional[BaseException] = None,
        *,
        nth: int = 1,
        times: Optional[int] = 1,
        match: Optional[Callable[..., bool]] = None,
        short_by: int = 0,
        flip: bool = False,
    ) -> Fault:
        """Fail operation ``op`` (a Store method name) from its ``nth`` call on (counted from now,
        among the calls ``match(*args)`` accepts), ``times`` calls in all (None: every one).

        The failure: ``error`` raised before the operation runs; or, for ``read_into`` only and
        without ``error``, the read "succeeds" but the last ``short_by`` bytes of every
        destination are left as zeros (a short read nobody noticed), and/or (``flip``) the first
        byte of every destination is inverted (silent corruption).
        """
        if op not in _OPS:
            raise ValueError(f"unknown store operation {op!r}; expected one of {sorted(_OPS)}")
        if error is None and op != "read_into":
            raise ValueError(f"inject({op!r}) needs an error to raise")
        if error is None and not short_by and not flip:
            raise ValueError("inject('read_into') needs an error, short_by or flip")
        fault = Fault(op, error, nth, times, match, short_by, flip)
        with self._faults.lock:
            self._faults.rules.append(fault)
        return fault

    def hook(
        self,
        op: str,
        *,
        before: Optional[Callable[..., Any]] = None,
        after: Optional[Callable[..., Any]] = None,
        match: Optional[Callable[..., bool]] = None,
    ) -> Hook:
        """Run ``before(*args)`` before, and ``after(*args)`` after, every call of operation ``op``
        that ``match(*args)`` accepts (all calls without ``match``). ``args`` are the call's
        arguments as :attr:`calls` logs them (payload data left out).

        ``before`` runs on the calling thread (the background writer's, for ``write_payload``)
        before any injected fault is checked: it may block (e.g. on a ``threading.Event`` the test
        sets) or raise, which fails the call as a fault would. ``after`` runs once the operation
        has finished, whether it returned or raised (its own exception, if any, replaces the
        operation's outcome). Removed by :meth:`clear`.
        """
        if op not in _OPS:
            raise ValueError(f"unknown store operation {op!r}; expected one of {sorted(_OPS)}")
        if before is None and after is None:
            raise ValueError(f"hook({op!r}) needs before or after")
        hook = Hook(op, before, after, match)
        with self._faults.lock:
            self._faults.hooks.append(hook)
        return hook

    def clear(self) -> None:
        """Remove every injected fault and hook (the log stays)."""
        with self._faults.lock:
            self._faults.rules.clear()
            self._faults.hooks.clear()

    def _call(self, op: str, args: tuple[Any, ...], run: Callable[[Optional[Fault]], Any]) -> Any:
        """Log one operation, run its ``before`` hooks, raise its fault's error or ``run(fault)``
        (a read_into fault is applied by ``run``), then its ``after`` hooks."""
        with self._faults.lock:
            self._faults.calls.append((op, args))
            hooks = [h for h in self._faults.hooks if h.op == op and (h.match is None or h.match(*args))]
            for h in hooks:
                h.seen += 1
        try:
            for h in hooks:
                if h.before is not None:
                    h.before(*args)
            with self._faults.lock:
                hit = next((f for f in self._faults.rules if f.op == op and f.applies(args)), None)
            if hit is not None and hit.error is not None:
                raise hit.error
            return run(hit)
        finally:
            for h in hooks:
                if h.after is not None:
                    h.after(*args)

    # -- delegation ----------------------------------------------------------------------------

    def child(self, name: str) -> str:
        return self.inner.child(name)

    def nested(self, name: str) -> Store:
        return FaultyStore(self.inner.nested(name), _faults=self._faults)


    def list_names(self) -> list[str]:
        return self._call("list_names", (), lambda _f: self.inner.list_names())

    def has_file(self, name: str, rel: str) -> bool:
        return self._call("has_file", (name, rel), lambda _f: self.inner.has_file(name, rel))

    def read_file(self, name: str, rel: str) -> bytes:
        return self._call("read_file", (name, rel), lambda _f: self.inner.read_file(name, rel))

    def file_size(self, name: str, rel: str) -> Optional[int]:
        return self._call("file_size", (name, rel), lambda _f: self.inner.file_size(name, rel))

    def check_writable(self) -> None:
        self._call("check_writable", (), lambda _f: self.inner.check_writable())

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        self._call("write_payload", (name, rel), lambda _f: self.inner.write_payload(name, rel, data, feed))

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        def run(fault: Optional[Fault]) -> None:
            self.inner.read_into(name, reads, concurrency=concurrency)
            if fault is not None:
                for _rel, _offset, dest in reads:
                    if fault.short_by and dest.nbytes:
                        cut = max(0, dest.nbytes - fault.short_by)
                        memoryview(dest)[cut:] = bytes(dest.nbytes - cut)
                    if fault.flip and dest.nbytes:
                        dest[0] ^= 0xFF
            if done is not None:  # the bytes as the fault left them
                done(list(range(len(reads))))

        self._call("read_into", (name, [(rel, offset, dest.nbytes) for rel, offset, dest in reads]), run)

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        self._call("begin", (staging,), lambda _f: self.inner.begin(staging, writer))

    def commit(
        self, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes, index_file: str,
        index: bytes, written: dict[str, int],
    ) -> None:
        self._call(
            "commit", (staging, final),
            lambda _f: self.protocol.commit(
                self, staging, final, metadata_file=metadata_file, metadata=metadata, index_file=index_file,
                index=index, written=written,
            ),
        )

    def publish(self, staging: str, final: str) -> None:
        self._call("publish", (staging, final), lambda _f: self.inner.publish(staging, final))

    def bare_staging_writer(self, name: str) -> Optional[dict[str, Any]]:
        return self.inner.bare_staging_writer(name)

    def lock(self, holder: dict[str, Any]) -> DirLock:
        return self._call("lock", (), lambda _f: self.inner.lock(holder))

    def delete(self, name: str, *, unpublish: Sequence[str] = ()) -> None:
        self._call("remove", (name,), lambda _f: self.inner.delete(name, unpublish=unpublish))

    def holds_proof(self, name: str) -> bool:
        return self.inner.holds_proof(name)


# --------------------------------------------------------------------------------------------
# The registry behind fake:// dirpaths.

_registry: dict[str, Store] = {}
_registry_lock = threading.Lock()


def register(name: str, store: Store, *, replace: bool = False) -> str:
    """Make ``store`` the store of dirpath ``fake://NAME``; return that dirpath. Another store
    already registered under ``name`` is an error unless ``replace``. A memory store (also one
    wrapped by a FaultyStore) takes that dirpath as its ``url``."""
    register_store(SCHEME[:-3], OPENER)
    if not name or "/" in name:
        raise ConfigError(f"a memory store name is one non-empty path component, got {name!r}")
    with _registry_lock:
        current = _registry.get(name)
        if current is not None and current is not store and not replace:
            raise ConfigError(
                f"{SCHEME}{name} is already registered to another store; unregister it first or "
                "pass replace=True"
            )
        _registry[name] = store
    target: Any = store
    while target is not None:
        if target.url.startswith(SCHEME):
            target.url = SCHEME + name
        target = getattr(target, "inner", None)
    return SCHEME + name


def unregister(name: str) -> None:
    """Forget ``fake://NAME`` (its contents go with it, unless a caller keeps the store)."""
    with _registry_lock:
        _registry.pop(name, None)


def clear_registry() -> None:
    with _registry_lock:
        _registry.clear()


def memory_store(name: str) -> Store:
    """The store registered as ``fake://NAME``; a new :class:`MemoryStore` if there is none."""
    with _registry_lock:
        store = _registry.get(name)
        if store is None:
            if not name or "/" in name:
                raise ConfigError(f"a memory store name is one non-empty path component, got {name!r}")
            store = _registry[name] = MemoryStore(SCHEME + name)
        return store


#: The ``fake`` scheme's opener, as registered with ``register_store``.
OPENER = "tnt_snapshot_plugin.testing:open_fake"


def open_fake(
    dirpath: str, storage_options: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None
) -> Store:
    """The store of a ``fake://NAME[/child...]`` dirpath (see the module docstring)."""
    if storage_options:
        raise ConfigError(
            f"storage_options {sorted(storage_options)} was given for the fake dirpath {dirpath!r}, "
            "where it has no effect"
        )
    rest = dirpath[len(SCHEME):].strip("/")
    name, *children = rest.split("/") if rest else [""]
    if not name:
        raise ConfigError(f"dirpath {dirpath!r} names no fake store; expected {SCHEME}NAME")
    store = memory_store(name)
    for child in children:
        if child in ("", ".", ".."):
            raise ConfigError(f"dirpath {dirpath!r}: {child!r} is not a directory name")
        store = store.nested(child)
    return store


__all__ = [
    "Fault",
    "FaultyStore",
    "Hook",
    "MemoryStore",
    "clear_registry",
    "memory_store",
    "open_fake",
    "register",
    "unregister",
]
