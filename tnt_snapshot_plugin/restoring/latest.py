"""Which snapshot to restore: the latest complete one (falling back from damaged ones with a
warning naming each), or the best by a metric; what a dirpath holds when there is none to
restore (:func:`found_in`); and :func:`restore`, the one-call form of a :class:`RestoreRequest`."""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
import warnings
from typing import Any, Iterable, Mapping, NamedTuple, Optional

import pluggy

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import (
    ConfigError,
    InterruptedCommitWarning,
    NothingToRestoreWarning,
    PassedOverWarning,
    SnapshotCorruptError,
    SnapshotFallbackWarning,
)
from tnt_snapshot_plugin.format import listing, registry, verify
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.policies import retention
from tnt_snapshot_plugin.restoring.files import not_a_directory
from tnt_snapshot_plugin.restoring.request import RestoreRequest
from tnt_snapshot_plugin.stores import LocalStore, Store, open_store
from tnt_snapshot_plugin.stores.base import LEASE_FNAME, LOCK_FNAME
from tnt_snapshot_plugin.stores.ownership import writer_gone

logger = logging.getLogger("tnt_snapshot_plugin.restoring")


def latest_snapshot(
    dirpath: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    collectives: Optional[Collectives] = None,
    verified: bool = False,
    torchtitan: bool = True,
) -> Optional[str]:
    """The path of the newest complete snapshot in ``dirpath`` (rank 0 decides), or None.

    ``verified``: skip, with a SnapshotFallbackWarning, snapshots whose files are missing or
    truncated. ``torchtitan``: consider torchtitan's ``step-N`` checkpoints too (a restore into
    something they do not map onto, a LightningModule, leaves them out).
    """
    coll = collectives or Collectives(None)
    store = open_store(dirpath, storage_options)

    def newest() -> Optional[str]:
        for found in reversed(listing.complete_snapshots(store, torchtitan=torchtitan)):
            problem = verify.check(store, found.text).problem if verified else None
            if problem is None:
                return store.child(found.text)
            path = store.child(found.text)
            warnings.warn(
                f"skipping damaged snapshot {path}: {one_line(problem, path)}",
                SnapshotFallbackWarning,
                stacklevel=4,
            )
        return None

    return coll.on_rank0(newest)


def best_snapshot(
    dirpath: str,
    metric: str,
    mode: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    collectives: Optional[Collectives] = None,
) -> Optional[str]:
    """The path of the best complete snapshot in ``dirpath`` by ``metric`` (``mode`` "min" or
    "max"; NaN worst; of equal values the earlier commit), any writer's, or None if no complete
    snapshot carries the metric (rank 0 decides). Ranking: :func:`retention.ranked`."""
    if mode not in retention.MODES:
        raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
    coll = collectives or Collectives(None)

    def pick() -> Optional[str]:  # rank 0's dirpath only (the others may pass "")
        store = open_store(dirpath, storage_options)
        found = retention.best(listing.listed(store), metric, mode)
        return store.child(found.text) if found is not None else None

    return coll.on_rank0(pick)


def restore(
    path: str,
    app_state: Mapping[str, Any],
    *,
    optional_keys: Iterable[str] = (),
    storage_options: Optional[dict[str, Any]] = None,
    collectives: Optional[Collectives] = None,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    strict: bool = True,
    rest: Optional[dict[str, Any]] = None,
    io_concurrency: Optional[int] = None,
    weights_only: bool = True,
) -> list[str]:
    """Load snapshot ``path`` into ``app_state`` (key -> Stateful); the keys loaded, the RNG
    state last. Arguments: :class:`RestoreRequest`.

    Under torch.distributed rank 0's ``path`` is used (the others may pass anything). Modules are
    checked against the snapshot (keys, shapes) before anything is loaded; a tensor of another
    dtype than saved is a StateMismatchError, never a cast. A snapshot that does not fit
    ``app_state`` raises StateMismatchError; an exception raised by an entry's own
    ``state_dict()``/``load_state_dict()`` propagates as it is (torch's own classes: as a
    StateMismatchError naming the entry); only a failure to read or decode the snapshot's files
    raises SnapshotCorruptError; an object torch's restricted unpickler refuses raises
    UnrestorableStateError unless ``weights_only=False``.
    """
    return RestoreRequest(
        app_state, optional_keys=optional_keys, storage_options=storage_options, collectives=collectives,
        plugin_manager=plugin_manager, strict=strict, rest=rest, io_concurrency=io_concurrency,
        weights_only=weights_only,
    ).restore(path)


