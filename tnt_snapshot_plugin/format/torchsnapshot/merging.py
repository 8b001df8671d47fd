"""Rank 0's part of a save: every rank's manifest records merged into one manifest, and the
bytes of ``.snapshot_metadata`` (torchsnapshot's JSON, which its YAML parser reads)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from itertools import islice

from tnt_snapshot_plugin.errors import SnapshotError
from tnt_snapshot_plugin.format.torchsnapshot.common import FORMAT_VERSION

#: A str as a JSON string literal, non-ASCII kept as is (``json.dumps(text, ensure_ascii=False)``,
#: in C, without the call's overhead: it runs once per entry).
json_str = json.encoder.encode_basestring  # type: ignore[attr-defined]


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


def yaml_safe(text: str) -> str:
    """``text`` with what YAML does not take raw escaped (``_YAML_UNSAFE``); ``text`` itself
    when it is ASCII (the common case: one pass)."""
    if text.isascii():
        return text
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


#: Manifest records joined into text at a time by :func:`records_text`.
METADATA_CHUNK = 1024


def metadata_head(world_size: int) -> bytes:
    """The bytes of ``.snapshot_metadata`` before its records."""
    head = json.dumps({"version": FORMAT_VERSION, "world_size": world_size})
    return f'{head[:-1]}, "manifest": {{'.encode()


def records_text(manifest: Mapping[str, str]) -> bytearray:
    """The records of ``manifest`` (path -> record, JSON text) as the metadata holds them:
    ``"path": record`` joined by ``", "``. Non-ASCII text is written as UTF-8, not as JSON
    escapes: libyaml rejects the escaped surrogate pairs that ``json.dumps`` writes for
    characters beyond the BMP (emoji). Built ``METADATA_CHUNK`` records at a time into one
    buffer: the text of a whole manifest (2 MB at 10,000 tensors) is never held as well, nor a
    str of each record's line."""
    out = bytearray()
    items = iter(manifest.items())
    separator = ""
    while chunk := list(islice(items, METADATA_CHUNK)):
        text = separator + ", ".join([f"{json_str(path)}: {record}" for path, record in chunk])
        out += yaml_safe(text).encode()
        separator = ", "
    return out


def metadata_bytes(manifest: Mapping[str, str], world_size: int) -> bytearray:
    """The contents of ``.snapshot_metadata`` (``manifest``: path -> record, JSON text, as
    :func:`merge` returns it): JSON, which torchsnapshot's YAML parser reads
    (:func:`records_text`)."""
    out = bytearray(metadata_head(world_size))
    out += records_text(manifest)
    out += b"}}"
    return out
