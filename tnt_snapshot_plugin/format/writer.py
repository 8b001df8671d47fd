"""Write state dicts in torchsnapshot's on-disk format, without torchsnapshot.

The writer turns each rank's state into manifest records (each one entry of torchsnapshot's
schema, as its JSON text) and payloads (byte buffers to write to files); the caller writes the
payloads, gathers every rank's records on rank 0 (:func:`merge`) and writes ``.snapshot_metadata``
(:func:`metadata_bytes`) last. Stock torchsnapshot restores what it writes.

Records are JSON text (a str is not tracked by Python's garbage collector) and buffers numpy
arrays (``common.flat_bytes``: one tracked object a tensor): a snapshot of 10,000 tensors holds
10,000 of each until it is written, and as dicts and memoryviews (about seven tracked objects a
tensor) they set off a full collection of the training process's heap in most snapshots. A
pack whose tensors lie end to end in memory (an asynchronous snapshot's staging arena) is one
buffer, not one a tensor (:func:`byte_runs`); a reused plan copies a pack of tensors that lie
apart (a synchronous snapshot's model parameters) into one reused buffer (:class:`PackBuffer`).
The choices, where the format leaves room:

* **Paths.** :func:`flatten` builds logical paths exactly as torchsnapshot's ``flatten`` does:
  lists and dicts/OrderedDicts whose keys are all ``str``/``int`` with distinct ``str()`` are
  containers; anything else (tuples, sets, dicts with other keys, dict subclasses) is one value.
* **Files.** Everything rank R writes lives under ``R/`` or in ``batched/R-N``, so no two ranks
  ever write the same file. Small tensors (below ``pack_bytes``) are packed end to end into
  ``batched/R-N`` files of about ``pack_bytes`` (``byte_range`` says where); a larger tensor or an
  object gets a file of its own at ``R/<logical path>``, a shard at ``R/<logical path>/shard_<offsets>``.
  Path components the filesystem would read as navigation (``""``, ``"."``, ``".."``), NUL bytes,
  and components too long for a file name are rewritten into names ``encode`` never produces, so a
  location never leaves the snapshot directory and two values never share a file.
* **Bytes.** Tensors of the raw dtypes (``common.RAW_DTYPES``) are stored as their bytes,
  zero-copy over CPU contiguous tensors (GPU and non-contiguous tensors are copied first). Other
  dtypes (complex, quantized) and empty tensors are ``torch.save``'d: stock torchsnapshot cannot
  rebuild an empty tensor from zero raw bytes. Objects are ``torch.save``'d to a file of their
  own; ``int``/``str``/``bool``/``bytes``/``float`` (exact types) are stored inline in the manifest.
  An ``int`` too long for ``str()`` (over ``sys.get_int_max_str_digits()`` digits, 4300 by default)
  is refused with UnrestorableStateError: restore could read it back neither as text nor pickled.
* **Replicated values** (logical paths the caller says every rank holds identically) are recorded
  once, under ``0/``: every rank computes the same assignment of writers from its own leaves
  (largest first, ties by path, each to the least loaded rank) and only the assigned rank writes
  the bytes and emits the record.
* **ShardedTensor / DTensor**: each rank records its own local shards. A DTensor shard held by
  several ranks (a replica group) is written by one of them, chosen from the path alone, and every
  rank of the group records the same location; a fully replicated DTensor is recorded once, under ``0/``.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import heapq
import io
import json
import re
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, eq
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..errors import ConfigError, SnapshotError, UnrestorableStateError
from .common import DTYPE_NAMES, FORMAT_VERSION, RAW, RAW_DTYPES, TORCH_SAVE, encode, flat_bytes

#: What a replicated object is assumed to cost when spreading replicated writes over the ranks
#: (its size is only known once it is serialized, and every rank must agree without serializing).
NOMINAL_OBJECT_BYTES = 1024

#: A path component longer than this (in UTF-8 bytes) is shortened to stay a valid file name.
MAX_COMPONENT_BYTES = 200

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_PRIMITIVES = {int: "int", str: "str", bool: "bool", bytes: "bytes", float: "float"}

#: A str as a JSON string literal, non-ASCII kept as is (``json.dumps(text, ensure_ascii=False)``,
#: in C, without the call's overhead: it runs once per entry).
_json_str = json.encoder.encode_basestring  # type: ignore[attr-defined]


def _text(record: Mapping[str, Any]) -> str:
    """A manifest record as JSON text (as :func:`metadata_bytes` writes it)."""
    return json.dumps(record, ensure_ascii=False)


# --- flatten ----------------------------------------------------------------------------------


def flatten(key: str, state_dict: Any) -> tuple[dict[str, dict], dict[str, Any]]:
    """Split ``state_dict`` (saved under app-state ``key``) into its containers and its leaves.

    Returns ``(containers, leaves)``: logical path -> container record (``{"type": "dict",
    "keys": [...]}``, ``"OrderedDict"`` likewise, ``{"type": "list"}``) and logical path -> value.
    Paths are ``KEY/sub/...`` with the key and every dict key ``encode``d, list items by index,
    exactly as torchsnapshot's ``flatten`` builds them."""
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    _flatten_into(state_dict, encode(key), containers, leaves)
    return containers, leaves


