"""What a snapshot directory holds, as ``ls``, ``verify`` and ``prune`` see it: one listing, each
committed snapshot judged by ``verify.check`` (the check restore_from_latest makes), and the
snapshot restore would pick. No torch import."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from tnt_snapshot_plugin.cli.app import UsageProblem
from tnt_snapshot_plugin.cli.output import (
    STATUS_COMPLETE,
    STATUS_DAMAGED,
    STATUS_FOREIGN,
    STATUS_INCOMPLETE,
    STATUS_LOCK,
    STATUS_STAGING,
)
from tnt_snapshot_plugin.errors import ConfigError, SnapshotError, SnapshotNotFoundError
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.index import INDEX_FNAME, PARTS_DIR
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.restoring.latest import restore_order
from tnt_snapshot_plugin.stores import LEASE_FNAME, LOCK_FNAME, WRITER_FNAME, LocalStore, Store
from tnt_snapshot_plugin.stores.ownership import holder_text, writer_gone
from tnt_snapshot_plugin.stores.s3 import S3Store, s3_errors


@dataclass
class FileInfo:
    size: int
    mtime: float


@dataclass
class Listing:
    """Every object under a directory: subdirectories' files, top-level files, symlinks."""

    dirs: dict[str, dict[str, FileInfo]] = field(default_factory=dict)
    dir_mtimes: dict[str, float] = field(default_factory=dict)
    files: dict[str, FileInfo] = field(default_factory=dict)
    links: set[str] = field(default_factory=set)


def _walk_local(path: str) -> tuple[dict[str, FileInfo], float]:
    """Files below ``path`` (relative, '/'-separated) and the newest mtime; links not followed."""
    found: dict[str, FileInfo] = {}
    newest = os.lstat(path).st_mtime
    for parent, dirs, names in os.walk(path, followlinks=False):
        for d in dirs:
            newest = max(newest, os.lstat(os.path.join(parent, d)).st_mtime)
        for n in names:
            st = os.lstat(os.path.join(parent, n))
            rel = os.path.relpath(os.path.join(parent, n), path).replace(os.sep, "/")
            found[rel] = FileInfo(st.st_size, st.st_mtime)
            newest = max(newest, st.st_mtime)
    return found, newest


def list_directory(store: Store) -> Listing:
    """One pass over ``store``'s directory (one paginated listing on S3)."""
    out = Listing()
    if isinstance(store, LocalStore):
        if not os.path.lexists(store.root):
            raise SnapshotNotFoundError(f"{store.url} does not exist")
        if not os.path.isdir(store.root):
            raise UsageProblem(f"{store.url} is a file, not a directory of snapshots")
        with os.scandir(store.root) as entries:
            for e in entries:
                if e.is_symlink():
                    out.links.add(e.name)
                elif e.is_dir(follow_symlinks=False):
                    out.dirs[e.name], out.dir_mtimes[e.name] = _walk_local(e.path)
                else:
                    st = e.stat(follow_symlinks=False)
                    out.files[e.name] = FileInfo(st.st_size, st.st_mtime)
        return out
    if isinstance(store, S3Store):
        prefix = store.prefix.rstrip("/") + "/" if store.prefix else ""
        for key, info in _s3_objects(store, prefix):
            rel = key[len(prefix):]
            top, sep, rest = rel.partition("/")
            if not sep:
                out.files[top] = info
            elif rest:
                out.dirs.setdefault(top, {})[rest] = info
                out.dir_mtimes[top] = max(out.dir_mtimes.get(top, 0.0), info.mtime)
        return out
    raise ConfigError(f"cannot list {store.url}: unsupported store {type(store).__name__}")


def _s3_objects(store: S3Store, prefix: str) -> Iterator[tuple[str, FileInfo]]:
    with s3_errors(store.url, store.hints):
        for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], FileInfo(int(obj["Size"]), obj["LastModified"].timestamp())


