"""The device mesh of DTensor records, written once per rank instead of once per record.

torchsnapshot's DTensor record holds the whole device mesh (``"mesh": [0, 1, ..., N-1]`` for
FSDP2), and every rank records one entry per sharded tensor: written out in full, the metadata
grows as (world size)^2 x (sharded tensors). ``.snapshot_metadata`` is YAML (torchsnapshot reads
it with a YAML loader; JSON is YAML), so a rank writes each distinct mesh once, as a YAML anchor on
the first record of its own shards (``"mesh": &m3_0 [0, 1, ...]``), and its later records name it
(``"mesh": *m3_0``). torchsnapshot's and torchtnt's YAML loaders resolve the names; the anchors of a
rank lie in that rank's own group of records (coordination.py), so a group read alone
(rank_regions.py) holds every mesh it names. The record of a replicated value (which several
ranks may make, alike, under ``0/``) keeps its mesh written out, and so does every record on a
mesh of one rank: the metadata of a snapshot of one process stays plain JSON.

:func:`loads` reads such text with the JSON parser: each anchor and alias is turned into JSON
(``["&m3_0", 0, 1, ...]``, ``"*m3_0"``) and resolved after parsing, every alias to its anchor's
list (one list, shared).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

#: ``"mesh": &NAME [`` and ``"mesh": *NAME`` as the writer writes them (names: ``m<rank>_<n>``).
_ANCHOR = re.compile(rb'"mesh": &(m[0-9]+_[0-9]+) \[')
_ALIAS = re.compile(rb'"mesh": \*(m[0-9]+_[0-9]+)')
_MARKS = (b'"mesh": &', b'"mesh": *')


class MeshNames:
    """One rank's names for the meshes of its DTensor records (:class:`format.writer._Builder`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._names: dict[str, str] = {}

    def text(self, mesh: list[Any]) -> str:
        """The YAML of ``mesh`` in the next record: an anchor the first time, then its name."""
        written = json.dumps(mesh)
        name = self._names.get(written)
        if name is not None:
            return f"*{name}"
        name = self._names[written] = f"m{self.rank}_{len(self._names)}"
        return f"&{name} {written}"


class UnknownMesh(ValueError):
    """A record names a mesh no record before it (in its group) defines."""


def loads(data: bytes | bytearray | memoryview) -> Any:
    """``data`` parsed as JSON, with the mesh anchors and aliases of this module resolved;
    ValueError (json's, or :class:`UnknownMesh`) where it is neither."""
    raw = bytes(data)
    if _MARKS[0] not in raw and _MARKS[1] not in raw:
        return json.loads(raw)
    raw = _ANCHOR.sub(rb'"mesh": ["&\1", ', raw)
    raw = _ALIAS.sub(rb'"mesh": "*\1"', raw)
    doc = json.loads(raw)
    manifest = doc.get("manifest", doc) if isinstance(doc, dict) else None
    if isinstance(manifest, dict):
        resolve(manifest.values())
    return doc


def resolve(entries: Iterable[Any]) -> None:
    """Replace, in document order, each anchored mesh by its list and each alias by that list."""
    meshes: dict[str, list[Any]] = {}
    for entry in entries:
        if type(entry) is not dict or entry.get("type") != "DTensor":
            continue
        mesh = entry.get("mesh")
        if type(mesh) is list and mesh and type(mesh[0]) is str and mesh[0][:1] == "&":
            entry["mesh"] = meshes[mesh[0][1:]] = mesh[1:]
        elif type(mesh) is str and mesh[:1] == "*":
            found = meshes.get(mesh[1:])
            if found is None:
                raise UnknownMesh(f"a DTensor record names mesh {mesh[1:]!r}, which no record before it defines")
            entry["mesh"] = found


__all__ = ["MeshNames", "UnknownMesh", "loads", "resolve"]
