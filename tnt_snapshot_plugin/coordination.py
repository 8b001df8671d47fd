"""What the ranks send each other per snapshot, kept to what changes between snapshots.

A run saves the same state layout again and again: the manifest records of a rank (one per
tensor, shard, container and value) are the same from one snapshot to the next, except for the
few values that change (progress counters, a learning rate). :class:`RecordDeltas` sends a
rank's records to rank 0 whole at the first snapshot, and afterwards only the records that
changed since the last snapshot every rank completed; rank 0 keeps each rank's records and
applies the changes. A snapshot that fails anywhere (every rank learns it at the same point)
makes every rank send its records whole again next time, so rank 0 and the ranks never
disagree on what rank 0 holds.

:func:`agree_on_paths` is the agreement on the replicated paths every rank holds: a digest per
rank, and the paths themselves only when the digests differ.

Without these, each snapshot gathered O(world size x records) to rank 0 and all-gathered every
rank's replicated paths to every rank (benchmarks/scale.py measures both).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import xxhash

from .errors import SnapshotError

#: What a rank sends for its records: ("all", records) or ("changed", records, removed paths).
Part = tuple


class RecordDeltas:
    """One rank's view of the records gathered to rank 0 (and, on rank 0, every rank's)."""

    def __init__(self, *, enabled: bool = True) -> None:
        #: False: every part carries every record (a world of one process: nothing to save)
        self.enabled = enabled
        #: the records this rank sent at the last snapshot every rank completed (None: send all)
        self._sent: Optional[dict[str, str]] = None
        #: rank 0: each rank's records as of that snapshot
        self._held: dict[int, dict[str, str]] = {}
        #: this snapshot's, until settled
        self._outgoing: Optional[dict[str, str]] = None
        self._incoming: dict[int, dict[str, str]] = {}
        #: how many records the last part carried (for the scale benchmark and tests)
        self.last_sent_records = 0

    def reset(self) -> None:
        """Send everything whole next time (a new run, or a failed snapshot)."""
        self._sent = None
        self._held = {}
        self._outgoing = None
        self._incoming = {}

    def outgoing(self, records: dict[str, str]) -> Part:
        """What this rank sends rank 0 for ``records`` (its ``Plan.entries``)."""
        if self._outgoing is not None:  # the last snapshot ended without settle() or reset()
            self.reset()
        self._outgoing = records
        base = self._sent
        if base is None or not self.enabled:
            self.last_sent_records = len(records)
            return ("all", records)
        changed: dict[str, str] = {}
        added = 0
        for path, text in records.items():
            old = base.get(path)
            if old is None:
                added += 1
                changed[path] = text
            elif old is not text and old != text:  # a reused plan's records are the same objects
                changed[path] = text
        removed = [] if len(base) + added == len(records) else [p for p in base if p not in records]
        self.last_sent_records = len(changed) + len(removed)
        return ("changed", changed, removed)

    def incoming(self, rank: int, part: Part) -> dict[str, str]:
        """Rank 0: rank ``rank``'s records from what it sent."""
        if part[0] == "all":
            records = part[1]
        else:
            base = self._held.get(rank)
            if base is None:
                raise SnapshotError(
                    f"rank {rank} sent the changes to records rank 0 does not hold; the ranks are out "
                    "of step (a bug): the next snapshot sends every record again"
                )
            records = dict(base)
            records.update(part[1])
            for path in part[2]:
                records.pop(path, None)
        self._incoming[rank] = records
        return records

    def settle(self) -> None:
        """After a snapshot every rank completed (committed): its records are what rank 0
        holds. After a failure, call :meth:`reset` instead, on every rank."""
        if self.enabled and self._outgoing is not None:
            self._sent = self._outgoing
            if self._incoming:
                self._held = self._incoming
        self._outgoing = None
        self._incoming = {}


def paths_digest(paths: Sequence[str]) -> str:
    """A digest of ``paths`` in order."""
    hasher = xxhash.xxh3_128()
    for path in paths:
        hasher.update(path.encode("utf-8", "surrogatepass"))
        hasher.update(b"\x00")
    return hasher.hexdigest()


