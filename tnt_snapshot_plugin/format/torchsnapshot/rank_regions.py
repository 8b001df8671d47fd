"""One rank's view of a snapshot without parsing every rank's records.

The plugin writes each rank's records as one consecutive group of ``.snapshot_metadata`` (rank
0's and the replicated ``0/`` records first) and records in its index, under ``"ranks"``, where
each group lies with its digest, and the whole shape of every sharded tensor
(tnt_snapshot_plugin/coordination.py). A rank then reads rank 0's group, its own, and the groups
of the ranks whose shards it reads, by ranged reads: O(its records), not O(world size x records).
Snapshots without ``"ranks"`` (torchsnapshot's, torchtnt's) are parsed whole, as before.
A restore on the world size a snapshot was taken on reads this way (``restoring.request``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from tnt_snapshot_plugin.format.structure import MAX_INT64
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (
    GLOBAL_SHAPE,
    MAX_ENTRIES,
    MAX_NDIM,
    MAX_WORLD_SIZE,
    METADATA_FNAME,
    SHARDED_TYPES,
    Metadata,
    _fully_replicated_dtensor,
    _Validator,
    corrupt,
    rank_view,
)


@dataclass(frozen=True)
class RankRegions:
    """Where each saved rank's records lie in ``.snapshot_metadata`` (``[start, end, digest]``,
    byte offsets) and the whole shape of each sharded tensor (logical path -> shape)."""

    regions: list[tuple[int, int, str]]
    shapes: dict[str, list[int]]

    @classmethod
    def from_index(cls, index: Any) -> Optional["RankRegions"]:
        """From the plugin's parsed index; None where it has no (well-formed) ``"ranks"``."""
        ranks = index.get("ranks") if isinstance(index, dict) else None
        if not isinstance(ranks, dict):
            return None
        regions, shapes = ranks.get("regions"), ranks.get("shapes")
        if not isinstance(regions, list) or not isinstance(shapes, dict) or not 0 < len(regions) <= MAX_WORLD_SIZE:
            return None
        out = []
        for region in regions:
            if (
                type(region) is not list
                or len(region) != 3
                or type(region[0]) is not int
                or type(region[1]) is not int
                or not 0 <= region[0] <= region[1] <= MAX_INT64
                or type(region[2]) is not str
            ):
                return None
            out.append((region[0], region[1], region[2]))
        if not all(
            type(v) is list and len(v) <= MAX_NDIM and all(type(n) is int and 0 <= n <= MAX_INT64 for n in v)
            for v in shapes.values()
        ):
            return None
        return cls(out, shapes)


class PartialView(Exception):
    """A view read by rank (:class:`Groups`) lacks shards that targets of this rank need (a
    whole tensor restored from a sharded entry, or another world size's pieces): ``boxes``, each
    (logical path, offsets, sizes) of a region no shard read covers. The caller reads more groups
    (:meth:`Groups.load_overlapping`) or the whole metadata, and reads the key again. Raised when
    a key's read is planned, before anything is read or filled."""

    def __init__(self, boxes: list[tuple[str, list[int], list[int]]]) -> None:
        super().__init__(", ".join(sorted({path for path, _, _ in boxes})))
        self.boxes = boxes


