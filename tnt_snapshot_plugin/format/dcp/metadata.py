"""The one reader of a DCP checkpoint's ``.metadata``: a restricted unpickler, then every field
validated before anything is read or allocated.

``.metadata`` is a pickle. :class:`MetadataUnpickler` builds only DCP's metadata classes,
``torch.Size``, torch's dtypes, layouts and memory formats, and the ``pathlib`` paths DCP records
as the checkpoint id; a pickle that names anything else (a function that would run, a class
outside DCP's) is refused when the name is met, before anything is called:
:class:`SnapshotCorruptError` naming ``module.name``.

:func:`validate` then checks what restore relies on: the types of every field; each tensor's
chunks inside its shape, not overlapping, covering it exactly (``format.structure``); a stored
record for every chunk and every pickled value, its file a relative path inside the snapshot, its
byte range not overlapping another's and long enough for the chunk's bytes; DCP's
``planner_data`` paths joined with dots giving their names, none inside another; counts and sizes
bounded. :func:`parse` does both and gives a :class:`DcpMetadata`.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.dcp.layout import APP_STATE, PER_RANK, Layout, Path
from tnt_snapshot_plugin.format.structure import MAX_INT64, overlap_problem, tiling_problem, volume
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (
    MAX_ENTRIES,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    MAX_PATH_DEPTH,
    MAX_WORLD_SIZE,
    escapes,
)

#: The classes and functions a DCP ``.metadata`` may name: (module, name) -> object.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
        for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    # a layout is pickled by name, through this function (it only looks the name up)
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # StorageMeta.checkpoint_id: dcp.save records the checkpoint's directory as a Path
    ("pathlib", "PosixPath"): __import__("pathlib").PosixPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "PureWindowsPath"): __import__("pathlib").PureWindowsPath,
}

#: torch's attributes a ``.metadata`` may name: its dtypes, layouts and memory formats.
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, building only what :data:`_ALLOWED` names (and torch's
    dtypes, layouts and memory formats); anything else raises SnapshotCorruptError naming it."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise refused(self.where, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise refused(self.where, "a persistent id")


def refused(where: str, what: str) -> SnapshotCorruptError:
    """The error of a ``.metadata`` whose pickle names ``what``, which is not DCP's metadata."""
    reason = (
        f".metadata names {what}, which is not one of DCP's metadata classes: it was refused "
        "unread, nothing of it ran"
    )
    error = SnapshotCorruptError(
        f"{where}/{reason}. The checkpoint is damaged or crafted; restore another one "
        "(restore_from_latest falls back to an older one by itself)"
    )
    error.reason = reason  # type: ignore[attr-defined]
    return error


def corrupt(where: str, what: str) -> SnapshotCorruptError:
    """The error of a ``.metadata`` that is not valid DCP metadata (``what``: why)."""
    error = SnapshotCorruptError(
        f"{where}/.metadata: {what}: the checkpoint is damaged or was not written by DCP or this "
        "plugin. Restore another one (restore_from_latest falls back to an older one by itself)"
    )
    error.reason = f".metadata: {what}"  # type: ignore[attr-defined]
    return error


@dataclass
class DcpMetadata:
    """A validated ``.metadata``: DCP's ``Metadata`` as unpickled, each entry's path, and the
    leaves each rank restores."""

    meta: Any
    #: fully qualified name -> path in the state dict
    paths: dict[str, Path]
    layout: Layout
    #: (file, the end of the furthest record read from it), for the checks of file sizes
    ends: dict[str, int]

    @property
    def entries(self) -> dict[str, Any]:
        md: dict[str, Any] = self.meta.state_dict_metadata
        return md

    def storage(self, name: str, offsets: Optional[Any] = None) -> Any:
        """The stored record (``_StorageInfo``) of entry ``name``'s chunk at ``offsets`` (None: a
        pickled value)."""
        return self.meta.storage_data[dcp_md.MetadataIndex(name, offsets)]


