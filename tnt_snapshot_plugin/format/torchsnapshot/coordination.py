"""What the ranks send each other per snapshot, kept to what changes between snapshots.

A run saves the same state layout again and again: the manifest records of a rank (one per
tensor, shard, container and value) are the same from one snapshot to the next, except for the
few values that change (progress counters, a learning rate). :class:`RecordDeltas` sends a
rank's records to rank 0 whole at the first snapshot (its own as the text of its group of the
metadata, ``format/groups.py``), and afterwards only what changed since the last snapshot every
rank completed; rank 0 keeps each rank's records and group text and applies the changes. A
snapshot that fails anywhere (every rank learns it at the same point) makes every rank send
its records whole again next time, so rank 0 and the ranks never disagree on what rank 0 holds.

:func:`agree_on_paths` is the agreement on the replicated paths every rank holds: a digest per
rank, and the paths themselves only when the digests differ.

Without these, each snapshot gathered O(world size x records) to rank 0 and all-gathered every
rank's replicated paths to every rank (benchmarks/scale.py measures both).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import xxhash

from tnt_snapshot_plugin.errors import SnapshotError
from tnt_snapshot_plugin.format.torchsnapshot.groups import Group, apply, metadata_views
from tnt_snapshot_plugin.format.torchsnapshot.merging import merge, records_text

#: What a rank sends for its records: (its 0/ records: ("all", records) or ("changed", records,
#: removed paths); its group: ("all", text, digest) or ("changes", ranges, digest), or None).
Part = tuple


class RecordDeltas:
    """One rank's view of the records gathered to rank 0 (and, on rank 0, every rank's).

    A rank's ``0/`` records (rank 0's records, and replicated values a rank wrote) go to rank 0
    as records, to be merged into the metadata's first group; a rank's own records (``R/``) as
    the text of its group of the metadata (``format.groups.Group``), which rank 0 keeps as
    bytes and writes as they are (:meth:`groups`)."""

    def __init__(self, *, enabled: bool = True) -> None:
        #: False: every part carries every record (a world of one process: nothing to save)
        self.enabled = enabled
        #: the 0/ records and the group this rank sent at the last snapshot every rank completed
        #: (None: send all)
        self._sent: Optional[dict[str, str]] = None
        self._sent_group: Optional[Group] = None
        #: rank 0: each rank's 0/ records and group text as of that snapshot
        self._held: dict[int, dict[str, str]] = {}
        self._held_groups: dict[int, bytearray] = {}
        #: this snapshot's, until settled
        self._outgoing: Optional[tuple[dict[str, str], Optional[Group]]] = None
        self._incoming: dict[int, dict[str, str]] = {}
        self._incoming_groups: dict[int, tuple[bytearray, str]] = {}
        #: how many records the last part carried (for the scale benchmark and tests)
        self.last_sent_records = 0

    def reset(self) -> None:
        """Send everything whole next time (a new run, or a failed snapshot)."""
        self._sent, self._sent_group = None, None
        self._held, self._held_groups = {}, {}
        self._outgoing = None
        self._incoming, self._incoming_groups = {}, {}

    def outgoing(self, records: dict[str, str]) -> Part:
        """What this rank sends rank 0 for ``records`` (its ``Plan.entries``): (its 0/ records,
        whole or changed; its group: ``("all", text, digest)`` or ``("changes", ranges,
        digest)``, None on one process)."""
        if self._outgoing is not None:  # the last snapshot ended without settle() or reset()
            self.reset()
        if not self.enabled:
            self._outgoing = (records, None)
            self.last_sent_records = len(records)
            return (("all", records), None)
        zeros = {p: t for p, t in records.items() if p.startswith("0/")}
        own = records if not zeros else {p: t for p, t in records.items() if not p.startswith("0/")}
        group = Group(own, self._sent_group)
        self._outgoing = (zeros, group)
        changes = self._sent_group.changes(group) if self._sent_group is not None else None
        if changes is None:
            group_part: tuple = ("all", bytearray(group.data), group.digest)  # rank 0 changes it in place
            self.last_sent_records = len(own)
        else:
            group_part = ("changes", changes, group.digest)
            self.last_sent_records = len(changes)
        zeros_part = self._zeros_part(zeros)
        self.last_sent_records += len(zeros_part[1]) + (len(zeros_part[2]) if len(zeros_part) > 2 else 0)
        return (zeros_part, group_part)

    def _zeros_part(self, zeros: dict[str, str]) -> tuple:
        base = self._sent
        if base is None:
            return ("all", zeros)
        changed: dict[str, str] = {}
        added = 0
        for path, text in zeros.items():
            old = base.get(path)
            if old is None:
                added += 1
                changed[path] = text
            elif old is not text and old != text:  # a reused plan's records are the same objects
                changed[path] = text
        removed = [] if len(base) + added == len(zeros) else [p for p in base if p not in zeros]
        return ("changed", changed, removed)

    def incoming(self, rank: int, part: Part) -> dict[str, str]:
        """Rank 0: rank ``rank``'s 0/ records (on one process: every record) from what it
        sent; its group is kept for :meth:`groups`."""
        zeros_part, group_part = part
        if zeros_part[0] == "all":
            records = zeros_part[1]
        else:
            records = dict(self._base(self._held, rank))
            records.update(zeros_part[1])
            for path in zeros_part[2]:
                records.pop(path, None)
        self._incoming[rank] = records
        if group_part is not None:
            text = group_part[1]  # the text whole, or changes to the last one
            if group_part[0] != "all":
                text = apply(self._base(self._held_groups, rank), group_part[1], group_part[2], rank)
            self._incoming_groups[rank] = (text, group_part[2])
        return records

    @staticmethod
    def _base(held: dict[int, Any], rank: int) -> Any:
        if rank not in held:
            raise SnapshotError(
                f"rank {rank} sent the changes to records rank 0 does not hold; the ranks are out "
                "of step (a bug): the next snapshot sends every record again"
            )
        return held[rank]

    def groups(self, ranks: int) -> list[tuple[bytearray, str]]:
        """Rank 0: the group (text, digest) of each rank after the first, as received."""
        return [self._incoming_groups[rank] for rank in range(1, ranks)]

    def settle(self) -> None:
        """After a snapshot every rank completed (committed): its records are what rank 0
        holds. After a failure, call :meth:`reset` instead, on every rank."""
        if self.enabled and self._outgoing is not None:
            self._sent, self._sent_group = self._outgoing
        if self.enabled and self._incoming:
            self._held = self._incoming
            self._held_groups = {rank: text for rank, (text, _) in self._incoming_groups.items()}
        self._outgoing = None
        self._incoming, self._incoming_groups = {}, {}


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





# --- each rank's records together in .snapshot_metadata ----------------------------------------
#
# The metadata holds every rank's records; a restoring rank needs its own, rank 0's (containers
# and replicated values) and, for sharded tensors, those of the ranks whose shards overlap its
# own. Rank 0 writes the records grouped by rank (rank 0's and every replicated "0/" record
# first, then each rank's: format/groups.py), and the plugin's index records where each group
# lies and its digest (``"ranks"``): a rank reads its groups by ranged reads
# (``format.rank_regions.read_for_rank``) instead of parsing every rank's records.


def grouped_metadata(
    zeros: Sequence[dict[str, str]], groups: Sequence[tuple[Any, str]], world_size: int
) -> tuple[list[Any], Optional[list[list[Any]]]]:
    """Rank 0: ``.snapshot_metadata`` as buffers to write one after another, from every rank's
    ``0/`` records (``zeros``, in rank order: rank 0's are all its records) and the groups of the
    ranks after rank 0 (:meth:`RecordDeltas.groups`); and ``[start, end, digest]`` of each rank's
    group (None on one process: the whole file is rank 0's)."""
    first = records_text(merge(zeros))  # rank 0's records, then each rank's 0/ records
    digest = xxhash.xxh3_64_hexdigest(first) if world_size > 1 else ""
    views, regions = metadata_views(world_size, [(first, digest), *groups])
    return views, regions if world_size > 1 else None


def sharded_shapes(leaves: dict[str, Any]) -> dict[str, list[int]]:
    """Logical path -> whole shape of every sharded tensor (ShardedTensor, DTensor) in
    ``leaves``: a rank that reads only some ranks' shards still knows each tensor's shape."""
    import torch

    from tnt_snapshot_plugin.format.torchsnapshot.writer import _is_distributed

    plain = (torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes)
    out: dict[str, list[int]] = {}
    for path, value in leaves.items():
        if type(value) in plain or not isinstance(value, torch.Tensor):
            continue
        if _is_distributed(value):
            out[path] = list(value.shape)
    return out


__all__ = ["RecordDeltas", "agree_on_paths", "grouped_metadata", "paths_digest", "sharded_shapes"]