def snapshot_files(store: Store, name: str) -> tuple[dict[str, FileInfo], float]:
    """The files of one child directory of ``store`` and their newest mtime."""
    if isinstance(store, LocalStore):
        path = os.path.join(store.root, name)
        if os.path.islink(path):
            raise UsageProblem(f"{store.child(name)} is a symlink; tnt-snapshot does not follow symlinks")
        if not os.path.isdir(path):
            if os.path.exists(path):
                raise UsageProblem(f"{store.child(name)} is a file, not a snapshot directory")
            raise SnapshotNotFoundError(f"{store.child(name)} does not exist; {listing.describe(store)}")
        return _walk_local(path)
    assert isinstance(store, S3Store)
    prefix = store._key(name) + "/"
    files = {key[len(prefix):]: info for key, info in _s3_objects(store, prefix)}
    if not files:
        raise SnapshotNotFoundError(
            f"{store.child(name)} does not exist (no objects under it); {listing.describe(store)}"
        )
    return files, max(i.mtime for i in files.values())


@dataclass
class SnapshotInfo:
    """One child of a snapshot directory, as ``ls`` and ``verify`` see it."""

    name: str
    kind: str  # "snapshot", "staging", "lock" (the plugin's lock or lease file), "foreign"
    status: str
    parsed: Optional[SnapshotName] = None
    files: dict[str, FileInfo] = field(default_factory=dict)
    modified_at: Optional[float] = None
    #: ``verify.check``'s verdict (committed snapshots only)
    verdict: Optional[verify.Verdict] = None
    problems: list[str] = field(default_factory=list)
    note: str = ""
    restore: bool = False
    #: whether the payloads' checksums were compared (``verify``, and ``ls``'s pick)
    checksummed: bool = False
    #: a lock or lease file's record of its holder (host, pid, run_id, started_at), if readable
    holder: Optional[dict[str, Any]] = None

    @property
    def index(self) -> Optional[dict[str, Any]]:
        return self.verdict.index if self.verdict is not None else None

    @property
    def metadata(self) -> Any:
        return self.verdict.metadata if self.verdict is not None else None

    @property
    def without_checksums(self) -> bool:
        """A committed snapshot another tool wrote (no index of the plugin's): it records no
        checksums; its files' sizes and its metadata's consistency are what can be checked."""
        verdict = self.verdict
        return verdict is not None and verdict.index is None and verdict.index_problem is None

    @property
    def writer(self) -> Optional[str]:
        if self.index is not None or self.kind == "lock" or (self.verdict is not None and self.verdict.index_problem):
            return "tnt_snapshot_plugin"
        if self.parsed is not None and self.parsed.phase_aware:
            return "torchtnt"
        return None

    @property
    def world_size(self) -> Optional[int]:
        if self.index is not None and type(self.index.get("world_size")) is int:
            return int(self.index["world_size"])
        size = getattr(self.metadata, "world_size", None)
        return size if type(size) is int else None

    @property
    def committed_at(self) -> Optional[float]:
        value = (self.index or {}).get("committed_at")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        meta = next((self.files[m] for m in metadata_files() if m in self.files), None)
        return meta.mtime if meta is not None and self.kind == "snapshot" else None

    @property
    def seq(self) -> Optional[int]:
        value = (self.index or {}).get("seq")
        return value if type(value) is int else None

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        p = self.parsed
        return {
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "writer": self.writer,
            "epoch": p.epoch if p else None,
            "step": p.step if p else None,
            "eval_step": p.eval_step if p else None,
            "metric": {"name": p.metric, "value": p.metric_value} if p and p.metric else None,
            "world_size": self.world_size,
            "bytes": self.nbytes,
            "files": len(self.files),
            "committed_at": self.committed_at,
            "modified_at": self.modified_at,
            "seq": self.seq,
            "written_by": (self.index or {}).get("writer"),  # {"host", "pid", "run_id"} when recorded
            "restore": self.restore,
            "checksums_checked": self.checksummed,
            "checksums_recorded": None if self.verdict is None else not self.without_checksums,
            "problems": list(self.problems),
            "note": self.note,
            "holder": self.holder,  # lock and lease files: {"host", "pid", "run_id", "started_at", ...}
        }


