"""torchsnapshot's on-disk format, written and read by the plugin itself (:data:`FORMAT`).

A snapshot is a directory: payload files, and ``.snapshot_metadata`` (JSON) holding the manifest,
one record per saved value, in torchsnapshot's own schema. Stock torchsnapshot (and torchtnt's
saver) read what the plugin writes, and the plugin reads what they write.

* :mod:`.common`: what writer and reader share (path encoding, dtype names, tensor bytes).
* :mod:`.writer`: state dicts -> manifest records and payloads (small tensors packed);
  :mod:`.writing`: the seam's writer around it (what the ranks send, the metadata rank 0 writes).
* :mod:`.manifest`: the one validated reader of ``.snapshot_metadata``; :mod:`.checking`: the
  format's part of ``verify``.
* :mod:`.reader`: manifest records + payload bytes -> state dicts, read into the target tensors;
  :mod:`.reading`: the seam's reader around it (what one rank of a restore reads).

Importing this package imports no torch: the modules that do are imported when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.format.base import EntryInfo
    from tnt_snapshot_plugin.format.files import SnapshotFiles
    from tnt_snapshot_plugin.format.torchsnapshot.reading import TorchsnapshotReader
    from tnt_snapshot_plugin.format.torchsnapshot.writing import TorchsnapshotWriter
    from tnt_snapshot_plugin.format.verify import Verdict


class TorchsnapshotFormat:
    """torchsnapshot's format through the format seam (``format.base.Format``)."""

    name = "torchsnapshot"
    metadata_file = ".snapshot_metadata"

    def writer(self, collectives: Collectives, config: Any) -> TorchsnapshotWriter:
        from tnt_snapshot_plugin.format.torchsnapshot.writing import TorchsnapshotWriter

        return TorchsnapshotWriter(collectives)

    def reads_by_rank(self, index: Optional[dict[str, Any]], ranks: int) -> bool:
        from tnt_snapshot_plugin.format.torchsnapshot.checking import reads_by_rank

        return reads_by_rank(index, ranks)

    def check(self, files: SnapshotFiles, verdict: Verdict, *, size_of: Callable[[str], Optional[int]]) -> None:
        from tnt_snapshot_plugin.format.torchsnapshot.checking import check

        check(files, verdict, size_of)

    def check_payloads(self, files: SnapshotFiles, verdict: Verdict) -> None:
        from tnt_snapshot_plugin.format.torchsnapshot.checking import check_payloads

        check_payloads(files, verdict)

    def reader(self, files: SnapshotFiles, collectives: Collectives, verdict: Optional[Verdict], *, weights_only: bool) -> TorchsnapshotReader:
        from tnt_snapshot_plugin.format.torchsnapshot.reading import TorchsnapshotReader

        return TorchsnapshotReader(files, collectives, verdict, weights_only=weights_only)

    def entries(self, verdict: Verdict) -> dict[str, EntryInfo]:
        from tnt_snapshot_plugin.format.torchsnapshot.manifest import CONTAINER_TYPES, describe

        manifest = verdict.metadata.manifest
        return {path: describe(entry) for path, entry in manifest.items() if entry["type"] not in CONTAINER_TYPES}

    def read_entry(self, files: SnapshotFiles, verdict: Verdict, path: str) -> Any:
        from tnt_snapshot_plugin.format.torchsnapshot import reader

        return reader.read_value(
            verdict.metadata.manifest, path, files.read_into, file_size=files.file_size, verifier=files.verifier
        )

    def read_key(self, files: SnapshotFiles, verdict: Verdict, key: str) -> Any:
        from tnt_snapshot_plugin.format.torchsnapshot import reader
        from tnt_snapshot_plugin.format.torchsnapshot.manifest import rank_view

        return reader.read_state_dict(
            rank_view(verdict.metadata, 0), key, None, files.read_into, file_size=files.file_size,
            verifier=files.verifier,
        )

    def __repr__(self) -> str:
        return "TorchsnapshotFormat()"


#: torchsnapshot's format, as the registry hands it out (``format.registry.get_format``).
FORMAT = TorchsnapshotFormat()

__all__ = ["FORMAT", "TorchsnapshotFormat"]
