"""One committed snapshot's files as a format reads them: every read through the store, the file
sizes from the plugin's index where it has one (else from the store), every byte read checked
against the checksums the index records (a part of the index read for the files of its rank when
they are first read, on several ranks)."""

from __future__ import annotations

import functools
from typing import Any, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format import index as index_file
from tnt_snapshot_plugin.format.checksums import Verifier
from tnt_snapshot_plugin.stores.base import Store


class SnapshotFiles:
    """The files of snapshot ``name`` of ``store`` (``path``: as messages name it).

    ``index``: its parsed, checked index (None: a snapshot the plugin did not write, whose files
    are sized by the store and not checked). ``concurrency``: files (object-store ranges) read
    at once (None: the store's default)."""

    def __init__(
        self, store: Store, name: str, path: str, index: Optional[dict[str, Any]], *, concurrency: Optional[int] = None
    ) -> None:
        self.store, self.name, self.path = store, name, path
        #: the plugin's parsed index, or None (a snapshot torchtnt or torchsnapshot wrote)
        self.index = index if isinstance(index, dict) else None
        self._parts: Optional[index_file.Parts] = None
        if index_file.parts_of(self.index) is not None:  # several ranks': each part read as its files are
            self._parts = index_file.Parts(self.index, functools.partial(store.read_optional, name), path)  # type: ignore[arg-type]
        listed = self.index.get("files") if self.index is not None else None
        self._sizes: dict[str, Any] = (
            self._parts.files if self._parts is not None else listed if isinstance(listed, dict) else {}
        )
        records = self.index.get("checksums") if self.index is not None else None
        #: the index's checksums, checking what is read (None: none recorded)
        self.verifier = Verifier(path, records, self._sizes) if isinstance(records, dict) and records else None
        self._read = functools.partial(store.read_into, name, concurrency=concurrency)

    @classmethod
    def open(cls, store: Store, name: str, path: str, *, concurrency: Optional[int] = None,
             index: Any = None, read_index: bool = True) -> SnapshotFiles:
        """The files of snapshot ``name``, its index read and checked (``index.parse``) unless
        given (a verdict's) or ``read_index`` is False."""
        if index is None and read_index:
            try:
                data: Optional[bytes] = store.read_file(name, index_file.INDEX_FNAME)
            except FileNotFoundError:
                data = None
            if data is not None:
                index = index_file.parse(data, path)
        return cls(store, name, path, index, concurrency=concurrency)

    def read_ahead(self) -> None:
        """Tell the store that the files the index lists are read next (in name order, as the
        reads take them), so that a store that can fetch ahead starts now (``Store.read_ahead``);
        nothing for a snapshot without an index, or one whose files each rank's part lists."""
        if self._parts is None and self._sizes:
            self.store.read_ahead(self.name, sorted(self._sizes.items()))

    def _load_parts(self, rels: Any) -> None:
        if self._parts is None:
            return
        for files, checksums in self._parts.load_for(rels):
            if self.verifier is not None:
                self.verifier.add(checksums, files)

    def file_size(self, rel: str) -> Optional[int]:
        """The size of file ``rel``: as the index records it, else as the store reports it."""
        self._load_parts((rel,))
        size = self._sizes.get(rel)
        return size if isinstance(size, int) else self.store.file_size(self.name, rel)

    def read_into(self, reads: Any, done: Any = None) -> None:
        """``Store.read_into`` of this snapshot (``(rel, offset, dest)`` each); the checksums are
        the caller's to check (``verifier.check_reads``, as the bytes land)."""
        if self._parts is not None:
            self._load_parts({read[0] for read in reads})
        self._read(reads, done)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of file ``rel`` (not checked: a part of a file whose checksum
        covers the whole)."""
        buf = memoryview(bytearray(end - start))
        self.read_into([(rel, start, buf)])
        return bytes(buf)

    def read_checked(self, rel: str) -> bytes:
        """File ``rel`` whole, checked against its checksum where the index records one;
        SnapshotCorruptError on a mismatch."""
        data = self.store.read_file(self.name, rel)
        if self.verifier is not None:
            self._load_parts((rel,))
            self.verifier.check(rel, 0, data)
        return data

    def has_checksum(self, rel: str) -> bool:
        """Whether the index records a checksum of file ``rel`` as a whole."""
        records = (self.index or {}).get("checksums") or {}
        return isinstance(records.get(rel), dict)


__all__ = ["SnapshotCorruptError", "SnapshotFiles"]