def check_snapshot(
    store: Store,
    name: str,
    files: dict[str, FileInfo],
    *,
    checksums: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> verify.Verdict:
    """``verify.check`` of a committed snapshot, with the sizes of ``files`` (one listing)."""
    return verify.check(
        store, name, sizes={rel: f.size for rel, f in files.items()}, checksums=checksums, progress=progress
    )


def _listed(info: SnapshotInfo) -> retention.Listed:
    """What the core's retention knows of ``info`` (its name and index)."""
    assert info.parsed is not None
    if info.verdict is not None and info.verdict.index_problem is not None:
        return retention.Listed(info.parsed, problem=info.verdict.index_problem)
    return retention.from_index(info.parsed, None if info.parsed.phase_aware else info.index)


def commit_order(infos: Iterable[SnapshotInfo]) -> list[SnapshotInfo]:
    """Oldest first, in the core's commit order (``retention.commit_order``, which
    ``format.listing.listed`` and ``restore_from_latest`` use)."""
    by_name = {i.name: i for i in infos if i.parsed is not None}
    return [by_name[r.text] for r in retention.commit_order(_listed(i) for i in by_name.values())]


def holds_one_snapshot(name: str, listing: Listing) -> bool:
    """Whether a directory named ``name`` holding ``listing`` is one snapshot (not a directory
    of snapshots): it holds a snapshot's own files (the metadata, the plugin's index or writer
    record), or it is named like a snapshot and none of its children is (an interrupted write,
    or on an object store a snapshot that does not exist)."""
    if {*metadata_files(), INDEX_FNAME, WRITER_FNAME} & set(listing.files):
        return True
    if SnapshotName.parse(name) is None:
        return False
    return not any(SnapshotName.parse(d) is not None or is_staging_name(d) for d in listing.dirs)


def snapshot_info(
    store: Store, name: str, *, checksums: bool, progress: Optional[Callable[[int], None]] = None
) -> SnapshotInfo:
    """One snapshot given by path, judged by ``verify.check`` (with its checksums if asked)."""
    files, modified = snapshot_files(store, name)
    parsed = SnapshotName.parse(name)
    if not _committed(files):
        return SnapshotInfo(name, "snapshot", STATUS_INCOMPLETE, parsed=parsed, files=files, modified_at=modified,
                            problems=[f"{_metadata_names()} is missing: the snapshot is incomplete"])
    verdict = check_snapshot(store, name, files, checksums=checksums, progress=progress)
    return SnapshotInfo(name, "snapshot", STATUS_COMPLETE if verdict.intact else STATUS_DAMAGED,
                        parsed=parsed, files=files, modified_at=modified, verdict=verdict,
                        problems=list(verdict.problems), note="; ".join(verdict.notes), checksummed=checksums)


def _committed(files: dict[str, FileInfo]) -> bool:
    """Whether a snapshot's files hold the metadata of a format (its commit wrote it last)."""
    return any(m in files for m in metadata_files())


def _metadata_names() -> str:
    return " or ".join(metadata_files())


def file_role(rel: str) -> str:
    """What one file of a snapshot is: "metadata", "index", "writer" (the writer's record) or "payload"."""
    if rel in metadata_files():
        return "metadata"
    if rel == INDEX_FNAME or rel.startswith(PARTS_DIR + "/"):
        return "index"
    return "writer" if rel == WRITER_FNAME else "payload"


def survey(
    store: Store,
    *,
    checksums: bool = False,
    progress: Optional[Callable[[int], None]] = None,
    listing: Optional[Listing] = None,
) -> list[SnapshotInfo]:
    """Every child of the snapshot directory (``listing``: its listing, if already made),
    classified: snapshots oldest first, then staging leftovers, then foreign entries. The snapshot
    ``restore_from_latest`` would restore is marked (``restore_pick``)."""
    listing = list_directory(store) if listing is None else listing
    snapshots: list[SnapshotInfo] = []
    staging: list[SnapshotInfo] = []
    foreign: list[SnapshotInfo] = []
    for name in sorted(listing.links):
        foreign.append(SnapshotInfo(name, "foreign", STATUS_FOREIGN, note="symlink (never followed)"))
    plugin_files: list[SnapshotInfo] = []
    for name, info in sorted(listing.files.items()):
        if name in (LOCK_FNAME, LEASE_FNAME):
            holder = lock_holder(store, name)
            plugin_files.append(
                SnapshotInfo(name, "lock", STATUS_LOCK, files={"": info}, modified_at=info.mtime,
                             note=lock_note(name, holder), holder=holder)
            )
            continue
        foreign.append(
            SnapshotInfo(name, "foreign", STATUS_FOREIGN, files={"": info}, modified_at=info.mtime, note="file")
        )
    for name, files in sorted(listing.dirs.items()):
        modified = listing.dir_mtimes.get(name)
        parsed = SnapshotName.parse(name)
        if is_staging_name(name):
            staging.append(
                SnapshotInfo(name, "staging", STATUS_STAGING, files=files, modified_at=modified,
                             note="an interrupted write, or one in progress")
            )
        elif parsed is None:
            foreign.append(SnapshotInfo(name, "foreign", STATUS_FOREIGN, files=files, modified_at=modified, note="directory"))
        elif not _committed(files):
            snapshots.append(
                SnapshotInfo(name, "snapshot", STATUS_INCOMPLETE, parsed=parsed, files=files, modified_at=modified,
                             note=f"no {_metadata_names()}: an interrupted write, or one in progress")
            )
        else:
            verdict = check_snapshot(store, name, files, checksums=checksums, progress=progress)
            snapshots.append(
                SnapshotInfo(name, "snapshot", STATUS_COMPLETE if verdict.intact else STATUS_DAMAGED, parsed=parsed,
                             files=files, modified_at=modified, verdict=verdict, problems=list(verdict.problems),
                             note="; ".join(verdict.notes), checksummed=checksums)
            )
    pick = restore_pick(store, snapshots, progress=progress)
    if pick is not None:
        pick.restore = True
    # Committed snapshots in commit order; then those never committed (no metadata), by progress.
    committed = [i for i in snapshots if i.status != STATUS_INCOMPLETE]
    never = sorted((i for i in snapshots if i.status == STATUS_INCOMPLETE), key=lambda i: i.parsed.sort_key)  # type: ignore[union-attr]
    return commit_order(committed) + never + staging + plugin_files + foreign


def lock_note(name: str, holder: Optional[dict[str, Any]]) -> str:
    """What a lock or lease file is and who holds it (it is the plugin's; never touched)."""
    what = "the dirpath lock of a saver's run" if name == LOCK_FNAME else "the dirpath lease of a saver's run (S3)"
    return f"{what}, {holder_state(holder)} (the plugin's own; a leftover of a killed run is harmless)"


def holder_state(holder: Optional[dict[str, Any]]) -> str:
    """Who holds a lock or lease (``holder``: its record), or why its holder is known to be gone:
    "held by host 'h' pid 12 run 'r' since ...", "left by ... (its process 12 is dead)", "expired"."""
    if holder is None:
        return "its holder not recorded"
    who = holder_text(holder)
    expires = holder.get("expires_at")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool) and expires <= time.time():
        return f"expired, left by {who}"
    gone = writer_gone(holder, stale_after=float("inf"))
    return f"left by {who} ({gone})" if gone is not None else f"held by {who}"


