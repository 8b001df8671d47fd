"""A temporary shim (deleted once no test imports it): the names tests imported from here
before the stores moved to ``stores/`` and the file I/O to ``fileio.py``. Setting
``_write_durably``, ``_write_gathered`` or ``s3_client`` on this module sets it where it is used
now (:class:`_Seams`)."""

from __future__ import annotations

import shutil  # noqa: F401  (tests patch ``storage.shutil.rmtree``)
import sys
import types
from typing import Any

from . import fileio
from .fileio import fsync_dir, is_inside
from .fileio import map_range as _map_file
from .fileio import read_range as _read_file
from .fileio import relative_inside as _relative_inside
from .fileio import write_durably as _write_durably
from .fileio import write_gathered as _write_gathered
from .stores import open_store, split_snapshot_path
from .stores import s3 as _s3
from .stores.base import (
    INDEX_FNAME,
    LEASE_FNAME,
    LOCK_FNAME,
    METADATA_FNAME,
    WRITER_FNAME,
    DirLock,
    Store,
)
from .stores.base import is_missing_key as _is_missing_key
from .stores.local import FileLock as _FileLock
from .stores.local import LocalStore
from .stores.local import rmtree_proof_last as _rmtree_proof_last
from .stores.s3 import LEASE_S, S3_OPTION_KEYS, S3Store, s3_client, s3_error, s3_errors
from .stores.s3 import S3Lease as _S3Lease
from .stores.s3 import translated as _translated
from .stores.writers import (
    STALE_AFTER_S,
    live_runs,
    new_run_id,
    staging_token,
    writer_gone,
    writer_identity,
)


class _Seams(types.ModuleType):
    """This module's type: setting one of the names below on it (``monkeypatch.setattr(storage,
    "_write_durably", ...)``, as tests written before the split do) sets it, too, on the module
    that now owns and calls it, so the stores see the replacement as they did."""

    _OWNERS = {"_write_durably": (fileio, "write_durably"), "_write_gathered": (fileio, "write_gathered"),
               "s3_client": (_s3, "s3_client")}

    def __setattr__(self, name: str, value: Any) -> None:
        owner = self._OWNERS.get(name)
        if owner is not None:
            setattr(owner[0], owner[1], value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Seams

__all__ = [
    "INDEX_FNAME",
    "LEASE_FNAME",
    "LEASE_S",
    "LOCK_FNAME",
    "METADATA_FNAME",
    "S3_OPTION_KEYS",
    "STALE_AFTER_S",
    "WRITER_FNAME",
    "DirLock",
    "LocalStore",
    "S3Store",
    "Store",
    "fsync_dir",
    "is_inside",
    "live_runs",
    "new_run_id",
    "open_store",
    "s3_client",
    "s3_error",
    "s3_errors",
    "split_snapshot_path",
    "staging_token",
    "writer_gone",
    "writer_identity",
    "_FileLock",
    "_S3Lease",
    "_is_missing_key",
    "_map_file",
    "_read_file",
    "_relative_inside",
    "_rmtree_proof_last",
    "_translated",
    "_write_durably",
    "_write_gathered",
]