def _flatten_into(value: Any, path: str, containers: dict[str, dict], leaves: dict[str, Any]) -> None:
    kind = type(value)
    if kind is list:
        containers[path] = {"type": "list"}
        for index, item in enumerate(value):
            _flatten_into(item, f"{path}/{index}", containers, leaves)
    elif (kind is dict or kind is OrderedDict) and _is_flattenable(value):
        containers[path] = {"type": "dict" if kind is dict else "OrderedDict", "keys": list(value)}
        for name, item in value.items():
            sub = f"{path}/{encode(name if type(name) is str else str(name))}"
            if type(item) in _CONTAINERS:
                _flatten_into(item, sub, containers, leaves)
            else:  # a leaf (most of a state: its tensors), without a call of its own
                leaves[sub] = item
    else:
        leaves[path] = value


_CONTAINERS = frozenset((list, dict, OrderedDict))
_STR_ONLY = frozenset((str,))


def _is_flattenable(mapping: Mapping[Any, Any]) -> bool:
    """A dict is a container when its keys are str/int with distinct ``str()`` (else one object)."""
    if set(map(type, mapping)) == _STR_ONLY:
        return True  # distinct keys of type str are their own distinct str()
    if not all(isinstance(name, (str, int)) for name in mapping):
        return False
    return len({str(name) for name in mapping}) == len(mapping)


# --- replicated values ------------------------------------------------------------------------


def replicable(leaves: Mapping[str, Any], patterns: Sequence[str]) -> list[str]:
    """The logical paths of ``leaves`` that match a glob of ``patterns`` (``fnmatch``, as
    torchsnapshot) and are not sharded. The caller gathers these from every rank and passes the
    paths every rank has to :func:`plan` as ``replicated``."""
    if not patterns:
        return []
    matched: set[str] = set()
    for pattern in patterns:
        matched.update(fnmatch.filter(leaves, pattern))
    return [path for path in leaves if path in matched and not _is_sharded(leaves[path])]