def restore_from_latest(
    dirpath: str,
    app_state: Optional[Mapping[str, Any]] = None,
    *,
    fallback: bool = True,
    newest: Optional[str] = None,
    loaded_keys: Optional[list[str]] = None,
    request: Optional[RestoreRequest] = None,
    layouts: Optional[Mapping[str, RestoreRequest]] = None,
    **fields: Any,
) -> Optional[str]:
    """Restore the newest complete snapshot of ``dirpath``; the restored path, or None if none.

    ``request`` (or ``app_state`` and the other :class:`RestoreRequest` fields as keywords) says
    what to restore into. A snapshot ``verify.check`` finds damaged, or whose files fail to load,
    is skipped with a warning naming it, and the previous one is tried (``fallback=False`` raises
    instead); when snapshots exist but none can be restored, SnapshotCorruptError is raised
    rather than letting training start from scratch. Under torch.distributed rank 0 chooses (in
    rank 0's ``dirpath``); a snapshot that any rank fails to read is skipped by every rank
    together. After a fallback every entry is loaded from the older snapshot; an optional entry
    it lacks is put back as it was before the restore, with a warning. A snapshot that is intact
    but does not fit (StateMismatchError), or an error raised by an entry's own
    ``load_state_dict``, is raised at once: an older snapshot would not fit either.
    ``newest``: a snapshot name; only it and the snapshots before it are tried. ``loaded_keys``:
    a list that gets the keys loaded from the snapshot restored.

    Other tools' checkpoints are candidates too: torchtnt's (``epoch_E_train_step_S...``) and
    torchtitan's (``step-N``), before the plugin's (they carry no commit sequence number), in
    the order of their names. ``layouts``: the request that restores a checkpoint of another
    tool's layout, by the origin of its name (``naming.TORCHTITAN``: its entries are
    torchtitan's keys, not the plugin's); a checkpoint of any other origin is restored by
    ``request``, by key. Checkpoints it cannot consider are named in a PassedOverWarning: a
    directory holding a format's metadata under a name that orders nothing (restore it by path),
    and another tool's checkpoint without its metadata file that would have been tried before
    the one restored.
    """
    if request is None:
        assert app_state is not None, "restore_from_latest needs app_state or request"
        request = RestoreRequest(app_state, **fields)
    coll = request.collectives or Collectives(None)
    request = request.replace(collectives=coll)
    dirpath = coll.broadcast(dirpath)  # rank 0's, as the saver writes to rank 0's
    store = open_store(dirpath, request.storage_options)
    fallbacks = _Fallbacks(request, store, fallback, {k: r.replace(collectives=coll) for k, r in (layouts or {}).items()})
    for name in _candidates(store, dirpath, coll, newest):
        loaded = fallbacks.attempt(name)
        if loaded is not None:
            if loaded_keys is not None:
                loaded_keys.extend(loaded)
            if coll.rank == 0 and newest is None:
                warn_passed_over(store, name)
            return store.child(name)
    if fallbacks.damaged:
        # Never start from scratch silently when snapshots exist but none can be read.
        raise SnapshotCorruptError(
            f"every snapshot in {dirpath} is damaged: {'; '.join(fallbacks.damaged)}. Nothing was "
            "restored; restore a snapshot by path, or move the directory aside to start from scratch"
        )
    # Never start from scratch silently: a misspelt dirpath, another tool's checkpoints or
    # snapshots never committed are named, once (rank 0).
    found = coll.on_rank0(lambda: found_in(store))
    if coll.rank == 0:
        warnings.warn(
            f"restore_from_latest: dirpath {dirpath} {found.text}: nothing was restored and "
            f"training starts from the beginning; {found.advice}",
            NothingToRestoreWarning,
            stacklevel=2,
        )
    return None


