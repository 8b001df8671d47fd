"""Reusing a snapshot's plan: while the state's layout is unchanged (the same leaves, types,
dtypes and shapes), a snapshot hands out the tensors' new bytes under the records the last plan
made (:class:`PlanCache`), as runs of memory where tensors lie end to end (:func:`byte_runs`), or
copied into one reused buffer a pack where they lie apart (:class:`PackBuffer`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter, eq
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from tnt_snapshot_plugin.format.torchsnapshot.common import flat_bytes
from tnt_snapshot_plugin.format.torchsnapshot.common import tensor_nbytes as _nbytes

if TYPE_CHECKING:
    from tnt_snapshot_plugin.format.torchsnapshot.writer import _Builder


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