def _is_sharded(value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or type(value) in _PLAIN_TENSOR_TYPES:
        return False
    sharded_tensor, dtensor, shard = _distributed_types()
    if sharded_tensor is not None and isinstance(value, sharded_tensor):
        return True
    if dtensor is not None and isinstance(value, dtensor):
        return any(isinstance(p, shard) for p in value.placements)
    return False


def _replicated_writers(leaves: Mapping[str, Any], replicated: Set[str], world_size: int) -> dict[str, int]:
    """Logical path -> the rank that writes it, for every replicated leaf. Deterministic: every
    rank holds the same replicated leaves, so every rank computes the same answer."""
    costs = sorted(
        (-_write_cost(leaves[path]), path)
        for path in replicated
        if path in leaves and not _is_sharded(leaves[path])  # a sharded value is never replicated
    )
    loads = [(0, rank) for rank in range(world_size)]  # a heap: the least loaded rank, lowest first
    writers: dict[str, int] = {}
    for negative_cost, path in costs:
        load, rank = loads[0]
        writers[path] = rank
        heapq.heapreplace(loads, (load - negative_cost, rank))
    return writers


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write_cost(value: Any) -> int:
    if type(value) in _PRIMITIVES:
        return 0
    if isinstance(value, torch.Tensor):
        return _nbytes(value)
    return NOMINAL_OBJECT_BYTES


# --- plan -------------------------------------------------------------------------------------


@dataclass
class Payload:
    """One file to write: ``rel`` (relative to the snapshot directory, ``/``-separated) holds the
    concatenation of ``views``: flat byte buffers (``uint8`` numpy arrays over tensors, which keep
    their memory alive, or memoryviews over serialized bytes), each with ``nbytes``.

    A pack's views are its tensors, one each; or, where tensors lie end to end in memory (an
    asynchronous snapshot's staging arena), runs of several, and ``bounds`` then says where each
    tensor ends in the file (``[0, end_1, ..., end_n]``)."""

    rel: str
    views: list[Any]
    bounds: Optional[list[int]] = None

    @property
    def packed(self) -> bool:
        """Whether the file holds several tensors (each read, and verified, on its own)."""
        return self.bounds is not None or len(self.views) > 1


@dataclass
class Plan:
    """What one rank writes: its manifest records (full paths ``RANK/...``, and ``0/...`` for the
    replicated values it writes; each record as JSON text, ``json.loads`` gives the dict), its
    payloads (none when they were handed to ``emit`` as they were completed), and their total
    size in bytes."""

    entries: dict[str, str]
    payloads: list[Payload]
    nbytes: int


def plan(
    containers: Mapping[str, dict],
    leaves: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    replicated: Set[str],
    pack_bytes: int = 4 << 20,
    emit: Optional[Callable[[Payload], None]] = None,
    cache: Optional[PlanCache] = None,
    pack_buffer: Optional[PackBuffer] = None,
) -> Plan:
    """This rank's manifest records and payloads for ``containers`` and ``leaves`` (from
    :func:`flatten`, every app-state key together: one plan per rank per snapshot).

    ``replicated``: the logical paths every rank holds identically (the same set on every rank);
    they are recorded once, under ``0/``, by the rank assigned to write them. ``pack_bytes``: tensors
    smaller than this are packed into shared files of about this size (0: no packing).
    ``emit``: given each payload as soon as it is complete (a file of its own at once, a pack
    when the next one starts, the last pack at the end), so that the caller can write it while
    the rest is planned; the plan's ``payloads`` are then empty.
    ``cache``: a :class:`PlanCache` kept from one snapshot to the next (the tensors' records and
    files are reused while the state's layout is unchanged). ``pack_buffer``: where a reused
    plan gathers each pack whose tensors lie apart in memory (:class:`PackBuffer`); only for an
    ``emit`` that is done with a payload's bytes when it returns.
    Raises :class:`~tnt_snapshot_plugin.errors.ConfigError` for a value the format cannot hold
    (payloads already emitted are the caller's to wait for)."""
    builder = _Builder(rank, pack_bytes, emit)
    builder.pack_buffer = pack_buffer
    for path, record in containers.items():
        builder.entries[f"{rank}/{path}"] = _text(record)
    if cache is not None and not replicated:
        if cache.reuse(builder, leaves):
            return builder.finish()
        builder.recorder = _Recorder()
    writers = _replicated_writers(leaves, replicated, world_size) if replicated else {}
    for path, value in leaves.items():
        writer = writers.get(path)
        if writer is None:
            builder.add(path, f"{rank}/{path}", value, False)
        elif writer == rank:
            builder.add(path, f"0/{path}", value, True)
    done = builder.finish()
    if cache is not None:
        cache.keep(builder, leaves)
    return done


# --- reusing a plan ---------------------------------------------------------------------------

_DTYPE, _SHAPE, _IS_CPU = attrgetter("dtype"), attrgetter("shape"), attrgetter("is_cpu")
_DATA_PTR = torch.Tensor.data_ptr


class _Recorder:
    """What each tensor of a plan became (filled by the builder as it plans), for PlanCache."""

    def __init__(self) -> None:
        #: logical path -> record (JSON text), for every tensor, in the order of the leaves
        self.records: dict[str, str] = {}
        #: ... and their manifest paths (the builder's own str objects), in the same order
        self.manifest_paths: list[str] = []
        #: the files holding them (in the order each was first used) -> the logical paths of
        #: their tensors, in the order of their bytes (a pack stays open past a file of its own)
        self.files: dict[str, list[str]] = {}
        #: whether every tensor can be planned again from this (CPU, contiguous, raw bytes)
        self.reusable = True


@dataclass
class _PlanLayout:
    """A plan's tensor layout: what a later state must match for its records to be reused."""

    key: tuple[int, int]  # (rank, pack_bytes)
    paths: tuple[str, ...]  # every leaf's logical path, in order
    types: list[type]  # every leaf's type
    tensor_paths: tuple[str, ...]  # the tensors' logical paths
    manifest_paths: tuple[str, ...]  # ... and manifest paths
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    records: tuple[str, ...]
    #: each file, its tensors' logical paths, and for a pack of several their sizes in bytes
    #: (numpy) and where each ends in the file (``Payload.bounds``)
    files: list[tuple[str, list[str], Optional[np.ndarray], Optional[list[int]]]]
    #: per file: whether no two of its tensors lay end to end in memory last time (a model's own
    #: parameters): then only its first two are looked at, unless they are end to end now
    apart: list[bool]
    #: per pack: how PackBuffer.gather copies it (its runs of one dtype), or None (not gathered)
    segments: list[Optional[list[_Segment]]]
    others: list[str]  # the leaves that are not tensors (planned again every time)


def byte_runs(tensors: list[torch.Tensor], sizes: np.ndarray) -> list[np.ndarray]:
    """Flat byte views of ``tensors`` (CPU, contiguous, of raw dtypes, ``sizes`` bytes each),
    in order, with one view for each run of tensors that lie end to end in one storage (an
    asynchronous snapshot's staging arena: a pack of them is then one buffer to hash and write,
    not a numpy array a tensor) and one per tensor elsewhere (a model's own parameters)."""
    runs = _runs(tensors, sizes)
    return [flat_bytes(t) for t in tensors] if runs is None else _run_views(tensors, *runs)


def _runs(tensors: list[torch.Tensor], sizes: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, list[int]]]:
    """Where ``tensors`` start and end in memory and where each run of them that lie end to
    end begins (``byte_runs``); None when no two do (a model's own parameters). About 0.2 us a
    tensor (one ``data_ptr()`` call each), where a view costs 1.2."""
    starts = np.fromiter(map(_DATA_PTR, tensors), dtype=np.int64, count=len(tensors))
    ends = starts + sizes
    cuts = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()  # where a new run begins
    return None if len(cuts) == len(tensors) - 1 else (starts, ends, cuts)


