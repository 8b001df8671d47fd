"""Snapshot directories on any filesystem fsspec serves: :class:`FsspecStore`, the store of every
URL scheme no other store claims (``gs://`` with gcsfs, ``az://`` with adlfs, ``memory://``,
``s3a://`` with s3fs, ...).

fsspec gives no atomic rename across its filesystems, so a snapshot is written under its final
name and published by ``.snapshot_metadata`` written last (:class:`~.base.MetadataWrittenLast`),
as on S3. fsspec is imported only when such a URL is opened; a missing fsspec, or a missing
implementation of the scheme (gcsfs, adlfs), is a ConfigError saying what to install.
``storage_options`` go to the filesystem's constructor as they are (e.g. s3fs's
``endpoint_url``, ``key``, ``secret``); the filesystem's own timeouts and retries apply.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

from tnt_snapshot_plugin.errors import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotWriteError,
    StorageUnavailableError,
)
from tnt_snapshot_plugin.stores.base import (
    LEASE_FNAME,
    PROOF_FNAMES,
    WRITER_FNAME,
    Buffer,
    DirLock,
    Done,
    Read,
    Store,
)
from tnt_snapshot_plugin.stores.commit import MetadataWrittenLast
from tnt_snapshot_plugin.stores.fileio import byte_views
from tnt_snapshot_plugin.stores.ownership import (
    LEASE_S,
    busy_error,
    lease_held_by_another,
    staging_token,
    writer_gone,
    writer_of_token,
)
from tnt_snapshot_plugin.stores.ranged_reads import read_ranges

#: What to install for URL schemes the built-in stores do not serve.
FSSPEC_HINT = "pip install 'tnt-snapshot-plugin[fsspec]'"


#: The extra to install for schemes whose fsspec implementation is a separate package.
EXTRA_OF_SCHEME = {"gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}

#: The name of the file ``check_writable`` writes and removes, followed by a staging token.
PROBE_PREFIX = ".tnt_write_probe."


def _import_fsspec(url: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise ConfigError(
            f"dirpath {url!r} is served through fsspec, which is not installed: {FSSPEC_HINT}"
        ) from None
    return fsspec


def fsspec_opener(scheme: str, url: str) -> Callable[..., Store]:
    """The opener of a scheme no store is registered for: :func:`open_fsspec` if fsspec knows the
    scheme; else a ConfigError naming the scheme and what to install."""
    unsupported = (
        f"dirpath {url!r} uses storage protocol {scheme!r}, which tnt_snapshot_plugin does not "
        "support; use a local path, file:// or s3://, or install a store for it: any fsspec "
        f"protocol through {FSSPEC_HINT} and the protocol's fsspec package (gcsfs for gs://, "
        "adlfs for az://), or a package declaring one in the entry-point group "
        "tnt_snapshot_plugin.stores"
    )
    try:
        import fsspec
    except ImportError:
        raise ConfigError(unsupported) from None
    if scheme not in fsspec.available_protocols():
        raise ConfigError(unsupported)
    return open_fsspec


def open_fsspec(
    url: str, storage_options: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None
) -> FsspecStore:
    """The store of an fsspec URL (``timeout_s`` is left to the filesystem's own settings)."""
    return FsspecStore(url, storage_options)


def _filesystem(url: str, storage_options: Optional[dict[str, Any]]) -> tuple[Any, str]:
    """(the fsspec filesystem of ``url``, the path of ``url`` on it)."""
    fsspec = _import_fsspec(url)
    scheme = url.partition("://")[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        extra = EXTRA_OF_SCHEME.get(scheme)
        hint = f"pip install 'tnt-snapshot-plugin[{extra}]'" if extra else "install it"
        raise ConfigError(
            f"dirpath {url!r}: fsspec's implementation of {scheme}:// is not installed ({exc}); {hint}"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"dirpath {url!r}: fsspec cannot open it with storage_options "
            f"{sorted(storage_options or {})} ({type(exc).__name__}: {exc}); pass the options "
            f"the {scheme}:// filesystem takes"
        ) from exc
    return fs, path.rstrip("/")


@contextlib.contextmanager
def fs_errors(url: str, write: bool = False) -> Iterator[None]:
    """Raise a filesystem's failures as the plugin's errors naming ``url``: a missing file stays
    FileNotFoundError; refused credentials are a ConfigError; any other OSError is
    StorageUnavailableError (SnapshotWriteError when ``write``, ENOSPC kept as OSError)."""
    try:
        yield
    except (SnapshotError, FileNotFoundError):
        raise
    except PermissionError as exc:
        raise ConfigError(f"{url}: the storage refused access ({exc}); check storage_options") from exc
    except OSError as exc:
        if write and exc.errno is not None:
            raise  # a local cause (no space, ...), handled as on local disk
        raise StorageUnavailableError(f"{url}: the storage failed the request ({type(exc).__name__}: {exc})") from exc


class FsspecStore(Store):
    """A snapshot directory on an fsspec filesystem (see the module docstring)."""

    protocol = MetadataWrittenLast()

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, *,
                 _fs: Any = None, _root: Optional[str] = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        if _fs is None:
            _fs, _root = _filesystem(self.url, storage_options)
        self.fs, self.root = _fs, _root or ""

    def _dir(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _path(self, name: str, rel: str) -> str:
        return f"{self.root}/{name}/{rel}"

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def nested(self, name: str) -> Store:
        return FsspecStore(self.child(name), self.storage_options, _fs=self.fs, _root=self._dir(name))

    def list_names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            with fs_errors(self.url):
                entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"
        )

    def has_file(self, name: str, rel: str) -> bool:
        return self.file_size(name, rel) is not None

    def read_file(self, name: str, rel: str) -> bytes:
        with fs_errors(self.child(name)):
            return bytes(self.fs.cat_file(self._path(name, rel)))

    def file_size(self, name: str, rel: str) -> Optional[int]:
        path = self._path(name, rel)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        try:
            with fs_errors(self.child(name)):
                info = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def check_writable(self) -> None:
        """Write and remove a probe file in dirpath. Its name carries the writer (host, pid), so
        a probe left by a process killed in between is removed by the next check once that
        process is gone (an object store has no file without a name)."""
        token = staging_token(uuid.uuid4().hex[:12], 0)
        probe = f"{self.root}/{PROBE_PREFIX}{token}"
        try:
            self._remove_stale_probes()
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as exc:
            raise ConfigError(
                f"dirpath {self.url!r} cannot be written ({type(exc).__name__}: {exc}); check the "
                "URL and storage_options"
            ) from exc

    def _modified(self, path: str) -> float:
        """When ``path`` was last written (seconds since the epoch), as the filesystem reports it;
        now where it reports nothing usable."""
        try:
            info = self.fs.info(path)
        except Exception:
            return time.time()
        for key in ("mtime", "LastModified", "last_modified", "created"):
            value = info.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
        return time.time()

    def _remove_stale_probes(self) -> None:
        """Remove the write probes of processes that are gone (never this process's own)."""
        try:
            names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            if not name.startswith(PROBE_PREFIX):
                continue
            writer = writer_of_token(name[len(PROBE_PREFIX):], self._modified(f"{self.root}/{name}"))
            if writer is None or writer.get("pid") == os.getpid() or writer_gone({**writer, "run_id": None}) is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.root}/{name}")

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        self._check_rel(name, rel, SnapshotWriteError)
        views = byte_views(data)
        if feed is not None:
            for view in views:
                feed(view)
        with fs_errors(f"{self.child(name)}/{rel}", write=True):
            self.fs.pipe_file(self._path(name, rel), b"".join(views))

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        """:meth:`Store.read_into` by ranged requests, several at once."""
        self._check_reads(name, reads)
        read_ranges(lambda rel, start, end: self._fetch(name, rel, start, end), reads, done, concurrency)

    def _fetch(self, name: str, rel: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of file ``rel`` of child ``name`` (fewer if the file ends first)."""
        path = self._path(name, rel)
        try:
            with fs_errors(f"{self.child(name)}/{rel}"):
                return bytes(self.fs.cat_file(path, start=start, end=end))
        except FileNotFoundError as exc:
            raise SnapshotCorruptError(
                f"{self.child(name)}/{rel}: a file the snapshot names is missing; the snapshot is damaged"
            ) from exc
        except StorageUnavailableError:
            size = self.file_size(name, rel)
            if size is not None and start >= size:  # a range past the end (S3's InvalidRange)
                return b""
            raise

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        self.write_payload(staging, WRITER_FNAME, [json.dumps(writer).encode()])

    def lock(self, holder: dict[str, Any]) -> DirLock:
        return FsspecLease(self, holder)

    def _delete(self, name: str, unpublish: tuple[str, ...]) -> None:
        # Unpublished first, the proof that it is the plugin's (index, writer marker) last: a
        # crash part-way leaves an incomplete snapshot that is still provably the plugin's.
        directory = self._dir(name)
        with fs_errors(self.child(name)):
            for metadata in unpublish:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(f"{directory}/{metadata}")
            self.fs.invalidate_cache(directory)
            try:
                found = [str(p) for p in self.fs.find(directory)]
            except FileNotFoundError:
                found = []
            proofs = {f"{directory}/{proof}" for proof in PROOF_FNAMES}
            rest = [p for p in found if p not in proofs]
            if rest:
                self.fs.rm(rest)
            for proof in sorted(proofs):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(proof)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(directory, recursive=True)  # directories some filesystems keep
            self.fs.invalidate_cache(self.root)


class FsspecLease(DirLock):
    """The live saver's lease on an fsspec dirpath: the file ``dirpath/.tnt_snapshot.lease.json``
    names it and when the lease expires (``LEASE_S``); a thread renews it every minute. A second
    saver is refused while an unexpired lease of another run is there, unless that run's process
    is provably dead on this host. fsspec offers no conditional write: two jobs starting within the
    same moment can both miss each other's lease (the S3 store's lease closes that gap)."""

    def __init__(self, store: FsspecStore, holder: dict[str, Any]) -> None:
        self._store, self._holder = store, dict(holder)
        self._stop = threading.Event()
        current = self._read()
        if current is not None and lease_held_by_another(current, self._holder.get("run_id")):
            raise busy_error(store.url, current)
        self._write()
        self._thread = threading.Thread(target=self._keep, name="tnt-snapshot-lease", daemon=True)
        self._thread.start()

    def _read(self) -> Optional[dict[str, Any]]:
        try:
            value = json.loads(self._store.fs.cat_file(f"{self._store.root}/{LEASE_FNAME}"))
        except (FileNotFoundError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _write(self) -> None:
        body = json.dumps({**self._holder, "expires_at": time.time() + LEASE_S}).encode()
        with fs_errors(self._store.child(LEASE_FNAME), write=True):
            self._store.fs.pipe_file(f"{self._store.root}/{LEASE_FNAME}", body)

    def _keep(self) -> None:
        while not self._stop.wait(min(60.0, LEASE_S / 5)):
            try:
                current = self._read()
                if current is not None and current.get("run_id") != self._holder.get("run_id"):
                    return  # taken over after it expired: leave it be
                self._write()
            except Exception:  # best effort; the next renewal tries again
                pass

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            current = self._read()
            if current is not None and current.get("run_id") == self._holder.get("run_id"):
                self._store.fs.rm_file(f"{self._store.root}/{LEASE_FNAME}")
        except Exception:  # it expires by itself
            pass


__all__ = ["EXTRA_OF_SCHEME", "FSSPEC_HINT", "FsspecLease", "FsspecStore", "fs_errors", "fsspec_opener", "open_fsspec"]
