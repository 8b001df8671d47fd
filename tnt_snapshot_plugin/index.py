"""The plugin's index of a snapshot, ``.tnt_snapshot_index.json``: written sealed, read checked.

The index sits next to torchsnapshot's ``.snapshot_metadata`` in every snapshot the plugin
commits. It records what torchsnapshot's format has no room for: the size and checksum of every
file (``files``, ``checksums``), the commit sequence number (``seq``, which orders "latest"),
the writer, the world size and the monitored metric.

:func:`seal` writes it with its own digest (``seal``: xxh3_64 of the sorted JSON of every other
field), so that an index edited or damaged after its commit (a flipped checksum, another ``seq``)
is told apart from an intact one: :func:`parse` refuses it with :class:`SnapshotCorruptError`.
An index written before the seal existed has none, and is read as it is.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from .errors import SnapshotCorruptError

#: The index file of every snapshot the plugin commits.
INDEX_FNAME = ".tnt_snapshot_index.json"
#: The field holding the index's own digest.
SEAL_FIELD = "seal"


def _digest(fields: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True).encode())


def seal(fields: dict[str, Any]) -> bytes:
    """The bytes of an index holding ``fields`` and the seal over them (the fields' JSON, made
    once: the seal goes at its end; :func:`parse` reads the fields in any order)."""
    body = json.dumps(fields, sort_keys=True)
    digest = xxhash.xxh3_64_hexdigest(body.encode())
    if not fields:
        return json.dumps({SEAL_FIELD: digest}).encode()
    return f'{body[:-1]}, "{SEAL_FIELD}": "{digest}"}}'.encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """The index of snapshot ``where`` (named in errors) from its bytes, checked: a JSON object
    with ``format``, ``files`` (file -> size) and, where present, ``checksums`` (file -> record)
    and a seal that matches. SnapshotCorruptError otherwise (its ``reason``: the problem in a few
    words, without the snapshot's path)."""
    def damaged(what: str) -> SnapshotCorruptError:
        error = SnapshotCorruptError(
            f"{where}/{INDEX_FNAME}: {what}: the snapshot's index is damaged, so its files cannot be "
            "checked. Restore an older snapshot (restore_from_latest falls back to one by itself)"
        )
        error.reason = f"its index {INDEX_FNAME} is damaged: {what}"  # type: ignore[attr-defined]
        return error

    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise damaged(f"it is not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise damaged("it is not the plugin's index (a JSON object with 'format')")
    if SEAL_FIELD in doc:
        fields = {k: v for k, v in doc.items() if k != SEAL_FIELD}
        if doc[SEAL_FIELD] != _digest(fields):
            raise damaged("its content does not match its seal (the file was changed after the commit)")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items()
    ):
        raise damaged("its 'files' is not a mapping of file to size")
    checksums = doc.get("checksums")
    if checksums is not None and not isinstance(checksums, dict):
        raise damaged("its 'checksums' is not a mapping of file to record")
    return doc


__all__ = ["INDEX_FNAME", "SEAL_FIELD", "parse", "seal"]