def lock_holder(store: Store, name: str) -> Optional[dict[str, Any]]:
    try:
        holder = json.loads(store.read_file("", name) or b"null")
    except (OSError, ValueError, RecursionError, SnapshotError):
        return None
    return holder if isinstance(holder, dict) and holder.get("host") is not None else None


def restore_pick(
    store: Store, snapshots: list[SnapshotInfo], *, progress: Optional[Callable[[int], None]] = None
) -> Optional[SnapshotInfo]:
    """The snapshot ``restore_from_latest`` restores: the newest in commit order that
    ``verify.check`` finds intact and whose payloads match their checksums (restore verifies
    every byte it reads, and falls back from a snapshot that does not). A snapshot found damaged
    on the way is marked so."""
    by_name = {s.name: s for s in snapshots if s.parsed is not None and s.status in (STATUS_COMPLETE, STATUS_DAMAGED)}
    for listed in restore_order(_listed(info) for info in by_name.values()):
        info = by_name[listed.text]
        if info.status != STATUS_COMPLETE:
            continue
        if not info.checksummed:
            assert info.verdict is not None
            verify.check_payloads(store, info.verdict, progress)
            info.checksummed = True
            if not info.verdict.intact:
                info.status = STATUS_DAMAGED
                info.problems = list(info.verdict.problems)
                continue
        return info
    return None
