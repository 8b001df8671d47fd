"""The stores: where snapshot directories live, chosen by the URL scheme of ``dirpath``.

:func:`open_store` turns a ``dirpath`` into its :class:`~.base.Store` through the scheme registry
(:mod:`.registry`): a local path or ``file://`` URL (:class:`~.local.LocalStore`),
``s3://BUCKET/PREFIX`` (:class:`~.s3.S3Store`), a scheme another package declares in the
entry-point group ``tnt_snapshot_plugin.stores``, or any other scheme fsspec serves
(:class:`~.fsspec.FsspecStore`: ``memory://``, ``gs://`` with gcsfs, ``az://`` with adlfs, ...).
Fakes for tests (``MemoryStore``, ``FaultyStore``) live in :mod:`tnt_snapshot_plugin.testing`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.stores.base import (
    LEASE_FNAME,
    LOCK_FNAME,
    WRITER_FNAME,
    DirLock,
    Store,
)
from tnt_snapshot_plugin.stores.commit import AtomicRename, CommitProtocol, MetadataWrittenLast
from tnt_snapshot_plugin.stores.local import LocalStore
from tnt_snapshot_plugin.stores.registry import (
    opener_for,
    register_store,
    registered_schemes,
    unregister_store,
)


def url_scheme(dirpath: str) -> str:
    """The URL scheme of ``dirpath`` (``"file"`` for a path without one)."""
    scheme, sep, _ = dirpath.partition("://")
    return scheme if sep else "file"


def open_store(
    dirpath: str, storage_options: Optional[dict[str, Any]] = None, *, timeout_s: Optional[float] = None
) -> Store:
    """The store for ``dirpath``: a local path or a URL whose scheme a store serves (see the
    module docstring). ``storage_options``: the store's own (S3: endpoint and credentials; fsspec:
    the filesystem's arguments). ``timeout_s``: how long one request to an object store may take,
    retries included (None: the default of ``storage_timeout_s``)."""
    if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath):
        raise ConfigError(f"dirpath must be a non-empty path or URL string, got {dirpath!r}")
    dirpath = os.fspath(dirpath)
    opener = opener_for(url_scheme(dirpath), dirpath)
    return opener(dirpath, storage_options, timeout_s)  # type: ignore[no-any-return]


def split_snapshot_path(path: str) -> tuple[str, str]:
    """(dirpath, name) of a snapshot path or URL."""
    path = os.fspath(path).rstrip("/")
    head, _, name = path.rpartition("/")
    if not name:
        raise ConfigError(f"{path!r} is not a snapshot path (expected DIRPATH/epoch_E_step_S)")
    return head or ".", name


__all__ = [
    "LEASE_FNAME",
    "LOCK_FNAME",
    "WRITER_FNAME",
    "AtomicRename",
    "CommitProtocol",
    "DirLock",
    "LocalStore",
    "MetadataWrittenLast",
    "Store",
    "open_store",
    "register_store",
    "registered_schemes",
    "split_snapshot_path",
    "unregister_store",
    "url_scheme",
]