def unpickle(data: bytes, where: str) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata``, by the restricted unpickler;
    SnapshotCorruptError for a pickle it refuses or that does not load."""
    if len(data) > MAX_METADATA_BYTES:
        raise corrupt(where, f"it has {len(data)} bytes, more than the {MAX_METADATA_BYTES} a metadata may have")
    try:
        return MetadataUnpickler(data, where).load()
    except SnapshotCorruptError:
        raise
    except RecursionError:
        raise corrupt(where, "it is nested too deep to be DCP metadata") from None
    except Exception as exc:
        raise corrupt(where, f"it does not unpickle ({type(exc).__name__}: {exc})") from None


def parse(data: bytes, where: str, *, plugin: bool, world_size: Optional[int] = None) -> DcpMetadata:
    """The validated metadata of ``.metadata`` bytes ``data`` (``where``: the snapshot, named in
    errors). ``plugin``: written by the plugin (its per-rank layout applies; ``world_size``: the
    ranks its index records). SnapshotCorruptError with the first problem found."""
    meta = unpickle(data, where)
    problems: list[str] = []
    parsed = validate(meta, problems, plugin=plugin, world_size=world_size)
    if parsed is None or problems:
        raise corrupt(where, problems[0] if problems else "it is not DCP metadata")
    return parsed


def _size(value: Any, ndim: Optional[int] = None) -> Optional[tuple[int, ...]]:
    """``value`` as a tuple of dimension sizes (or offsets) if it is one: a torch.Size or tuple of
    ints from 0 to MAX_INT64, of at most MAX_NDIM entries (``ndim`` of them where given)."""
    if not isinstance(value, tuple) or len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        return None
    if not all(type(v) is int and 0 <= v <= MAX_INT64 for v in value):
        return None
    return tuple(value)


def validate(meta: Any, problems: list[str], *, plugin: bool, world_size: Optional[int]) -> Optional[DcpMetadata]:
    """Add to ``problems`` what is wrong with unpickled ``meta`` (see the module docstring); the
    validated metadata, or None where it is not DCP's ``Metadata`` at all."""
    if type(meta) is not dcp_md.Metadata:
        problems.append(f"it holds a {type(meta).__name__}, not DCP's Metadata")
        return None
    entries, storage = meta.state_dict_metadata, meta.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        problems.append("its state_dict_metadata or storage_data is not a dict")
        return None
    if len(entries) > MAX_ENTRIES or len(storage) > MAX_ENTRIES:
        problems.append(f"it lists more than {MAX_ENTRIES} entries")
        return None
    if meta.version is not None and type(meta.version) is not str:
        problems.append("its version is not a string")
    if meta.storage_meta is not None and type(meta.storage_meta) is not dcp_md.StorageMeta:
        problems.append("its storage_meta is not DCP's StorageMeta")
    records = _check_storage(storage, problems)
    spans: dict[str, list[Any]] = {}
    pieces = 0
    for name, md in entries.items():
        if type(name) is not str or not name:
            problems.append(f"an entry's name {name!r} is not a string")
            continue
        if type(md) is dcp_md.BytesStorageMetadata:
            record = records.get((name, None))
            if record is None:
                problems.append(f"entry {name!r} has no stored record")
            else:
                spans.setdefault(record.relative_path, []).append(_span(record, name))
            continue
        if type(md) is not dcp_md.TensorStorageMetadata:
            problems.append(f"entry {name!r} is a {type(md).__name__}, not a tensor or a pickled value")
            continue
        problem = _tensor_problem(name, md, records, spans)
        if problem is not None:
            problems.append(problem)
            continue
        pieces += len(md.chunks)
        if pieces > MAX_ENTRIES:
            problems.append(f"its tensors have more than {MAX_ENTRIES} chunks")
            return None
    for rel, found in sorted(spans.items()):
        problem = overlap_problem(rel, found)
        if problem is not None:
            problems.append(problem)
    paths = _paths(meta.planner_data, entries, problems)
    if paths is None:
        return None
    if plugin:
        _check_plugin_layout(paths, world_size, problems)
    ends = {rel: max(span[1] for span in found) for rel, found in spans.items()}
    return DcpMetadata(meta, paths, Layout(paths, plugin) if not problems else Layout({}, plugin), ends)


def _check_storage(storage: dict, problems: list[str]) -> dict[tuple[str, Optional[tuple[int, ...]]], Any]:
    """The stored records by (name, offsets), each checked: a relative file inside the snapshot,
    a byte range within int64, no stream transforms."""
    out: dict[tuple[str, Optional[tuple[int, ...]]], Any] = {}
    for index, record in storage.items():
        if type(index) is not dcp_md.MetadataIndex or type(index.fqn) is not str:
            problems.append("a key of its storage_data is not DCP's MetadataIndex")
            return out
        offsets = None if index.offset is None else _size(index.offset)
        if index.offset is not None and offsets is None:
            problems.append(f"the stored record of {index.fqn!r} has offsets that are not sizes")
            continue
        if type(record) is not _StorageInfo:
            problems.append(f"the stored record of {index.fqn!r} is not DCP's _StorageInfo")
            continue
        rel = record.relative_path
        if escapes(rel):
            problems.append(f"the stored record of {index.fqn!r} names {rel!r}, not a file inside the snapshot")
            continue
        if not (type(record.offset) is int and type(record.length) is int and 0 <= record.offset
                and 0 <= record.length and record.offset + record.length <= MAX_INT64):
            problems.append(f"the stored record of {index.fqn!r} has no valid byte range in {rel}")
            continue
        if getattr(record, "transform_descriptors", None):
            problems.append(
                f"the stored record of {index.fqn!r} is written through DCP stream transforms "
                f"{list(record.transform_descriptors or ())!r}, which this version does not read"
            )
            continue
        out[index.fqn, offsets] = record
    return out


