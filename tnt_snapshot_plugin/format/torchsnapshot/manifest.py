"""The one reader of ``.snapshot_metadata``: parsed and validated once, without torch.

Restore, latest and best selection, ``verify`` and every ``tnt-snapshot`` command read a
snapshot's manifest through :func:`parse_metadata`, so they agree on what a snapshot holds and on
what is damage.

The metadata is torchsnapshot's: JSON (YAML from older torchsnapshot releases) with ``version``,
``world_size`` and ``manifest``, a mapping ``"RANK/KEY/sub/path" -> entry``. :func:`parse_metadata`
refuses, with :class:`SnapshotCorruptError` naming the snapshot and the entry:

* a file over :data:`MAX_METADATA_BYTES`, nesting deeper than the JSON parser takes, more than
  :data:`MAX_ENTRIES` entries (or pieces), a path of more than :data:`MAX_PATH_DEPTH` components,
  a ``world_size`` above :data:`MAX_WORLD_SIZE`;
* a path that names no rank below ``world_size``, an entry of an unknown kind;
* a location that is not a relative path inside the snapshot (absolute, ``..``, empty parts,
  a backslash or NUL);
* a dtype the format does not know, a shape that is not a list of sizes, a shape of more than
  :data:`MAX_NDIM` dimensions or whose elements (or bytes) do not fit in a signed 64-bit integer, a
  raw tensor whose byte range does not hold ``shape x element size`` bytes, a piece (chunk, shard)
  whose tensor does not have the piece's sizes;
* pieces that do not form their tensor (``format/structure.py``): a ChunkedTensor's chunks, or the
  shards of a sharded tensor merged over every rank, that leave a gap, overlap, or lie outside its
  shape (the shape the index records, where it does);
* two entries that read overlapping bytes of one file (the replicas of a DTensor shard, which
  name the same bytes, aside);
* a primitive value that does not decode, a dict without its list of keys.

Every count and size is checked against its bound before it is used to allocate or iterate.

Entries stay the plain dicts of the file (the reader's hot loop reads them directly); the facts a
caller needs about one come from :func:`describe` as an :class:`EntryInfo`.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.base import EntryInfo
from tnt_snapshot_plugin.format.structure import (
    MAX_INT64,
    WHOLE_FILE,
    Box,
    Span,
    overlap_problem,
    tiling_problem,
    volume,
)
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases

METADATA_FNAME = ".snapshot_metadata"

#: Entry kinds: containers hold other entries; the rest are leaves.
CONTAINER_TYPES = frozenset({"dict", "OrderedDict", "list"})
TENSOR_TYPES = frozenset({"Tensor", "ChunkedTensor"})
SHARDED_TYPES = frozenset({"ShardedTensor", "DTensor"})
PRIMITIVE_TYPES = frozenset({"int", "str", "bool", "bytes", "float"})
OBJECT_TYPE = "object"
KNOWN_TYPES = CONTAINER_TYPES | TENSOR_TYPES | SHARDED_TYPES | PRIMITIVE_TYPES | {OBJECT_TYPE}

#: Serializers of tensor payloads: raw bytes, or ``torch.save``.
RAW = "buffer_protocol"
TORCH_SAVE = "torch_save"

#: dtype name -> element size in bytes, for every dtype the format knows.
DTYPE_SIZES: dict[str, int] = {
    "torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
    "torch.complex128": 16, "torch.complex64": 8,
    "torch.int64": 8, "torch.int32": 4, "torch.int16": 2, "torch.int8": 1, "torch.uint8": 1,
    "torch.bool": 1,
    "torch.qint32": 4, "torch.qint8": 1, "torch.quint8": 1,
}
#: dtypes whose tensors may be stored as raw bytes (others are stored with ``torch.save``).
RAW_DTYPE_NAMES = frozenset(n for n in DTYPE_SIZES if not n.startswith(("torch.q", "torch.complex")))

#: Bounds on what is parsed at all: far above any real snapshot, far below what exhausts a host.
MAX_METADATA_BYTES = 2 << 30
#: entries, and pieces (chunks, shards) of all entries together
MAX_ENTRIES = 20_000_000
MAX_PATH_DEPTH = 200
#: ranks a snapshot may have been taken on
MAX_WORLD_SIZE = 1 << 20
#: dimensions of a tensor
MAX_NDIM = 64
#: element counts up to which no dimension and no byte count can overflow int64 (16: the
#: largest element size)
_NUMEL_CHECKED = MAX_INT64 // 16

#: The key under which a view read by rank (``rank_regions.read_for_rank``) puts a sharded entry's
#: whole shape (from the index).
GLOBAL_SHAPE = "global_shape"

_INT_TEXT = re.compile(r"[+-]?[0-9]{1,4300}\Z")


@dataclass
class Metadata:
    """The parsed, validated ``.snapshot_metadata``: ``manifest`` maps ``RANK/logical/path`` to
    its entry (a plain dict)."""

    version: str
    world_size: int
    manifest: dict[str, dict]
    #: the snapshot, as error messages name it
    where: str = ""


def corrupt(where: str, what: str) -> SnapshotCorruptError:
    """The error of a damaged snapshot file or entry ``where``; its ``reason`` is ``what``."""
    error = SnapshotCorruptError(
        f"{where}: {what}: the snapshot is damaged or was not written by torchsnapshot or this "
        "plugin. Restore an older snapshot (restore_from_latest falls back to one by itself)"
    )
    error.reason = what  # type: ignore[attr-defined]
    return error


def escapes(rel: Any) -> bool:
    """Whether ``rel`` is not a plain relative path inside a snapshot: not a string, empty,
    absolute, with an empty, ``.`` or ``..`` component, a backslash or a NUL."""
    return (
        type(rel) is not str
        or not rel
        or rel[0] == "/"
        or "\\" in rel
        or "\x00" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    )


def _load(data: bytes, where: str) -> Any:
    if len(data) > MAX_METADATA_BYTES:
        raise corrupt(where, f"it is {len(data)} bytes, more than the {MAX_METADATA_BYTES} a metadata file may hold")
    try:
        return mesh_aliases.loads(data)
    except RecursionError:
        raise corrupt(where, "it is nested too deeply to be a snapshot's metadata") from None
    except mesh_aliases.UnknownMesh as exc:
        raise corrupt(where, str(exc)) from None
    except ValueError:
        pass
    try:  # older torchsnapshot releases wrote YAML (JSON is YAML, not the other way round)
        import yaml

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return yaml.load(data, Loader=loader)  # noqa: S506 - a safe loader
    except ImportError:
        raise corrupt(where, "it is not JSON (install PyYAML to read YAML metadata)") from None
    except RecursionError:
        raise corrupt(where, "it is nested too deeply to be a snapshot's metadata") from None
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise corrupt(where, f"it is neither JSON nor YAML ({first})") from None


def parse_metadata(data: bytes, where: str, shapes: Optional[dict[str, Any]] = None) -> Metadata:
    """The metadata of the snapshot at ``where`` (named in errors) from its bytes, every entry
    validated (see the module's docstring); SnapshotCorruptError otherwise. ``shapes``: the whole
    shape of each sharded tensor as the plugin's index records it (logical path -> shape), which
    the merged shards must tile."""
    fname = f"{where}/{METADATA_FNAME}"
    doc = _load(bytes(data), fname)
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict):
        raise corrupt(fname, "it holds no manifest")
    world_size = doc.get("world_size")
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise corrupt(fname, f"world_size is {world_size!r}, not a number of ranks from 1 to {MAX_WORLD_SIZE}")
    manifest = doc["manifest"]
    if len(manifest) > MAX_ENTRIES:
        raise corrupt(fname, f"it has {len(manifest)} entries, more than {MAX_ENTRIES}")
    validator = _Validator(fname, world_size)
    validator.run(manifest)
    validator.finish(shapes)
    return Metadata(str(doc.get("version", "")), world_size, manifest, where)


def rank_number(text: str, world_size: int) -> Optional[int]:
    """The rank a manifest path's first component names (decimal, no leading zero), if it is
    below ``world_size``; else None."""
    if not 0 < len(text) <= 7 or not text.isascii() or not text.isdigit() or (text[0] == "0" and text != "0"):
        return None
    rank = int(text)
    return rank if rank < world_size else None


class _Validator:
    """Checks every entry of a manifest once (:meth:`run`, the first problem raises), then what
    the entries make together (:meth:`finish`)."""

    def __init__(self, fname: str, world_size: int) -> None:
        self.fname = fname
        self.world_size = world_size
        self.ranks: dict[str, bool] = {}  # a path's first component -> names a rank
        self.inside: set[str] = set()  # locations already checked
        #: file -> every byte range read from it
        self.spans: dict[str, list[Span]] = {}
        #: sharded tensor (logical path) -> its records over every rank read
        self.shards: dict[str, _Sharded] = {}
        self.pieces_seen = 0
        self.piece: Any = None  # the identity of the piece being checked (see Span)
        self._checked: Any = None  # (spans, pieces, complete) when finish() last passed

    def fail(self, path: Any, what: str) -> SnapshotCorruptError:
        return corrupt(self.fname, f"entry {path!r}: {what}")

    def run(self, manifest: dict) -> None:
        ranks, tensor, check = self.ranks, self.tensor, self.entry
        for path, entry in manifest.items():
            if type(path) is not str:
                raise self.fail(path, "the path is not a string")
            rank, sep, logical = path.partition("/")
            named = ranks.get(rank)
            if named is None:
                named = ranks[rank] = rank_number(rank, self.world_size) is not None
            if not named or not sep or not logical:
                raise self.fail(path, f"the path names no rank below {self.world_size}")
            if path.count("/") > MAX_PATH_DEPTH:
                raise self.fail(path[:80] + "...", f"the path is more than {MAX_PATH_DEPTH} levels deep")
            if type(entry) is not dict:
                raise self.fail(path, "the entry is not a mapping")
            kind = entry.get("type")
            if kind == "Tensor":  # most entries
                tensor(path, entry)
            else:
                check(path, entry, kind)

    def entry(self, path: str, entry: dict, kind: Any) -> None:
        if type(kind) is not str:
            raise self.fail(path, f"unknown entry type {kind!r}")
        if kind in CONTAINER_TYPES:
            if kind != "list":
                keys = entry.get("keys")
                if type(keys) is not list or not all(type(k) in (str, int) for k in keys):
                    raise self.fail(path, f"a {kind} without a list of str or int keys")
        elif kind == "ChunkedTensor":
            shape = self.shape(path, entry.get("shape"), "shape")
            self.numel(path, shape, self.dtype(path, entry))
            chunks = self.pieces(path, entry, "chunks", len(shape), None, _Sharded(path, kind, entry["dtype"]))
            problem = tiling_problem(shape, chunks, "chunks")
            if problem is not None:
                raise self.fail(path, problem)
        elif kind in SHARDED_TYPES:  # a rank that holds no part of it records no shards
            logical = path.partition("/")[2]
            if kind == "DTensor" and _fully_replicated_dtensor(entry):
                logical = path  # one record of the whole tensor, not merged over ranks
            found = self.shards.get(logical)
            if found is None:
                found = self.shards[logical] = _Sharded(path, kind)
            elif found.kind != kind:
                raise self.fail(path, f"it is a {kind}, and a {found.kind} under {found.first!r}")
            found.boxes.extend(self.pieces(path, entry, "shards", None, logical, found))
        elif kind == OBJECT_TYPE:
            self.location(path, entry)
            if entry.get("serializer") != TORCH_SAVE:
                raise self.fail(path, f"unknown serializer {entry.get('serializer')!r}")
            self.byte_range(path, entry, None)
        elif kind in PRIMITIVE_TYPES:
            primitive_value(entry, path, self.fname)
        else:
            raise self.fail(path, f"unknown entry type {kind!r}")

    def tensor(self, path: str, entry: dict) -> None:
        dtype: Any = entry.get("dtype")
        itemsize = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise self.fail(path, f"unknown dtype {dtype!r}")
        shape = entry.get("shape")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise self.fail(path, f"its shape is {shape!r}")
        numel = 1
        for n in shape:
            if type(n) is not int or n < 0:
                raise self.fail(path, f"its shape is {shape!r}")
            numel *= n
        if numel > _NUMEL_CHECKED or (numel == 0 and any(n > MAX_INT64 for n in shape)):
            self.numel(path, self.shape(path, shape, "shape"), dtype)  # (rare: refused, or huge)
        rel = entry.get("location")
        if type(rel) is not str or rel not in self.inside:
            self.location(path, entry)
        serializer = entry.get("serializer")
        if serializer == RAW:
            if dtype not in RAW_DTYPE_NAMES:
                raise self.fail(path, f"a {dtype} tensor cannot be stored as raw bytes")
            self.byte_range(path, entry, numel * itemsize)
        elif serializer == TORCH_SAVE:
            self.byte_range(path, entry, None)
        else:
            raise self.fail(path, f"unknown serializer {serializer!r}")

    def numel(self, path: str, shape: list, dtype: str) -> int:
        """The elements of ``shape``; refused where they, or their bytes, overflow int64."""
        numel = volume(shape)
        if numel * DTYPE_SIZES[dtype] > MAX_INT64:
            raise self.fail(path, f"its shape {shape} holds more elements than a tensor can ({numel})")
        return numel

    def dtype(self, path: str, entry: dict) -> str:
        dtype = entry.get("dtype")
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise self.fail(path, f"unknown dtype {dtype!r}")
        return dtype

    def shape(self, path: str, value: Any, what: str) -> list:
        if (
            type(value) is not list
            or len(value) > MAX_NDIM
            or not all(type(n) is int and 0 <= n <= MAX_INT64 for n in value)
        ):
            raise self.fail(path, f"its {what} is {value!r}")
        return value

    def location(self, path: str, entry: dict) -> None:
        rel = entry.get("location")
        if type(rel) is str and rel in self.inside:
            return
        if escapes(rel):
            raise self.fail(path, f"its location {rel!r} is outside the snapshot directory")
        self.inside.add(rel)  # type: ignore[arg-type]

    def byte_range(self, path: str, entry: dict, nbytes: Optional[int]) -> None:
        """Check the entry's byte range against ``nbytes`` (its dtype and shape's; None: not
        known) and note the bytes it reads."""
        byte_range = entry.get("byte_range")
        if byte_range is None:
            span: Span = (0, WHOLE_FILE if nbytes is None else nbytes, path, self.piece)
        else:
            if type(byte_range) is not list or len(byte_range) != 2:
                raise self.fail(path, f"its byte range is {byte_range!r}")
            start, end = byte_range
            if type(start) is not int or type(end) is not int or not 0 <= start <= end <= MAX_INT64:
                raise self.fail(path, f"its byte range is {byte_range!r}")
            if nbytes is not None and end - start != nbytes:
                raise self.fail(
                    path, f"its byte range {byte_range} does not hold the {nbytes} bytes its dtype and shape take"
                )
            span = (start, end, path, self.piece)
        rel = entry["location"]
        spans = self.spans.get(rel)
        if spans is None:
            self.spans[rel] = [span]
        else:
            spans.append(span)

    def pieces(
        self, path: str, entry: dict, name: str, ndim: Optional[int], logical: Optional[str], whole: _Sharded
    ) -> list[Box]:
        """The (offsets, sizes) of each of the entry's pieces, each checked, all of one dtype
        (``whole``'s, once known); ``logical``: the sharded tensor they are shards of (identical
        shards of it may share their bytes)."""
        found = entry.get(name)
        if type(found) is not list:
            raise self.fail(path, f"its {name} are {found!r}")
        self.pieces_seen += len(found)
        if self.pieces_seen > MAX_ENTRIES:
            raise self.fail(path, f"the manifest has more than {MAX_ENTRIES} pieces (chunks and shards)")
        boxes: list[Box] = []
        for piece in found:
            if type(piece) is not dict or type(piece.get("tensor")) is not dict:
                raise self.fail(path, f"one of its {name} is not a piece with a tensor")
            offsets = self.shape(path, piece.get("offsets"), "offsets")
            sizes = self.shape(path, piece.get("sizes"), "sizes")
            if len(offsets) != len(sizes) or (ndim is not None and len(sizes) != ndim):
                raise self.fail(path, f"its {name} have different numbers of dimensions")
            if any(o + n > MAX_INT64 for o, n in zip(offsets, sizes, strict=True)):
                raise self.fail(path, f"one of its {name} ends past the largest tensor size")
            ndim = len(sizes)
            inner = piece["tensor"]
            if inner.get("type", "Tensor") != "Tensor":
                raise self.fail(path, f"one of its {name} holds a {inner.get('type')!r}, not a tensor")
            box = (tuple(offsets), tuple(sizes))
            self.piece = None if logical is None else (logical, box)
            try:
                self.tensor(path, inner)
            finally:
                self.piece = None
            if inner.get("shape") != sizes:
                raise self.fail(path, f"a piece of sizes {sizes} holds a tensor of shape {inner.get('shape')}")
            if whole.dtype is None:
                whole.dtype = inner["dtype"]
            elif inner["dtype"] != whole.dtype:
                raise self.fail(path, f"one of its {name} is {inner['dtype']}, the tensor {whole.dtype}")
            boxes.append(box)
        return boxes

    def finish(self, shapes: Optional[dict[str, Any]] = None, complete: bool = True) -> None:
        """Check what the entries run so far make together: no two read overlapping bytes of a
        file, and the shards of each sharded tensor tile it (its shape from ``shapes``, the
        index's record, where it has it; else their extent). ``complete``: every rank's records
        were run; else (a view read by rank) shards must lie inside the recorded shape without
        overlapping, and a tensor whose shape is not recorded waits for the rest."""
        state = (sum(map(len, self.spans.values())), self.pieces_seen, complete)
        if state == self._checked:
            return
        for rel, spans in self.spans.items():
            if len(spans) > 1:
                problem = overlap_problem(rel, spans)
                if problem is not None:
                    raise corrupt(self.fname, problem)
        for logical, sharded in self.shards.items():
            first, boxes = sharded.first, sharded.boxes
            if not boxes:
                continue
            recorded = shapes.get(logical) if shapes is not None and logical != first else None
            if recorded is not None:
                shape = recorded
            elif complete:
                shape = [max(box[0][d] + box[1][d] for box in boxes) for d in range(len(boxes[0][1]))]
            else:
                continue
            problem = tiling_problem(shape, boxes, "shards over all ranks" if logical != first else "shards", exact=complete)
            if problem is not None:
                raise self.fail(first, problem)
        self._checked = state


class _Sharded:
    """The records of one tensor saved in pieces: the first path recording it, its kind, its
    dtype (once a piece says it) and the (offsets, sizes) of every piece read."""

    __slots__ = ("first", "kind", "dtype", "boxes")

    def __init__(self, first: str, kind: str, dtype: Optional[str] = None) -> None:
        self.first, self.kind, self.dtype = first, kind, dtype
        self.boxes: list[Box] = []


def primitive_value(entry: dict, path: str = "", where: str = "") -> Any:
    """The value of a primitive entry (``int``, ``float``, ``str``, ``bool``, ``bytes``);
    SnapshotCorruptError if it does not decode."""
    kind, text = entry.get("type"), entry.get("serialized_value")
    if type(text) is not str:
        raise corrupt(where or "the manifest", f"entry {path!r}: its serialized value is {text!r}")
    try:
        if kind == "str":
            return text
        if kind == "int":
            if not _INT_TEXT.match(text):
                raise ValueError(text)
            return int(text)
        if kind == "bool":
            if text not in ("True", "False"):
                raise ValueError(text)
            return text == "True"
        if kind == "bytes":
            return base64.b64decode(text, validate=True)
        if kind == "float":
            return struct.unpack("d", base64.b64decode(text, validate=True))[0]
    except (ValueError, binascii.Error, struct.error):
        raise corrupt(where or "the manifest", f"entry {path!r}: its {kind} value {text[:80]!r} cannot be decoded") from None
    raise corrupt(where or "the manifest", f"entry {path!r}: {kind!r} is not a primitive type")


def locations(entry: dict) -> Iterator[tuple[str, Optional[list[int]]]]:
    """(file, byte range or None) of every payload a validated entry reads."""
    rel = entry.get("location")
    if rel is not None:
        yield rel, entry.get("byte_range")
    for piece in entry.get("shards") or entry.get("chunks") or ():
        yield from locations(piece["tensor"])


def global_shape(entry: dict) -> Optional[list[int]]:
    """A tensor entry's whole shape: its own, or the extent of its shards; None for others."""
    shape = entry.get("shape")
    if shape is not None:
        return list(shape)
    whole = entry.get(GLOBAL_SHAPE)  # a view read by rank (read_for_rank): from the index
    if whole is not None:
        return list(whole)
    shards = entry.get("shards")
    if not shards:
        return None
    return [max(s["offsets"][d] + s["sizes"][d] for s in shards) for d in range(len(shards[0]["sizes"]))]


def _dtype_of(entry: dict) -> Optional[str]:
    dtype = entry.get("dtype")
    if dtype is None:
        for piece in entry.get("shards") or entry.get("chunks") or ():
            dtype = piece["tensor"].get("dtype")
            break
    return dtype.replace("torch.", "") if isinstance(dtype, str) else None


def describe(entry: dict) -> EntryInfo:
    """The typed facts of a validated entry."""
    kind = entry["type"]
    if kind == "Tensor":  # most entries: one location
        rel, byte_range = entry["location"], entry.get("byte_range")
        return EntryInfo(
            "tensor", kind, dtype=entry["dtype"][6:], shape=entry["shape"],
            nbytes=None if byte_range is None else byte_range[1] - byte_range[0],
            locations=[(rel, byte_range)], replicated=entry.get("replicated") is True,
        )
    if kind in CONTAINER_TYPES:
        return EntryInfo("container", kind)
    locs = list(locations(entry))
    nbytes: Optional[int] = 0
    for _rel, byte_range in locs:
        if byte_range is None:
            nbytes = None
            break
        nbytes += byte_range[1] - byte_range[0]  # type: ignore[operator]
    if kind in PRIMITIVE_TYPES:
        value = primitive_value(entry)
        return EntryInfo(
            "value", kind, dtype=kind, value=value, nbytes=len(entry["serialized_value"]),
            replicated=entry.get("replicated") is True,
        )
    if kind == OBJECT_TYPE:
        obj_type = entry.get("obj_type")
        return EntryInfo(
            "object", kind, dtype=obj_type if isinstance(obj_type, str) else None, nbytes=nbytes, locations=locs,
            replicated=entry.get("replicated") is True,
        )
    return EntryInfo(
        "sharded" if kind in SHARDED_TYPES else "tensor",
        kind,
        dtype=_dtype_of(entry),
        shape=global_shape(entry),
        nbytes=nbytes,
        locations=locs,
        replicated=entry.get("replicated") is True,
    )


# ---------------------------------------------------------------------------------------------
# The view of one rank


def _fully_replicated_dtensor(entry: dict) -> bool:
    dim_map = entry.get("dim_map")
    return isinstance(dim_map, list) and all(isinstance(d, list) and d[:1] == [-1] for d in dim_map)


def _merge_sharded(entries: list[dict]) -> dict:
    """One sharded entry holding the shards of every rank's entry, sorted by offsets; shards
    written by several replicas of a DTensor (same offsets and sizes) kept once."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    shards = []
    for entry in entries:
        for shard in entry.get("shards") or ():
            box = (tuple(shard["offsets"]), tuple(shard["sizes"]))
            if box not in seen:
                seen.add(box)
                shards.append(shard)
    shards.sort(key=lambda shard: list(shard["offsets"]))
    merged = {k: v for k, v in entries[0].items() if k != "shards"}
    merged["shards"] = shards
    return merged


def rank_view(meta: Metadata, rank: int) -> dict[str, dict]:
    """Logical path (``KEY/sub/path``) -> the entry ``rank`` restores.

    A rank of the saving world gets its own entries, rank 0's replicated ones (written once, under
    rank 0) and every sharded entry merged over the ranks. A rank beyond the saving world gets
    rank 0's containers, the replicated entries and the sharded ones, as torchsnapshot gives it.
    """
    mine = str(rank)
    own: dict[str, dict] = {}
    shared: dict[str, dict] = {}  # rank 0's containers and replicated entries
    sharded: dict[str, list[dict]] = {}
    for path, entry in meta.manifest.items():
        owner, _, logical = path.partition("/")
        kind = entry["type"]
        if kind in SHARDED_TYPES and not (kind == "DTensor" and _fully_replicated_dtensor(entry)):
            sharded.setdefault(logical, []).append(entry)
            continue
        if owner == mine:
            own[logical] = entry
        if owner == "0" and (  # a DTensor here is a fully replicated one
            kind in CONTAINER_TYPES or entry.get("replicated") is True or kind == "DTensor"
        ):
            shared[logical] = entry
    if rank < meta.world_size:
        for logical, entry in shared.items():
            if entry["type"] not in CONTAINER_TYPES:
                own[logical] = entry
        view = own
    else:
        view = shared
    for logical, group in sharded.items():
        view[logical] = _merge_sharded(group)
    return view


def saved_keys(view: dict[str, dict]) -> set[str]:
    """The app-state keys (decoded) that ``view`` holds entries for."""
    from urllib.parse import unquote

    return {unquote(path.partition("/")[0]) for path in view}


__all__ = [
    "CONTAINER_TYPES", "DTYPE_SIZES", "EntryInfo", "KNOWN_TYPES", "MAX_NDIM", "MAX_WORLD_SIZE", "Metadata", "OBJECT_TYPE",
    "PRIMITIVE_TYPES", "RAW", "SHARDED_TYPES", "TENSOR_TYPES", "TORCH_SAVE", "corrupt", "describe",
    "escapes", "global_shape", "locations", "parse_metadata", "primitive_value", "rank_view",
    "rank_number", "saved_keys", "GLOBAL_SHAPE",
]