def _run_views(tensors: list[torch.Tensor], starts: np.ndarray, ends: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    views: list[np.ndarray] = []
    for first, stop in zip([0, *cuts], [*cuts, len(tensors)], strict=True):
        span = None if stop - first == 1 else _span(tensors[first], int(ends[stop - 1] - starts[first]))
        views.extend([flat_bytes(t) for t in tensors[first:stop]] if span is None else [span])
    return views


def _span(tensor: torch.Tensor, nbytes: int) -> Optional[np.ndarray]:
    """The ``nbytes`` bytes of memory from ``tensor``'s first one, as a flat ``uint8`` numpy
    array over its storage (kept alive by it); None if they run past the end of the storage."""
    storage = tensor.untyped_storage()
    offset = tensor.data_ptr() - storage.data_ptr()
    if offset + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,), (1,)).numpy()


class PlanCache:
    """The tensors' manifest records and files of the last plan, reused by the next plan while
    the state's layout is the same: the same leaves in the same order, of the same types, every
    tensor a CPU contiguous one of the same dtype and shape (checked in a few passes in C, about
    0.2 us a tensor). A snapshot of an unchanged layout then only hands out the tensors' new
    bytes: a view of each run of them that lie end to end in memory (:func:`byte_runs`), a
    pack of them that lie apart copied into the ``PackBuffer`` where the plan has one, or else
    a view a tensor; other leaves (numbers, objects) are planned again every time.

    A state with sharded tensors, GPU or non-contiguous tensors, tensors stored with
    ``torch.save`` (empty ones, other dtypes), or replicated values is planned in full every time.
    One cache per writer (per rank), used by one plan at a time."""

    def __init__(self) -> None:
        self._layout: Optional[_PlanLayout] = None
        #: plans that reused the last one, and plans made in full (tests and benchmarks read them)
        self.hits = 0
        self.misses = 0
        #: packs of a reused plan handed out as fewer views than tensors (``byte_runs``), and
        #: gathered into the plan's PackBuffer
        self.runs = 0
        self.gathered = 0

    def clear(self) -> None:
        self._layout = None

    def reuse(self, builder: _Builder, leaves: Mapping[str, Any]) -> bool:
        """Plan ``leaves`` into ``builder`` from the last layout, if it still holds."""
        layout = self._layout
        if (
            layout is None
            or layout.key != (builder.rank, builder.pack_bytes)
            or len(leaves) != len(layout.paths)
            or tuple(leaves) != layout.paths
            or list(map(type, leaves.values())) != layout.types
        ):
            self.misses += 1
            return False
        tensors = list(map(leaves.__getitem__, layout.tensor_paths))
        if (
            list(map(_DTYPE, tensors)) != layout.dtypes
            or not all(map(eq, map(_SHAPE, tensors), layout.shapes))  # one torch.Size at a time
            or not all(map(_IS_CPU, tensors))
            or not all(map(torch.Tensor.is_contiguous, tensors))
        ):
            self.misses += 1
            return False
        self.hits += 1
        apart, gather = layout.apart, builder.pack_buffer
        for i, (rel, paths, sizes, bounds) in enumerate(layout.files):  # each to the writer when ready
            if sizes is None:
                builder.add_file(rel, [flat_bytes(leaves[path]) for path in paths])
                continue
            tensors = list(map(leaves.__getitem__, paths))
            if apart[i] and tensors[0].data_ptr() + int(sizes[0]) != tensors[1].data_ptr():
                runs = None  # apart last time, and still (only the first two looked at)
            else:
                runs = _runs(tensors, sizes)
                apart[i] = runs is None
            if runs is not None:
                builder.add_file(rel, _run_views(tensors, *runs), bounds)  # bounds: views are runs
                self.runs += 1
            elif gather is not None and (segments := layout.segments[i]) is not None and bounds is not None:
                # copied into one buffer: a call in C a dtype, where a view a tensor is a call each
                builder.add_file(rel, [gather.gather(tensors, segments, bounds)], bounds)
                self.gathered += 1
            else:
                builder.add_file(rel, list(map(flat_bytes, tensors)))
        builder.entries.update(zip(layout.manifest_paths, layout.records, strict=True))
        rank = builder.rank
        for path in layout.others:
            builder.add(path, f"{rank}/{path}", leaves[path], False)
        return True

    def keep(self, builder: _Builder, leaves: Mapping[str, Any]) -> None:
        """Remember the plan ``builder`` just made of ``leaves`` (if it can be reused)."""
        recorder = builder.recorder
        if recorder is None or not recorder.reusable:
            self._layout = None
            return
        records = recorder.records
        tensor_paths = tuple(records)
        tensors = [leaves[path] for path in tensor_paths]
        files: list[tuple[str, list[str], Optional[np.ndarray], Optional[list[int]]]] = []
        segments: list[Optional[list[_Segment]]] = []
        distinct: dict[torch.Size, torch.Size] = {}  # one torch.Size object of each shape is kept
        for rel, paths in recorder.files.items():
            if len(paths) == 1:
                files.append((rel, paths, None, None))
                segments.append(None)
                continue
            packed = [leaves[path] for path in paths]
            sizes = np.array([_nbytes(t) for t in packed], dtype=np.int64)
            bounds = [0, *np.cumsum(sizes).tolist()]
            files.append((rel, paths, sizes, bounds))
            segments.append(_segments(packed, bounds))
        self._layout = _PlanLayout(
            key=(builder.rank, builder.pack_bytes),
            paths=tuple(leaves),
            types=list(map(type, leaves.values())),
            tensor_paths=tensor_paths,
            manifest_paths=tuple(recorder.manifest_paths),
            dtypes=list(map(_DTYPE, tensors)),
            shapes=[distinct.setdefault(shape, shape) for shape in map(_SHAPE, tensors)],
            records=tuple(records.values()),
            files=files,
            apart=[False] * len(files),
            segments=segments,
            others=[path for path in leaves if path not in records],
        )