def agree_on_paths(coll: Any, mine: Sequence[str]) -> set[str]:
    """The paths every rank of ``coll`` holds (each rank passes its own, sorted or in a
    deterministic order): one all_gather of a digest; the paths themselves are exchanged only
    when the ranks' digests differ."""
    if coll.world_size == 1:
        return set(mine)
    digests = coll.all_gather((len(mine), paths_digest(mine)))
    if all(d == digests[0] for d in digests):
        return set(mine)
    everyone = coll.all_gather(list(mine))
    return set.intersection(*(set(paths) for paths in everyone))





# --- where each rank's records lie in .snapshot_metadata ----------------------------------------
#
# The metadata holds every rank's records; a restoring rank needs its own, rank 0's (containers
# and replicated values) and, for sharded tensors, those of the ranks whose shards overlap its
# own. Rank 0 writes the records grouped by rank (rank 0's and every replicated "0/" record
# first, then each rank's), and the plugin's index records where each group lies and its digest
# (``"ranks"``): a rank reads its groups by ranged reads (``format.rank_regions.read_for_rank``)
# instead of parsing every rank's records.


def grouped_by_rank(parts: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Every rank's records (in rank order) as the parts ``format.writer.merge`` takes, ordered
    so that each rank's records are consecutive in the metadata: rank 0's and every ``0/``
    record (replicated values, written by any rank) first, then each other rank's."""
    zeros: list[dict[str, str]] = []
    owns: list[dict[str, str]] = []
    for rank, part in enumerate(parts):
        if rank == 0:
            continue
        zero = {p: t for p, t in part.items() if p.startswith("0/")}
        zeros.append(zero)
        owns.append(part if not zero else {p: t for p, t in part.items() if not p.startswith("0/")})
    return [parts[0] if parts else {}, *zeros, *owns]


def _first_paths(parts: Sequence[dict[str, str]]) -> list[Optional[str]]:
    """The first path of each rank's group in the metadata (None: a rank without records)."""
    firsts: list[Optional[str]] = [next(iter(parts[0]), None) if parts else None]
    if firsts[0] is None:
        for part in parts[1:]:
            firsts[0] = next((p for p in part if p.startswith("0/")), None)
            if firsts[0] is not None:
                break
    for part in parts[1:]:
        firsts.append(next((p for p in part if not p.startswith("0/")), None))
    return firsts


def rank_regions(metadata: bytes | bytearray, parts: Sequence[dict[str, str]]) -> Optional[list[list[Any]]]:
    """``[start, end, digest]`` of each rank's group of records in ``metadata`` (written from
    :func:`grouped_by_rank` of ``parts``): the bytes ``"path": {record}, ...`` of that rank, the
    digest their xxh3_64. None where a group cannot be found (the index then has none: readers
    parse the whole metadata)."""
    from .format.writer import _json_str

    data = memoryview(metadata)
    raw = metadata
    head = raw.find(b'"manifest": {')
    if head < 0:
        return None
    cursor = head + len(b'"manifest": {')
    starts: list[Optional[int]] = []
    for path in _first_paths(parts):
        if path is None:
            starts.append(None)
            continue
        key = f"{_json_str(path)}: ".encode()
        found = raw.find(key, cursor)
        if found < 0 or not path.isascii():
            return None
        starts.append(found)
        cursor = found + len(key)
    end_of_all = len(raw) - 2  # "}}"
    regions: list[list[Any]] = []
    following = end_of_all
    ends: list[int] = []
    for start in reversed(starts):  # each group ends where the next one starts (less ", ")
        ends.append(following)
        if start is not None:
            following = start - 2
    ends.reverse()
    for start, end in zip(starts, ends, strict=True):
        if start is None:
            start = end = max(end, 0)
        regions.append([start, end, xxhash.xxh3_64_hexdigest(data[start:end])])
    return regions


def sharded_shapes(leaves: dict[str, Any]) -> dict[str, list[int]]:
    """Logical path -> whole shape of every sharded tensor (ShardedTensor, DTensor) in
    ``leaves``: a rank that reads only some ranks' shards still knows each tensor's shape."""
    import torch

    from .format.writer import _is_distributed

    plain = (torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes)
    out: dict[str, list[int]] = {}
    for path, value in leaves.items():
        if type(value) in plain or not isinstance(value, torch.Tensor):
            continue
        if _is_distributed(value):
            out[path] = list(value.shape)
    return out


__all__ = ["RecordDeltas", "agree_on_paths", "grouped_by_rank", "paths_digest", "rank_regions", "sharded_shapes"]