class _Fallbacks:
    """restore_from_latest's walk from the newest snapshot back: each tried in turn, a damaged one
    skipped with a warning. A failed load may have loaded some entries already: the next try
    loads every entry again, and an optional entry the snapshot restored lacks is put back as it
    was before the first try (kept deep-copied, only for optional entries: small by nature)."""

    def __init__(
        self, request: RestoreRequest, store: Store, fallback: bool, layouts: Mapping[str, RestoreRequest]
    ) -> None:
        self.request, self.store, self.fallback = request, store, fallback
        self.layouts = layouts
        self.coll = request.collectives or Collectives(None)
        self.optional = [k for k in request.optional_keys if k in request.app_state]
        self.before: dict[str, Any] = {}
        self.damaged: list[str] = []

    def attempt(self, name: str) -> Optional[list[str]]:
        """The keys loaded from snapshot ``name``, or None if it is damaged (warned about)."""
        path = self.store.child(name)
        checked: list[verify.Verdict] = []  # rank 0's: its metadata is not read twice
        problem = self.coll.on_rank0(functools.partial(_check, self.store, name, checked, self.coll.world_size))
        if problem is None:
            if not self.damaged:
                self.before = _optional_state(self.request.app_state, self.optional)
            try:
                loaded = self._request_for(name).restore(path, checked[0] if checked else None, store=self.store)
            except SnapshotCorruptError as exc:
                if self.coll.world_size > 1 and not getattr(exc, "all_ranks", False):
                    raise  # raised on this rank only: the others cannot follow to another snapshot
                problem = str(exc)
            else:
                if self.damaged:
                    logger.info("restore_from_latest used %s; skipped: %s", path, "; ".join(self.damaged))
                    _reset_unloaded(self.request.app_state, self.before, loaded, path)
                return loaded
        _skip(path, problem, self.fallback, self.damaged)
        return None

    def _request_for(self, name: str) -> RestoreRequest:
        """The request that restores checkpoint ``name``: its layout's, else the request's."""
        parsed = SnapshotName.parse_listed(name)
        return self.layouts.get(parsed.origin, self.request) if parsed is not None else self.request


class Found(NamedTuple):
    """What a dirpath without a snapshot to restore holds (:func:`found_in`)."""

    #: completes "dirpath X ...": "does not exist", "is empty", "holds no snapshot, only ..."
    text: str
    #: what to do about it
    advice: str
    #: whether it holds nothing at all (missing, or only the plugin's lock or lease): a first run
    empty: bool


#: How many names of each kind a message names.
_NAMED = 3
#: How many entries of an object-store dirpath are looked into (one request or two each).
_LOOKED_INTO = 50
#: Names of files other tools write as checkpoints, by their endings.
_CHECKPOINT_FILES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".distcp", ".pkl")
_CHECK_THE_PATH = "check the path if a run was expected there"


def found_in(store: Store) -> Found:
    """What ``store``'s dirpath holds, said where it holds no snapshot to restore: nothing (or no
    such directory), or the other things it holds by kind, a few named: damaged snapshots,
    snapshots never committed (no ``.snapshot_metadata``), interrupted writes, torch.distributed.checkpoint
    checkpoints (a ``.metadata`` file), other tools' checkpoint files (``last.ckpt``, ``*.pt``),
    other files and directories."""
    entries: list[tuple[str, bool]]  # (name, is a directory)
    if isinstance(store, LocalStore):
        if not os.path.lexists(store.root):
            return Found("does not exist", _CHECK_THE_PATH, True)
        with os.scandir(store.root) as scan:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in scan)
    else:  # an object store lists the "directories" under the prefix only
        entries = [(name, True) for name in sorted(store.list_names())]
    entries = [(n, d) for n, d in entries if n not in (LOCK_FNAME, LEASE_FNAME) and not n.startswith(".tnt_write_probe.")]
    if not entries and isinstance(store, LocalStore):
        return Found(
            "is empty",
            f"{_CHECK_THE_PATH} (the saver's constructor creates its dirpath: a misspelt one exists, empty)",
            True,
        )
    if not entries:
        return Found("holds no snapshot directories", _CHECK_THE_PATH, True)
    kinds: dict[str, list[str]] = {}
    for name, is_dir in entries[:_LOOKED_INTO]:
        kinds.setdefault(_kind(store, name, is_dir), []).append(name)
    if len(entries) > _LOOKED_INTO:
        kinds.setdefault("other entries", []).append(f"{len(entries) - _LOOKED_INTO} more")
    held = "; ".join(
        f"{kind} ({', '.join(names[:_NAMED])}{f' and {len(names) - _NAMED} more' if len(names) > _NAMED else ''})"
        for kind, names in kinds.items()
    )
    return Found(
        f"holds no snapshot to restore, only {held}",
        f"restore_from_latest reads directories holding {' or '.join(registry.metadata_files())} "
        "named epoch_E_step_S, epoch_E_train_step_S or step-N; pass the dirpath the saver wrote to, "
        "or restore a checkpoint by path",
        False,
    )