class PackBuffer:
    """One buffer, reused from pack to pack and from snapshot to snapshot, that a reused plan
    copies each pack of tensors lying apart in memory (a synchronous snapshot's model
    parameters) into with one ``torch.cat``: a flat view a tensor costs a Python call each
    (about 1.2 us), the copy about 0.4 us a tensor and one buffer to hash and write. A pack's
    bytes are only valid until the next pack is gathered: for a writer whose payloads are
    written (local disk: into the page cache) before the next one is planned. It grows to the
    largest pack (at most ``pack_bytes``); the writer lets it go at train end."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        self._bytes: Optional[np.ndarray] = None

    def gather(self, tensors: list[torch.Tensor], segments: list[_Segment], bounds: list[int]) -> np.ndarray:
        """``tensors`` (CPU, contiguous; tensor i ends at byte ``bounds[i + 1]``) end to end, as
        a flat ``uint8`` numpy view of the buffer; ``segments`` (:func:`_segments`) cover them."""
        nbytes = bounds[-1]
        if self._buffer is None or self._buffer.numel() < nbytes:
            with torch.inference_mode(False):  # copied into again outside inference mode too
                self._buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._bytes = self._buffer.numpy()
        assert self._bytes is not None
        buffer = self._buffer
        with torch.no_grad():
            for first, stop, dtype, flat in segments:
                part = tensors[first:stop]
                out = buffer[bounds[first]:bounds[stop]].view(dtype)
                torch.cat(part if flat else [t.reshape(-1) for t in part], out=out)
        return self._bytes[:nbytes]


#: tensors ``[first, stop)`` of a pack: of one dtype, and whether all 1-D
_Segment = tuple[int, int, torch.dtype, bool]

#: a pack is gathered when it has at most one run of one dtype per this many tensors (a
#: gather costs about 2.5 us a run, a view about 1 us a tensor)
_TENSORS_PER_SEGMENT = 4


def _segments(tensors: list[torch.Tensor], bounds: list[int]) -> Optional[list[_Segment]]:
    """A pack's runs of tensors of one dtype (PackBuffer.gather copies each with one call);
    None where that would not pay (about a run a tensor) or a run does not start at a multiple
    of its element size (its bytes cannot be viewed as its dtype in place)."""
    out: list[_Segment] = []
    first = 0
    for i in range(1, len(tensors) + 1):
        if i == len(tensors) or tensors[i].dtype != tensors[first].dtype:
            part = tensors[first:i]
            if bounds[first] % part[0].element_size():
                return None
            out.append((first, i, part[0].dtype, all(t.dim() == 1 for t in part)))
            first = i
    return out if len(out) * _TENSORS_PER_SEGMENT <= len(tensors) else None


class _Builder:
    """Collects one rank's records and payloads, packing small tensors as it goes."""

    def __init__(self, rank: int, pack_bytes: int, emit: Optional[Callable[[Payload], None]]) -> None:
        self.rank = rank
        self.pack_bytes = pack_bytes
        self.entries: dict[str, str] = {}
        self.payloads: list[Payload] = []
        #: a complete payload goes to ``emit`` (written at once), or else to ``payloads``
        self._emit = emit if emit is not None else self.payloads.append
        self._files = 0  # payloads so far (names the packs)
        self.nbytes = 0
        #: set by plan() when a PlanCache is to learn this plan
        self.recorder: Optional[_Recorder] = None
        #: set by plan(): where a reused plan gathers packs of tensors apart in memory
        self.pack_buffer: Optional[PackBuffer] = None
        self._pack: Optional[Payload] = None
        self._pack_size = 0
        self._pack_location = ""  # the pack's rel as a JSON string literal
        self._last_rel = ""  # the file the last tensor went to
        #: shape -> its JSON text (a model has few distinct shapes; formatting one costs microseconds)
        self._shapes: dict[tuple[int, ...], str] = {}

    def finish(self) -> Plan:
        if self._pack is not None:
            self._emit(self._pack)
            self._pack = None
        return Plan(self.entries, self.payloads, self.nbytes)

    def add(self, path: str, manifest_path: str, value: Any, replicated: bool) -> None:
        kind = type(value)
        if kind is torch.Tensor and value.layout is _STRIDED:
            text = self.entries[manifest_path] = self.tensor(path, value, None, replicated)
            if self.recorder is not None:
                self._record(path, manifest_path, value, text)
        elif kind in _PRIMITIVES:
            try:
                record = _primitive_record(_PRIMITIVES[kind], value, replicated)
            except ValueError as exc:  # an int too long for str() (sys.get_int_max_str_digits)
                raise _int_too_long(path, value) from exc
            self.entries[manifest_path] = _text(record)
        elif isinstance(value, torch.Tensor) and _is_distributed(value):
            self._not_reusable()
            self.add_distributed(path, manifest_path, value, replicated)
        elif kind is torch.nn.Parameter or (isinstance(value, torch.Tensor) and value.layout is not _STRIDED):
            # A Parameter (its type and requires_grad) and a sparse tensor (COO, CSR, CSC, BSR,
            # BSC) are stored whole with torch.save, which keeps what raw bytes cannot.
            self._not_reusable()
            self.entries[manifest_path] = _text(self.object(path, _whole_tensor(value), replicated))
        elif isinstance(value, torch.Tensor):
            self._not_reusable()
            self.entries[manifest_path] = self.tensor(path, value, None, replicated)
        else:
            self.entries[manifest_path] = _text(self.object(path, value, replicated))

    def add_file(self, rel: str, views: list[Any], bounds: Optional[list[int]] = None) -> None:
        """A file of ``views``, laid out by an earlier plan (PlanCache); ``bounds``: a pack's,
        where its views are runs of several tensors (``Payload.bounds``)."""
        self._files += 1
        self.nbytes += sum(v.nbytes for v in views)
        self._emit(Payload(rel, views, bounds))

    def _record(self, path: str, manifest_path: str, tensor: torch.Tensor, text: str) -> None:
        """Tell the recorder where the plain tensor at ``path``, just planned, went."""
        recorder = self.recorder
        assert recorder is not None
        if not (tensor.is_cpu and tensor.is_contiguous() and tensor.dtype in RAW_DTYPES and tensor.numel()):
            recorder.reusable = False  # planned in full every time: a copy, or torch.save bytes
            return
        recorder.records[path] = text
        recorder.manifest_paths.append(manifest_path)
        recorder.files.setdefault(self._last_rel, []).append(path)

    def _not_reusable(self) -> None:
        if self.recorder is not None:
            self.recorder.reusable = False

    # -- tensors

    def tensor(
        self, path: str, tensor: torch.Tensor, own_rel: Optional[str], replicated: bool, pack: bool = True
    ) -> str:
        """The record (JSON text) of a dense tensor; its bytes go to a pack, or to ``own_rel``
        (default: the file of ``path`` under this rank's directory)."""
        dtype_name = DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise ConfigError(
                f"{path!r}: tensors of dtype {tensor.dtype} cannot be saved in torchsnapshot's format "
                f"(it knows {', '.join(sorted(DTYPE_NAMES.values()))}); convert the tensor in the "
                "state_dict (e.g. .to(torch.float32)) or store it as another type."
            )
        shape = self._shapes.get(tensor.shape)
        if shape is None:
            shape = self._shapes[tensor.shape] = json.dumps(list(tensor.shape))
        raw, view = _tensor_bytes(tensor)
        size = view.nbytes
        if pack and 0 < self.pack_bytes and size < self.pack_bytes:
            start = self._packed(view)
            location, byte_range = self._pack_location, f"[{start}, {start + size}]"
        else:
            rel = own_rel or f"{self.rank}/{_safe(path)}"
            self._own_file(rel, view)
            location, byte_range = _json_str(rel), "null"
        return _tensor_text(location, RAW if raw else TORCH_SAVE, dtype_name, shape, replicated, byte_range)

    def _packed(self, view: Any) -> int:
        """Append ``view`` to the current pack (a new one when it would overflow); its offset there."""
        size = view.nbytes
        pack = self._pack
        if pack is None or self._pack_size + size > self.pack_bytes:
            if pack is not None:
                self._emit(pack)  # full: written while the rest is planned
            pack = self._pack = Payload(f"batched/{self.rank}-{self._files}", [])
            self._files += 1
            self._pack_location = _json_str(pack.rel)
            self._pack_size = 0
        start = self._pack_size
        self._last_rel = pack.rel
        pack.views.append(view)
        self._pack_size = start + size
        self.nbytes += size
        return start

    def _own_file(self, rel: str, view: Any) -> None:
        self._last_rel = rel
        self._files += 1
        self.nbytes += view.nbytes
        self._emit(Payload(rel, [view]))

    # -- objects

    def object(self, path: str, value: Any, replicated: bool) -> dict:
        rel = f"{self.rank}/{_safe(path)}"
        self._own_file(rel, memoryview(_torch_save(value)))
        kind = type(value)
        return {
            "type": "object",
            "location": rel,
            "serializer": TORCH_SAVE,
            "obj_type": f"{kind.__module__}.{kind.__name__}",
            "replicated": replicated,
        }

    # -- ShardedTensor / DTensor

    def add_distributed(self, path: str, manifest_path: str, value: torch.Tensor, replicated: bool) -> None:
        sharded_tensor, _dtensor, _shard = _distributed_types()
        if sharded_tensor is not None and isinstance(value, sharded_tensor):
            self.entries[manifest_path] = _text(self.sharded_tensor(path, value))
        else:
            self.add_dtensor(path, manifest_path, value, replicated)

    def sharded_tensor(self, path: str, value: Any) -> dict:
        shards = []
        for local in value.local_shards():
            offsets = list(local.metadata.shard_offsets)
            rel = _shard_rel(self.rank, path, offsets)
            shards.append(
                {
                    "offsets": offsets,
                    "sizes": list(local.metadata.shard_sizes),
                    "tensor": json.loads(self.tensor(path, local.tensor, rel, False)),
                }
            )
        return {"type": "ShardedTensor", "shards": shards}

    def add_dtensor(self, path: str, manifest_path: str, value: Any, replicated: bool) -> None:
        layout = _dtensor_layout(path, value)
        if layout is None:  # this rank holds no part of it
            return
        group, offsets, sizes, dim_map = layout
        writer = group[zlib.crc32(path.encode()) % len(group)]
        fully_replicated = all(dims == [-1] for dims in dim_map)
        if replicated:  # a replicated value this rank was assigned to write
            writer = self.rank
        elif fully_replicated and writer != self.rank:
            return  # recorded once, by the writer
        rel = _shard_rel(writer, path, offsets)
        if writer == self.rank:
            # a shard no other rank records can be packed; one its replicas point at cannot
            text = self.tensor(path, value.to_local(), rel, False, pack=len(group) == 1 or fully_replicated)
        else:
            text = _pointer_record(rel, value.to_local())
        record = {
            "type": "DTensor",
            "shards": [{"offsets": offsets, "sizes": sizes, "tensor": json.loads(text)}],
            "mesh": value.device_mesh.mesh.tolist(),
            "dim_map": dim_map,
        }
        self.entries[manifest_path if replicated or not fully_replicated else f"0/{path}"] = _text(record)