def covered(pieces: Iterable[tuple[Sequence[int], Sequence[int]]], offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether ``pieces`` (offsets, sizes of each saved shard of one tensor) hold every element of
    the box (``offsets``, ``sizes``)."""
    if not all(sizes):
        return True
    volume = 0  # the shards of a tensor do not overlap: covered when their volumes add up
    for at, extent in pieces:
        piece = 1
        for o, n, t, s in zip(at, extent, offsets, sizes, strict=False):
            piece *= max(0, min(o + n, t + s) - max(o, t))
        volume += piece
    whole = 1
    for n in sizes:
        whole *= n
    return volume >= whole


def covers(entry: dict, offsets: list[int], sizes: list[int]) -> bool:
    """Whether the shards of sharded ``entry`` hold every element of the box (``offsets``,
    ``sizes``): a rank that read some ranks' records can read its piece from them."""
    return covered(((s["offsets"], s["sizes"]) for s in entry.get("shards") or ()), offsets, sizes)


def _region_manifest(data: bytes, where: str, rank: int) -> dict:
    text = b"{" + bytes(data) + b"}"
    try:
        doc = mesh_aliases.loads(text)
    except mesh_aliases.UnknownMesh as exc:
        raise corrupt(where, f"the records of rank {rank}: {exc}") from None
    except (ValueError, RecursionError):
        raise corrupt(where, f"the records of rank {rank} (from the index's \"ranks\") are not JSON") from None
    if not isinstance(doc, dict):
        raise corrupt(where, f"the records of rank {rank} are not a mapping")
    return doc


def _read_group(read_range: Any, regions: RankRegions, saved: int, fname: str) -> dict:
    """The records of saved rank ``saved``, checked against the digest its index recorded."""
    import xxhash

    start, end, digest = regions.regions[saved]
    if start == end:
        return {}
    data = read_range(start, end)
    if xxhash.xxh3_64_hexdigest(data) != digest:
        raise corrupt(fname, f"the records of rank {saved} differ from the digest its index recorded")
    return _region_manifest(data, fname, saved)


def _ranks_overlapping(manifest: dict, boxes: Iterable[tuple[str, list[int], list[int]]], world_size: int) -> list[int]:
    """The saved ranks whose Shard(0)-style chunks (rank 0's shard size along the sharded
    dimension) overlap a box of ``boxes`` (logical path, offsets, sizes), from rank 0's records
    in ``manifest``."""
    found: list[int] = []
    for logical, offsets, sizes in boxes:
        entry = manifest.get(f"0/{logical}")
        if entry is None or entry.get("type") not in SHARDED_TYPES or not all(sizes):
            continue
        shards = entry.get("shards") or []
        dims = [d for d, m in enumerate(entry.get("dim_map") or []) if m != [-1]]
        if len(shards) != 1 or len(dims) != 1:
            continue  # found by the coverage check, if needed
        dim = dims[0]
        chunk = shards[0]["sizes"][dim] if shards[0]["sizes"] else 0
        if not chunk:
            continue
        first, last = offsets[dim] // chunk, (offsets[dim] + sizes[dim] - 1) // chunk
        found.extend(range(first, min(last, world_size - 1) + 1))
    return found


class Groups:
    """The groups of ``.snapshot_metadata`` one rank has read, read as they are needed:
    ``read_range(start, end)`` gives those bytes of the file. Each group read is checked against
    the digest its index recorded and validated (SnapshotCorruptError otherwise); ``meta``
    holds every record read so far."""

    def __init__(self, read_range: Any, regions: RankRegions, where: str) -> None:
        self.read_range, self.regions = read_range, regions
        self.fname = f"{where}/{METADATA_FNAME}"
        self.meta = Metadata("", len(regions.regions), {}, where)
        self.loaded: set[int] = set()
        self._validator = _Validator(self.fname, len(regions.regions))

    def load(self, saved: int) -> None:
        """Read saved rank ``saved``'s group, unless it was read."""
        if saved in self.loaded:
            return
        self.loaded.add(saved)
        group = _read_group(self.read_range, self.regions, saved, self.fname)
        if len(self.meta.manifest) + len(group) > MAX_ENTRIES:
            raise corrupt(self.fname, f"it has more than {MAX_ENTRIES} entries")
        prefix = f"{saved}/"
        stray = next((path for path in group if type(path) is not str or not path.startswith(prefix)), None)
        if stray is not None:  # a group holds its own rank's records only (rank 0's: the 0/ ones)
            raise corrupt(self.fname, f"the records of rank {saved} hold entry {stray!r}, not one of rank {saved}")
        self._validator.run(group)
        self.meta.manifest.update(group)

    def load_overlapping(self, boxes: Iterable[tuple[str, list[int], list[int]]]) -> None:
        """Read the groups of the saved ranks whose shards overlap ``boxes`` (logical path,
        offsets, sizes), as rank 0's records place them."""
        for saved in _ranks_overlapping(self.meta.manifest, boxes, self.meta.world_size):
            self.load(saved)

    def view(self, rank: int) -> dict[str, dict]:
        """Rank ``rank``'s view of the records read (:func:`rank_view`); each sharded entry
        with its whole shape (``GLOBAL_SHAPE``), which its shards read may not span. A sharded
        entry whose whole shape the index does not record makes every group read: the shape is
        then the extent of all its shards.

        The records read are checked together first (``_Validator.finish``): no two read
        overlapping bytes, and the shards read lie inside the recorded shapes without
        overlapping (and tile them, once every group is read). SnapshotCorruptError otherwise."""
        view = rank_view(self.meta, rank)
        sharded = [logical for logical, entry in view.items() if _in_pieces(entry)]
        if any(logical not in self.regions.shapes for logical in sharded) and len(self.loaded) < self.meta.world_size:
            for saved in range(self.meta.world_size):
                self.load(saved)
            view = rank_view(self.meta, rank)
            sharded = [logical for logical, entry in view.items() if _in_pieces(entry)]
        self._validator.finish(self.regions.shapes, complete=len(self.loaded) == self.meta.world_size)
        for logical in sharded:
            if logical in self.regions.shapes:
                view[logical][GLOBAL_SHAPE] = self.regions.shapes[logical]
        return view


def _in_pieces(entry: dict) -> bool:
    """Whether a view's entry is a tensor sharded over ranks (a fully replicated DTensor is one
    whole record)."""
    return entry["type"] in SHARDED_TYPES and not (entry["type"] == "DTensor" and _fully_replicated_dtensor(entry))


def read_for_rank(
    read_range: Any,
    regions: RankRegions,
    world_size: int,
    rank: int,
    where: str,
    boxes: Optional[dict[str, tuple[list[int], list[int]]]] = None,
) -> Optional[tuple[Metadata, dict[str, dict]]]:
    """The metadata of the saved ranks rank ``rank`` needs, and its view (:func:`rank_view`),
    read by ranked groups (:class:`Groups`).

    ``boxes``: logical path -> (offsets, sizes) of the piece of each sharded tensor this rank
    loads (None: the same world size and layout as saved, where a rank's own shards serve).
    The groups read are rank 0's, this rank's (if it was a saved rank), and, for each box, those
    of the ranks whose Shard(0)-style chunks (rank 0's shard size along the sharded dimension)
    overlap it. None when the shards read do not cover every box (the caller parses the whole
    metadata, :func:`parse_metadata`)."""
    if len(regions.regions) != world_size:
        return None
    groups = Groups(read_range, regions, where)
    groups.load(0)
    if rank < world_size:
        groups.load(rank)
    groups.load_overlapping((logical, *box) for logical, box in (boxes or {}).items())
    view = groups.view(rank)
    for logical, (offsets, sizes) in (boxes or {}).items():
        entry = view.get(logical)
        if entry is not None and entry["type"] in SHARDED_TYPES and not covers(entry, offsets, sizes):
            return None
    return groups.meta, view
