"""``.snapshot_metadata`` of several ranks as each rank's group of text, kept between saves.

The metadata is ``{"version": ..., "world_size": N, "manifest": {G0, G1, ...}}`` where G0 holds
rank 0's records and every replicated ``0/`` record, and Gr (r > 0) rank r's own records, each
``"path": record``, joined by ``", "``: the bytes :func:`merging.metadata_bytes` writes for the
same records in that order (``coordination.py`` says why they are grouped). Each rank builds its
own group's text (:class:`Group`) and sends rank 0 the text whole at a first save, then only the
byte ranges that changed (:meth:`Group.changes`); rank 0 keeps each group's bytes and applies the
changes in place (:func:`apply`), checked against the digest of the text the rank built. Rank 0
then writes the metadata from the groups' bytes as they are (:func:`metadata_views`): it never
parses, merges or joins the other ranks' records.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Optional, Sequence

import xxhash

from tnt_snapshot_plugin.errors import SnapshotError
from tnt_snapshot_plugin.format.torchsnapshot.merging import json_str as _json_str
from tnt_snapshot_plugin.format.torchsnapshot.merging import metadata_head, yaml_safe


def _item(path: str, record: str) -> bytes:
    """The text of one record in the metadata (merging.metadata_bytes's, escaped alike)."""
    return yaml_safe(f"{_json_str(path)}: {record}").encode()


class Group:
    """Records (path -> record text, in order) as one group's text: ``data``, its xxh3_64
    ``digest``, and where each record's text starts. ``reuse``: the group of the last save,
    whose text of each record that is the same (the same string: a reused plan's) is kept."""

    def __init__(self, records: dict[str, str], reuse: Optional["Group"] = None) -> None:
        self.records = records
        self.paths = list(records)
        self.items: list[bytes]
        if reuse is not None and reuse.paths == self.paths:
            old, kept = reuse.records, reuse.items
            self.items = [
                kept[i] if old[path] is record or old[path] == record else _item(path, record)
                for i, (path, record) in enumerate(records.items())
            ]
        else:
            self.items = [_item(path, record) for path, record in records.items()]
        self.data = b", ".join(self.items)
        self.digest = xxhash.xxh3_64_hexdigest(self.data)
        # each record's start: after the items before it and their separators
        self.starts = [0, *accumulate(len(item) + 2 for item in self.items[:-1])] if self.items else []

    def changes(self, newer: "Group") -> Optional[list[tuple[int, int, bytes]]]:
        """The byte ranges of this text (start, end, new bytes: ascending) that ``newer`` replaces;
        None where its records are others, or in another order (then it is sent whole)."""
        if newer.paths != self.paths:
            return None
        return [
            (self.starts[i], self.starts[i] + len(old), new)
            for i, (old, new) in enumerate(zip(self.items, newer.items, strict=True))
            if old is not new
        ]


def apply(text: bytearray, changes: Sequence[tuple[int, int, bytes]], digest: str, rank: int) -> bytearray:
    """Rank 0: rank ``rank``'s group ``text`` made what the rank built (``changes`` from
    :meth:`Group.changes`; ``digest`` its xxh3_64), in place; or in a copy where a buffer of it
    is still held elsewhere (it cannot be resized then). SnapshotError where the result is not
    what the rank built: the ranks are out of step (a bug), and the next snapshot sends every
    group whole."""
    for start, end, new in reversed(changes):
        try:
            text[start:end] = new
        except BufferError:  # a view of it still exists: the changes so far are kept
            text = bytearray(text)
            text[start:end] = new
    if xxhash.xxh3_64_hexdigest(text) != digest:
        raise SnapshotError(
            f"rank 0's copy of rank {rank}'s records differs from the rank's after applying its "
            "changes (a bug); this snapshot is not committed and the next one sends every record"
        )
    return text


def metadata_views(world_size: int, groups: Sequence[tuple[Any, str]]) -> tuple[list[Any], list[list[Any]]]:
    """The bytes of ``.snapshot_metadata`` as buffers to write one after another, for ``groups``
    (each rank's (text, digest), rank 0's first); and where each group lies: ``[start, end,
    digest]`` (an empty group: where it would start)."""
    views: list[Any] = [metadata_head(world_size)]
    offset = len(views[0])
    regions: list[list[Any]] = []
    for text, digest in groups:
        if not len(text):
            regions.append([offset, offset, digest])
            continue
        if len(views) > 1:
            views.append(b", ")
            offset += 2
        regions.append([offset, offset + len(text), digest])
        views.append(memoryview(text))
        offset += len(text)
    views.append(b"}}")
    return views, regions


__all__ = ["Group", "apply", "metadata_views"]