def _tensor_text(location: str, serializer: str, dtype: str, shape: str, replicated: bool, byte_range: str) -> str:
    """A tensor's record as JSON text, from the JSON texts of its location, shape and byte range
    (``null`` or ``[start, end]``): what ``_text`` makes of the same record as a dict, formatted
    directly (it is the one record written once per tensor)."""
    return (
        f'{{"type": "Tensor", "location": {location}, "serializer": "{serializer}", "dtype": "{dtype}", '
        f'"shape": {shape}, "replicated": {"true" if replicated else "false"}, "byte_range": {byte_range}}}'
    )


def _pointer_record(rel: str, local: torch.Tensor) -> str:
    """The record of a DTensor shard that another rank of its replica group writes to ``rel``."""
    dtype_name = DTYPE_NAMES.get(local.dtype)
    if dtype_name is None:
        raise ConfigError(f"a DTensor of dtype {local.dtype} cannot be saved in torchsnapshot's format.")
    raw = local.dtype in RAW_DTYPES and local.numel() > 0
    shape = json.dumps(list(local.shape))
    return _tensor_text(_json_str(rel), RAW if raw else TORCH_SAVE, dtype_name, shape, False, "null")


#: (the ranks holding this rank's shard of a DTensor, the shard's offsets, its sizes, dim_map)
_Layout = tuple[list[int], list[int], list[int], list[list[int]]]


