"""The stores: where snapshot directories live (local disk, S3, and in-process fakes for tests).

:func:`open_store` turns a ``dirpath`` into its :class:`~.base.Store`: a local path or ``file://``
URL (:class:`~.local.LocalStore`), ``s3://BUCKET/PREFIX`` (:class:`~.s3.S3Store`), or
``memory://NAME`` (the in-process registry of :mod:`.fakes`: a :class:`~.fakes.MemoryStore`, or
whatever store a test registered under NAME, e.g. a :class:`~.fakes.FaultyStore`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import ConfigError
from .base import (
    INDEX_FNAME,
    LEASE_FNAME,
    LOCK_FNAME,
    METADATA_FNAME,
    WRITER_FNAME,
    AtomicRename,
    CommitProtocol,
    DirLock,
    MetadataWrittenLast,
    Store,
)
from .local import LocalStore


def open_store(
    dirpath: str, storage_options: Optional[dict[str, Any]] = None, *, timeout_s: Optional[float] = None
) -> Store:
    """The store for ``dirpath``: a local path, ``file://``, ``s3://`` or ``memory://`` URL.
    ``timeout_s``: how long one request to an object store may take, retries included (None:
    the default of ``storage_timeout_s``)."""
    if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath):
        raise ConfigError(f"dirpath must be a non-empty path or URL string, got {dirpath!r}")
    dirpath = os.fspath(dirpath)
    protocol = dirpath.split("://", 1)[0] if "://" in dirpath else "file"
    if protocol in ("file", "memory") and storage_options:
        where = "local" if protocol == "file" else "memory://"
        raise ConfigError(
            f"storage_options {sorted(storage_options)} was given for the {where} dirpath "
            f"{dirpath!r}, where it has no effect; pass storage_options only with s3:// paths"
        )
    if "://" not in dirpath:
        return LocalStore(dirpath)
    if protocol == "file":
        return LocalStore(dirpath[len("file://"):])
    if protocol == "s3":
        from .s3 import S3Store

        if timeout_s is None:
            return S3Store(dirpath, storage_options)
        return S3Store(dirpath, storage_options, timeout_s)
    if protocol == "memory":
        from .fakes import open_memory

        return open_memory(dirpath)
    raise ConfigError(
        f"dirpath {dirpath!r} uses storage protocol {protocol!r}, which tnt_snapshot_plugin does "
        "not support; use a local path, file:// or s3://"
    )


def split_snapshot_path(path: str) -> tuple[str, str]:
    """(dirpath, name) of a snapshot path or URL."""
    path = os.fspath(path).rstrip("/")
    head, _, name = path.rpartition("/")
    if not name:
        raise ConfigError(f"{path!r} is not a snapshot path (expected DIRPATH/epoch_E_step_S)")
    return head or ".", name


__all__ = [
    "INDEX_FNAME",
    "LEASE_FNAME",
    "LOCK_FNAME",
    "METADATA_FNAME",
    "WRITER_FNAME",
    "AtomicRename",
    "CommitProtocol",
    "DirLock",
    "LocalStore",
    "MetadataWrittenLast",
    "Store",
    "open_store",
    "split_snapshot_path",
]