def _kind(store: Store, name: str, is_dir: bool) -> str:
    """What kind of thing child ``name`` of a dirpath without a snapshot to restore is."""
    if not is_dir:
        if name.endswith(_CHECKPOINT_FILES):
            return "other tools' checkpoint files"
        return "other files"
    if is_staging_name(name):
        return "interrupted snapshot writes, never restored"
    parsed = SnapshotName.parse_listed(name)
    if parsed is not None:
        if listing.is_complete(store, name):
            return "damaged snapshots"
        if parsed.foreign:
            return (
                f"other tools' checkpoints without their metadata file ({' or '.join(registry.metadata_files())}), "
                "which nothing says are complete"
            )
        return f"snapshots never committed, without {' or '.join(registry.metadata_files())}"
    if store.has_file(name, ".metadata"):
        return "torch.distributed.checkpoint checkpoints under names that order nothing, restored by path only"
    return "other directories"


def warn_passed_over(store: Store, restored: Optional[str]) -> None:
    """(Rank 0, once per restore) a PassedOverWarning naming the checkpoints of ``store``'s
    dirpath that restore could not consider (``listing.passed_over``): those whose names order
    nothing, and other tools' checkpoints without their metadata file that would have been tried
    before ``restored`` (the checkpoint restored: its name; None when none was)."""
    found = listing.passed_over(store)
    after = SnapshotName.parse_listed(restored) if restored is not None else None
    undecided = [
        name for name in found.undecided
        if after is None or (after.foreign and (parsed := SnapshotName.parse_listed(name)) is not None and parsed > after)
    ]
    parts = []
    if found.unordered:
        parts.append(
            f"checkpoints whose names order nothing ({_named(found.unordered)}): restore one by path "
            "(restore(path, ...)) if it is the one to resume from, or rename it"
        )
    if undecided:
        parts.append(
            f"directories named as other tools' checkpoints that hold no metadata file, which those "
            f"tools write last, so nothing says they are complete ({_named(undecided)}): an "
            "interrupted or unfinished save, or an incomplete copy"
        )
    if not parts:
        return
    chosen = f"restored {store.child(restored)}" if restored is not None else "restored nothing"
    warnings.warn(
        f"restore_from_latest {chosen} and passed over, in {store.url}, " + "; and ".join(parts),
        PassedOverWarning,
        stacklevel=4,
    )


def _named(names: list[str]) -> str:
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more


def restore_order(listed: Iterable[retention.Listed]) -> list[retention.Listed]:
    """The complete snapshots ``listed``, in the order :func:`restore_from_latest` tries them:
    newest first in commit order. It restores the first that its check finds intact and that
    loads; ``tnt-snapshot ls`` marks the one it would restore by walking the same order."""
    return retention.commit_order(listed)[::-1]


def _candidates(store: Store, dirpath: str, coll: Collectives, newest: Optional[str]) -> list[str]:
    """The complete snapshots to try, newest first (rank 0's listing); a newer directory holding
    the plugin's index but no metadata is warned about."""
    problem = coll.on_rank0(lambda: not_a_directory(store))
    if problem is not None:
        raise ConfigError(f"dirpath {dirpath!r} {problem}; pass the directory the saver wrote to")
    candidates: list[str] = coll.on_rank0(lambda: [r.text for r in restore_order(listing.listed(store, torchtitan=True))])
    if coll.rank == 0 and newest is None:
        for name in _uncommitted_after(store, candidates[0] if candidates else None):
            _warn_uncommitted(store, name, candidates[0] if candidates else None)
    if newest is not None and newest in candidates:
        candidates = candidates[candidates.index(newest):]
    return candidates


def _warn_uncommitted(store: Store, name: str, before: Optional[str]) -> None:
    """Warn that snapshot ``name`` (the plugin's index, no metadata) is not restored. On an object
    store a commit writes the index, then the metadata, under the final name: an interrupted
    commit, which loses nothing committed. On local disk a final name only ever appears by
    renaming a complete snapshot into place: its metadata was removed after the commit. On an
    object store with no complete snapshot before it, the fresh start's warning names it."""
    path = store.child(name)
    fmt = registry.format_of(store, name, listing.read_index(store, name))
    metadata = fmt.metadata_file if fmt is not None else "metadata"
    instead = (
        f"the newest complete snapshot before it, {store.child(before)}, is restored"
        if before is not None
        else "no complete snapshot precedes it"
    )
    if store.protocol.renames:
        warnings.warn(
            f"skipping damaged snapshot {path}: it holds the plugin's index but no {metadata}, "
            f"so it was damaged after its commit (a file removed, or an incomplete copy); {instead}",
            SnapshotFallbackWarning,
            stacklevel=5,
        )
        return
    if before is None:
        return  # NothingToRestoreWarning names it among what the dirpath holds
    gone = writer_gone(listing.read_writer(store, name))
    writer = f"the writer is gone: {gone}" if gone is not None else "or one still in progress: the writer is not known to be gone"
    warnings.warn(
        f"snapshot {path} is an interrupted commit ({writer}; its index was written, its "
        f"{metadata} never was): nothing committed is lost, and {instead}",
        InterruptedCommitWarning,
        stacklevel=5,
    )