def _dtensor_layout(path: str, value: Any) -> Optional[_Layout]:
    """Where this rank's shard of DTensor ``value`` lies, or None when this rank is not in its mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    dim_map: list[list[int]] = [[] for _ in range(value.dim())]
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            dim_map[placement.dim].append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ConfigError(
                f"{path!r}: a DTensor with placement {placement} cannot be saved; redistribute it to "
                "Shard/Replicate placements (e.g. dtensor.redistribute(placements=[Replicate()])) first."
            )
    sharding_mesh_dims = {d for dims in dim_map for d in dims}
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    index = tuple(coordinate[d] if d in sharding_mesh_dims else slice(None) for d in range(mesh.ndim))
    group = sorted(mesh.mesh[index].reshape(-1).tolist())
    return group, list(offsets), list(sizes), [dims or [-1] for dims in dim_map]


def _shard_rel(rank: int, path: str, offsets: Sequence[int]) -> str:
    return f"{rank}/{_safe(path)}/shard_{'_'.join(str(o) for o in offsets)}"


def _tensor_bytes(tensor: torch.Tensor) -> tuple[bool, Any]:
    """(whether the bytes are the tensor's raw memory, rather than its ``torch.save`` bytes; the
    bytes to store, a flat byte buffer that keeps its memory alive)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.dtype in RAW_DTYPES and tensor.numel():
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return True, flat_bytes(tensor)
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes a view's whole storage; save only the view
    return False, memoryview(_torch_save(tensor))


def _whole_tensor(value: torch.Tensor) -> torch.Tensor:
    """A Parameter or sparse tensor as ``torch.save`` should store it: on the CPU, and a
    Parameter that is a view of a larger storage copied (torch.save writes the whole storage)."""
    if type(value) is not torch.nn.Parameter:
        return value if value.is_cpu else value.cpu()
    data = value.detach()
    whole = data.untyped_storage().nbytes() == data.numel() * data.element_size()
    if data.is_cpu and whole:
        return value
    data = data.cpu() if whole else data.cpu().clone()
    return torch.nn.Parameter(data, requires_grad=value.requires_grad)


def _torch_save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _primitive_record(type_name: str, value: Any, replicated: bool) -> dict:
    if type_name == "bytes":
        serialized = base64.b64encode(value).decode("ascii")
    elif type_name == "float":
        serialized = base64.b64encode(struct.pack("d", value)).decode("ascii")
    else:
        serialized = str(value)
    return {
        "type": type_name,
        "serialized_value": serialized,
        "replicated": replicated,
        "readable": str(value) if type_name == "float" else None,
    }


