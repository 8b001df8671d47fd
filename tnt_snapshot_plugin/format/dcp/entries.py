"""DCP's format as the command line reads it (the format seam's ``entries``, ``read_entry`` and
``read_key``): every leaf entry of a snapshot by path ``RANK/KEY/sub/...``, one entry's value, one
app-state entry whole.

Paths name keys as torchsnapshot's format does (each one encoded by ``torchsnapshot.common.encode``).
A snapshot the plugin wrote on several ranks lists each rank's own values under that rank, and the
values every rank restores alike (under ``app_state``; a sharded tensor is one entry, its chunks
every rank's) once, under rank 0, marked replicated. Any other checkpoint (one rank, ``dcp.save``,
torchtnt's DCP saver) lists every entry under rank 0.

Values are read as restore reads them (:class:`~.reading.DcpReader`): through the snapshot's files,
each record checked against the checksum the plugin's index records for it; a tensor whole (every
chunk put together); a pickled value loaded under the plugin's allow-list, never with full pickle.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.format.base import EntryInfo
from tnt_snapshot_plugin.format.dcp.layout import Path
from tnt_snapshot_plugin.format.dcp.metadata import DcpMetadata
from tnt_snapshot_plugin.format.dcp.reading import DcpReader
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.torchsnapshot.common import encode


def entry_names(parsed: DcpMetadata) -> dict[str, tuple[str, bool]]:
    """Path ``RANK/KEY/sub/...`` -> (the entry's fully qualified name, whether it is saved once
    for all ranks), for every leaf entry of the snapshot."""
    layout = parsed.layout
    out: dict[str, tuple[str, bool]] = {}
    if not layout.ranks:
        for key, leaves in layout.app.items():
            for rest, name in leaves.items():
                out[_path(0, key, rest)] = (name, False)
        return out
    first = layout.ranks.get(0, {})
    for key, leaves in layout.app.items():
        own = first.get(key, {})  # rank 0's own values, also under app_state: listed as rank 0's
        for rest, name in leaves.items():
            if rest not in own:
                out[_path(0, key, rest)] = (name, True)
    for rank, by_key in sorted(layout.ranks.items()):
        for key, leaves in by_key.items():
            for rest, name in leaves.items():
                out[_path(rank, key, rest)] = (name, False)
    return out


def _path(rank: int, key: str, rest: Path) -> str:
    return "/".join([str(rank), encode(key), *(encode(str(token)) for token in rest)])


def entries(parsed: DcpMetadata) -> dict[str, EntryInfo]:
    """Every leaf entry of the snapshot, by path."""
    out: dict[str, EntryInfo] = {}
    for path, (name, replicated) in entry_names(parsed).items():
        md = parsed.entries[name]
        if type(md) is TensorStorageMetadata:
            records = [parsed.storage(name, chunk.offsets) for chunk in md.chunks]
            whole = len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size)
            out[path] = EntryInfo(
                "tensor" if whole or not md.chunks else "sharded", "Tensor",
                dtype=str(md.properties.dtype).removeprefix("torch."), shape=list(md.size),
                nbytes=sum(r.length for r in records),
                locations=[(r.relative_path, [r.offset, r.offset + r.length]) for r in records],
                replicated=replicated,
            )
        else:  # a pickled value: what it holds is known once it is read
            record = parsed.storage(name)
            out[path] = EntryInfo(
                "object", "object", nbytes=record.length,
                locations=[(record.relative_path, [record.offset, record.offset + record.length])],
                replicated=replicated,
            )
    return out


def _reader(files: SnapshotFiles, parsed: DcpMetadata) -> DcpReader:
    """A reader of the snapshot as saved rank 0 restores it (the values of every rank are read
    by name)."""
    return DcpReader(files, Collectives(None), _Checked(parsed), weights_only=True)


class _Checked:
    """The verdict a reader takes: the metadata already parsed and checked."""

    def __init__(self, parsed: DcpMetadata) -> None:
        self.metadata = parsed


def read_entry(files: SnapshotFiles, parsed: DcpMetadata, path: str) -> Any:
    """The value of leaf entry ``path`` (of :func:`entries`): a tensor whole, or the pickled value."""
    found = entry_names(parsed).get(path)
    if found is None:
        raise KeyError(f"the snapshot holds no entry {path!r}")
    return _reader(files, parsed).value(found[0])


def read_key(files: SnapshotFiles, parsed: DcpMetadata, key: str) -> Any:
    """App-state entry ``key`` whole, as saved rank 0 restores it."""
    return _reader(files, parsed).read(key, None)


__all__ = ["entries", "entry_names", "read_entry", "read_key"]