#: Advice that errors about one snapshot carry, which a fallback warning does not repeat.
_ADVICE = re.compile(r"[.;] Restore an older snapshot \(restore_from_latest falls back to one by itself\)")


def one_line(problem: Optional[str], path: str) -> str:
    """``problem`` (a verdict, or an error's text, about snapshot ``path``) as one line for a
    fallback warning: without what the warning says itself (the snapshot's name before the
    problem, "could not load snapshot ...", the error's class name, the advice to restore an
    older snapshot); the files it names keep their full paths."""
    text = " ".join(str(problem).split())
    text = _ADVICE.sub("", text)
    text = re.sub(rf"^(could not load snapshot|restoring|snapshot) {re.escape(path)}( on rank \d+(, rank \d+)*)?:? ", "", text)
    return text.replace("SnapshotCorruptError: ", "")


def _skip(path: str, problem: Optional[str], fallback: bool, damaged: list[str]) -> None:
    """Record that ``path`` is damaged, with a warning; or raise where there is no fallback."""
    problem = one_line(problem, path)
    if not fallback:
        raise SnapshotCorruptError(
            f"the newest snapshot {path} is damaged: {problem}; pass fallback=True to restore "
            "the previous one instead"
        )
    damaged.append(f"{path} ({problem})")
    warnings.warn(
        f"skipping damaged snapshot {path}: {problem}; falling back to the previous snapshot",
        SnapshotFallbackWarning,
        stacklevel=5,
    )


def _uncommitted_after(store: Store, newest: Optional[str]) -> list[str]:
    """Snapshot-named directories later (by epoch and step) than complete snapshot ``newest``
    that hold the plugin's index but no metadata: a commit writes the index just before the
    metadata (and on local disk renames the whole directory into place), so such a directory
    is damage, or at most an interrupted commit on an object store."""
    parsed = SnapshotName.parse(newest) if newest is not None else None
    after = parsed.sort_key[:2] if parsed is not None else None
    found = []
    for text in store.list_names():
        name = SnapshotName.parse(text)
        if name is None or name.phase_aware or (after is not None and name.sort_key[:2] <= after):
            continue
        if not listing.is_complete(store, text) and store.has_file(text, INDEX_FNAME):
            found.append(text)
    return sorted(found)


def _check(store: Store, name: str, out: list[verify.Verdict], ranks: int) -> Optional[str]:
    """``verify.check``'s problem with snapshot ``name`` about to be restored on ``ranks`` ranks,
    or None; the verdict goes to ``out``."""
    out.append(verify.check(store, name, restoring_ranks=ranks))
    return out[-1].problem


def _optional_state(app_state: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    saved: dict[str, Any] = {}
    for key in keys:
        try:
            saved[key] = copy.deepcopy(app_state[key].state_dict())
        except Exception:  # cannot be kept: it is named in a warning if it must be put back
            saved[key] = None
    return saved


def _reset_unloaded(app_state: Mapping[str, Any], before: Mapping[str, Any], loaded: Iterable[str], path: str) -> None:
    """After a fallback: put back the optional entries ``path`` did not hold, which a damaged
    snapshot's partial load may have changed, as they were before the restore."""
    done = set(loaded)
    for key, state in before.items():
        if key in done:
            continue
        if state is not None:
            try:
                app_state[key].load_state_dict(state)
                warnings.warn(
                    f"{key} is not in {path}, the snapshot restored after falling back: it was "
                    "put back as it was before the restore (a damaged snapshot may have been "
                    "partly loaded into it)",
                    SnapshotFallbackWarning,
                    stacklevel=3,
                )
                continue
            except Exception:
                pass
        warnings.warn(
            f"{key} is not in {path}, the snapshot restored after falling back, and could not be "
            "put back as it was before the restore: it may hold values of the damaged snapshot; "
            "reset it yourself",
            SnapshotFallbackWarning,
            stacklevel=3,
        )
