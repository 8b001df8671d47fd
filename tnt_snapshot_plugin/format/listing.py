"""What a snapshot directory holds, as the plugin reads it above the store: which children are
snapshots, which of those are complete (their format's metadata file is there), what the plugin's
index of each says (checked), who wrote a child, and the snapshots in commit order.

Every reader of a dirpath asks here: the saver (its claims, leftovers, retention), restore
(latest and best), and every ``tnt-snapshot`` command; :func:`remove` is the one way the plugin
deletes a child of ``dirpath``: only one it provably wrote. :func:`describe` says what a dirpath
holds in words, for the messages of restore and the command line ("... does not exist; run1 holds
3 complete snapshots, the newest epoch_2_step_10").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.index import complete as complete_index
from tnt_snapshot_plugin.format.index import parse as parse_index
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.policies.retention import Listed, commit_order, from_index
from tnt_snapshot_plugin.stores.base import WRITER_FNAME, Store, check_deletable_name, is_missing_key
from tnt_snapshot_plugin.stores.ownership import staged_by_this_process


def read_json(store: Store, name: str, rel: str) -> Optional[dict[str, Any]]:
    """The JSON object in file ``rel`` of child ``name``; None if missing or not one."""
    try:
        value = json.loads(store.read_file(name, rel))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, UnicodeDecodeError,
            RecursionError, SnapshotCorruptError):
        return None
    except Exception as exc:
        # read_file raises the plugin's error (s3_errors), botocore's as its cause
        if is_missing_key(exc) or is_missing_key(exc.__cause__):  # type: ignore[arg-type]
            return None
        raise
    return value if isinstance(value, dict) else None


def is_complete(store: Store, name: str) -> bool:
    """Whether child ``name`` holds the metadata file of a format the plugin reads (written last
    by a commit: the snapshot is complete)."""
    return any(store.has_file(name, metadata) for metadata in metadata_files())


def read_index(store: Store, name: str) -> Optional[dict[str, Any]]:
    """The plugin's index of child ``name`` (a JSON object with ``format``), or None."""
    index = read_json(store, name, INDEX_FNAME)
    return index if index is not None and "format" in index else None


def checked_index(store: Store, name: str, *, parts: bool = False) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the index of snapshot ``name``, checked by ``index.parse``; or None, why it is damaged):
    (None, None) for a snapshot the plugin did not write (no index and no writer marker:
    torchtnt's, torchsnapshot's), (None, reason) for one whose index is missing while its writer
    marker says the plugin wrote it, or that is unreadable or changed. ``parts``: with every file
    and checksum of a snapshot of several ranks (``index.complete``: each part read and checked),
    not only the index itself."""
    try:
        data = store.read_optional(name, INDEX_FNAME)
    except SnapshotCorruptError as exc:  # not a regular file inside the snapshot
        return None, f"its index {INDEX_FNAME} cannot be read ({exc})"
    if data is None:
        if read_json(store, name, WRITER_FNAME) is not None:
            return None, (
                f"its index {INDEX_FNAME} is missing, though its writer marker says this plugin "
                "wrote it: its files cannot be checked"
            )
        return None, None
    try:
        index = parse_index(data, store.child(name))
    except SnapshotCorruptError as exc:
        return None, getattr(exc, "reason", str(exc))
    return completed_index(store, name, index) if parts else (index, None)


def completed_index(store: Store, name: str, index: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``index`` (of snapshot ``name``, checked) with every part's files and checksums
    (``index.complete``); (None, why) where a part is missing or damaged."""
    try:
        return complete_index(index, lambda rel: store.read_optional(name, rel), store.child(name)), None
    except SnapshotCorruptError as exc:
        return None, getattr(exc, "reason", str(exc))


def read_writer(store: Store, name: str) -> Optional[dict[str, Any]]:
    """Who wrote child ``name``: its writer marker, else its index's ``writer``; or None."""
    marker = read_json(store, name, WRITER_FNAME)
    if marker is not None and "run_id" in marker:
        return marker
    index = read_index(store, name)
    writer = index.get("writer") if index is not None else None
    return writer if isinstance(writer, dict) else None


def provably_ours(store: Store, name: str) -> bool:
    """Whether child ``name`` holds the plugin's index or writer marker."""
    return read_index(store, name) is not None or read_json(store, name, WRITER_FNAME) is not None