def _span(record: Any, name: str) -> Any:
    # several entries may share one record (rank 0's own values, also under app_state): the same
    # byte range is read by each, never an overlapping one
    return (record.offset, record.offset + record.length, name, "record")


def _tensor_problem(name: str, md: Any, records: dict, spans: dict[str, list[Any]]) -> Optional[str]:
    """What is wrong with tensor entry ``name`` (its properties, shape, chunks and their stored
    records), or None; its records' byte ranges are added to ``spans``."""
    props = md.properties
    if type(props) is not dcp_md.TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"entry {name!r} has no tensor dtype"
    shape = _size(md.size)
    if shape is None:
        return f"entry {name!r} has no valid shape"
    itemsize = props.dtype.itemsize
    if volume(shape) * itemsize > MAX_INT64:
        return f"entry {name!r} has a shape {list(shape)} too large to be a tensor"
    if type(md.chunks) is not list or (not md.chunks and volume(shape) > 0):
        return f"entry {name!r} has no chunks"
    boxes = []
    for chunk in md.chunks:
        if type(chunk) is not dcp_md.ChunkStorageMetadata:
            return f"entry {name!r} has a chunk that is not DCP's ChunkStorageMetadata"
        offsets, sizes = _size(chunk.offsets, len(shape)), _size(chunk.sizes, len(shape))
        if offsets is None or sizes is None:
            return f"entry {name!r} has a chunk whose offsets or sizes do not fit its shape {list(shape)}"
        record = records.get((name, offsets))
        if record is None:
            return f"entry {name!r} has no stored record of its chunk at {list(offsets)}"
        if record.length < volume(sizes) * itemsize:
            return (
                f"entry {name!r}: the stored record of its chunk at {list(offsets)} holds "
                f"{record.length} bytes, fewer than the chunk's {volume(sizes) * itemsize}"
            )
        spans.setdefault(record.relative_path, []).append(_span(record, name))
        boxes.append((offsets, sizes))
    problem = tiling_problem(shape, boxes, "chunks")
    return f"entry {name!r}: {problem}" if problem is not None else None


def _paths(planner_data: Any, entries: dict[str, Any], problems: list[str]) -> Optional[dict[str, Path]]:
    """Each entry's path in the state dict: DCP's ``planner_data`` (a name without one: the name
    itself), each path joined with dots giving its name, no path inside another's value."""
    if planner_data is None:
        planner_data = {}
    if type(planner_data) is not dict:
        problems.append("its planner_data is not a dict of paths")
        return None
    paths: dict[str, Path] = {}
    for name in entries:
        if type(name) is not str:
            continue
        path = planner_data.get(name, (name,))
        if (
            type(path) is not tuple or not 1 <= len(path) <= MAX_PATH_DEPTH
            or not all(type(t) is str or (type(t) is int and 0 <= t <= MAX_INT64) for t in path)
        ):
            problems.append(f"entry {name!r} has a path in the state dict that is not a tuple of keys")
            return None
        if ".".join(map(str, path)) != name:
            problems.append(f"entry {name!r} has a path {list(path)!r} in the state dict that does not name it")
            return None
        paths[name] = path
    leaves = set(paths.values())
    for name, path in paths.items():
        for n in range(1, len(path)):
            if path[:n] in leaves:
                problems.append(f"entry {name!r} lies inside the value of another entry")
                return None
    return paths


def _check_plugin_layout(paths: dict[str, Path], world_size: Optional[int], problems: list[str]) -> None:
    """A snapshot of the plugin's holds entries under ``app_state`` and, per rank below its world
    size, under ``per_rank.<R>``."""
    for name, path in paths.items():
        if path[0] == APP_STATE and len(path) >= 2:
            continue
        if path[0] == PER_RANK and len(path) >= 3 and type(path[1]) is str and path[1].isascii() and path[1].isdigit():
            rank = int(path[1])
            limit = world_size if world_size is not None else MAX_WORLD_SIZE
            if rank < limit and str(rank) == path[1]:
                continue
            problems.append(f"entry {name!r} is saved for rank {rank}, of a snapshot of {limit} ranks")
            return
        problems.append(f"entry {name!r} lies outside {APP_STATE} and {PER_RANK}, where the plugin writes")
        return


__all__ = ["DcpMetadata", "MetadataUnpickler", "corrupt", "parse", "refused", "unpickle", "validate"]