def _int_too_long(path: str, value: int) -> UnrestorableStateError:
    digits = int(value.bit_length() * 0.30103) + 1
    return UnrestorableStateError(
        f"{path!r} holds an int of about {digits} decimal digits, which cannot be saved: the format "
        f"stores an int as its decimal text, which Python makes of at most "
        f"{sys.get_int_max_str_digits()} digits (sys.get_int_max_str_digits()), and restore's "
        "torch.load(weights_only=True) cannot read such an int back pickled either. Store it in the "
        "state_dict as bytes (value.to_bytes((value.bit_length() + 8) // 8, 'little', signed=True), "
        "and int.from_bytes(..., 'little', signed=True) in load_state_dict)"
    )


def _is_distributed(value: torch.Tensor) -> bool:
    sharded_tensor, dtensor, _shard = _distributed_types()
    return (sharded_tensor is not None and isinstance(value, sharded_tensor)) or (
        dtensor is not None and isinstance(value, dtensor)
    )


_DISTRIBUTED_TYPES: Optional[tuple[Any, Any, Any]] = None


def _distributed_types() -> tuple[Any, Any, Any]:
    """(ShardedTensor, DTensor, Shard placement), or Nones where torch.distributed is missing;
    imported on first use (only states holding tensor subclasses pay for it)."""
    global _DISTRIBUTED_TYPES
    if _DISTRIBUTED_TYPES is None:
        if torch.distributed.is_available():
            from torch.distributed._shard.sharded_tensor import ShardedTensor
            from torch.distributed.tensor import DTensor, Shard

            _DISTRIBUTED_TYPES = (ShardedTensor, DTensor, Shard)
        else:
            _DISTRIBUTED_TYPES = (None, None, None)
    return _DISTRIBUTED_TYPES


# --- locations --------------------------------------------------------------------------------

#: Components ``encode`` never produces (its ``%`` is always ``%25`` or ``%2F``), standing in
#: for the ones a filesystem would read as navigation.
_RESERVED_COMPONENTS = {"": "%", ".": "%2E", "..": "%2E%2E"}


def _safe(path: str) -> str:
    """``path`` as a relative file path that stays inside the snapshot directory: no empty,
    ``.`` or ``..`` component, no NUL byte, no component too long for a file name; distinct
    logical paths stay distinct."""
    return "/".join(_safe_component(component) for component in path.split("/"))


def _safe_component(component: str) -> str:
    if component in _RESERVED_COMPONENTS:
        return _RESERVED_COMPONENTS[component]
    if "\x00" in component:
        component = component.replace("\x00", "%00")
    if len(component) * 4 > MAX_COMPONENT_BYTES and len(component.encode()) > MAX_COMPONENT_BYTES:
        digest = hashlib.sha256(component.encode()).hexdigest()[:16]
        head = component.encode()[: MAX_COMPONENT_BYTES // 2].decode(errors="ignore")
        component = f"{head}%~{digest}"
    return component


# --- the manifest -----------------------------------------------------------------------------


def merge(parts: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Rank 0: the snapshot's manifest from every rank's ``Plan.entries`` (in rank order).
    Two ranks recording the same path differently is a bug in the caller: raises SnapshotError."""
    manifest: dict[str, str] = {}
    for part in parts:
        for path, record in part.items():
            known = manifest.setdefault(path, record)
            if known is not record and known != record:
                raise SnapshotError(
                    f"two ranks recorded {path!r} differently ({known} vs {record}); the ranks "
                    "disagree on which values are replicated: pass every rank the same `replicated`."
                )
    return manifest


#: Characters YAML does not take raw (non-printable, or line breaks inside a quoted scalar),
#: and surrogates (not encodable): these are escaped, as JSON allows.
_YAML_UNSAFE = re.compile(r"[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")


#: Manifest records joined into text at a time by :func:`metadata_bytes`.
METADATA_CHUNK = 1024


def metadata_bytes(manifest: Mapping[str, str], world_size: int) -> bytearray:
    """The contents of ``.snapshot_metadata`` (``manifest``: path -> record, JSON text, as
    :func:`merge` returns it): JSON, which torchsnapshot's YAML parser reads.
    Non-ASCII text is written as UTF-8, not as JSON escapes: libyaml rejects the escaped
    surrogate pairs that ``json.dumps`` writes for characters beyond the BMP (emoji).
    Built ``METADATA_CHUNK`` records at a time into one buffer: the text of a whole manifest
    (2 MB at 10,000 tensors) is never held as well, nor a str of each record's line."""
    head = json.dumps({"version": FORMAT_VERSION, "world_size": world_size})
    out = bytearray(f'{head[:-1]}, "manifest": {{'.encode())
    items = iter(manifest.items())
    separator = ""
    while chunk := list(islice(items, METADATA_CHUNK)):
        text = separator + ", ".join([f"{_json_str(path)}: {record}" for path, record in chunk])
        if not text.isascii():  # (rare: one pass less in the common case)
            text = _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
        out += text.encode()
        separator = ", "
    out += b"}}"
    return out