def listed(store: Store, *, torchtitan: bool = False) -> list[Listed]:
    """Complete snapshots in ``dirpath`` with what their indexes say, in commit order (oldest
    first): one listing, then one read of each index and one existence check each. A snapshot
    whose index is damaged is listed with the reason (``Listed.problem``), in its place by
    (epoch, step). ``torchtitan``: torchtitan's ``step-N`` checkpoints too (restore's listing:
    ``SnapshotName.parse_listed``); other tools' checkpoints carry no commit sequence number, so
    they come before the plugin's, ordered by their names' (epoch, step)."""
    parse = SnapshotName.parse_listed if torchtitan else SnapshotName.parse
    found = []
    for text in store.list_names():
        parsed = parse(text)
        if parsed is not None and is_complete(store, text):
            if parsed.foreign:
                found.append(from_index(parsed, None))
                continue
            index, problem = checked_index(store, text)
            found.append(from_index(parsed, index) if problem is None else Listed(parsed, problem=problem))
    return commit_order(found)


def complete_snapshots(store: Store, *, torchtitan: bool = False) -> list[SnapshotName]:
    """Complete snapshots in ``dirpath``, oldest first in commit order (policies.retention);
    ``torchtitan``: as :func:`listed`."""
    return [r.name for r in listed(store, torchtitan=torchtitan)]


#: How many children of a dirpath :func:`passed_over` looks into (one or two requests each on
#: an object store).
LOOKED_INTO = 50


@dataclass(frozen=True)
class PassedOver:
    """Checkpoints in a dirpath that restore's listing cannot put in order (:func:`passed_over`)."""

    #: directories holding a format's metadata file under a name that orders nothing
    unordered: list[str]
    #: directories named as another tool names its checkpoints (torchtnt's phase-aware names,
    #: torchtitan's ``step-N``) without that tool's metadata file, which it writes last: an
    #: unfinished or interrupted save, or a copy that lost it; nothing says they are complete
    undecided: list[str]


def passed_over(store: Store) -> PassedOver:
    """The checkpoints of ``store``'s dirpath that ``restore_from_latest`` cannot consider, for
    its warning: complete ones it cannot order, and other tools' that it cannot judge complete
    (the plugin's own unfinished writes are its staging directories and interrupted commits,
    said elsewhere). Looks into the first :data:`LOOKED_INTO` such children, by name."""
    unordered: list[str] = []
    undecided: list[str] = []
    looked = 0
    for text in sorted(store.list_names()):
        if looked >= LOOKED_INTO:
            break
        if text.startswith(".") or is_staging_name(text):
            continue
        parsed = SnapshotName.parse_listed(text)
        if parsed is not None and not parsed.foreign:
            continue  # the plugin's form: commit order and its checks say the rest
        looked += 1
        complete = is_complete(store, text)
        if parsed is None and complete:
            unordered.append(text)
        elif parsed is not None and not complete:
            undecided.append(text)
    return PassedOver(unordered, undecided)


def occupant(store: Store, name: str) -> Optional[str]:
    """What holds child ``name``: None (nothing), "ours" (provably the plugin's) or "foreign"."""
    if name not in store.list_names():
        return None
    return "ours" if provably_ours(store, name) else "foreign"


def remove(store: Store, name: str) -> None:
    """Delete child ``name``: only a name this plugin writes, only inside ``dirpath``, and only if
    it provably holds what the plugin wrote (its index or writer marker), or is a write of this
    very process, or a bare staging directory of a writer killed before its marker."""
    check_deletable_name(store.url, name)  # before anything in it is read
    if (
        not staged_by_this_process(name)
        and not provably_ours(store, name)
        and store.bare_staging_writer(name) is None
        and name in store.list_names()
    ):
        raise SnapshotError(
            f"refusing to delete {store.child(name)}: it holds neither the plugin's index "
            f"{INDEX_FNAME} nor its writer marker {WRITER_FNAME}, so the plugin did not write it"
        )
    store.delete(name, unpublish=metadata_files())


class Deletions:
    """The plugin's deletions in one dirpath, as retention applies them: :meth:`remove` deletes
    only what the plugin provably wrote (:func:`remove`)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def remove(self, name: str) -> None:
        remove(self.store, name)

    def child(self, name: str) -> str:
        return self.store.child(name)


#: How many snapshot names a message lists before "...".
SHOWN = 5


def complete_names(store: Store) -> list[str]:
    """The complete snapshots in ``store``'s directory, oldest first in commit order; [] when
    the directory cannot be listed (missing, not a directory, unreachable)."""
    try:
        return [s.text for s in complete_snapshots(store)]
    except Exception:  # a message about another problem must not fail on this one
        return []


def describe(store: Store) -> str:
    """``"DIR holds 3 complete snapshots: a, b, c (the newest c)"``, or ``"DIR holds no
    complete snapshot"``."""
    names = complete_names(store)
    if not names:
        return f"{store.url} holds no complete snapshot"
    if len(names) == 1:
        return f"{store.url} holds one complete snapshot, {names[0]}"
    shown = names[-SHOWN:]
    more = "..., " if len(names) > SHOWN else ""
    return f"{store.url} holds {len(names)} complete snapshots: {more}{', '.join(shown)} (the newest {names[-1]})"
