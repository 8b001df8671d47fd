"""Restoring snapshots: one chosen path, or the latest complete one in a directory.

Snapshots are trusted input, as a pickle is: torchsnapshot stores non-tensor objects with
``torch.save``. They are read back with ``torch.load(weights_only=True)`` and the plugin's safe
globals (loading.py), which run no code a snapshot carries; ``weights_only=False`` loads them with
full pickle, for snapshots you (or your own jobs) wrote.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import unquote

import pluggy

from . import verify
from .app_state import RESERVED_KEYS, RNG_STATE_KEY, RNGState, Value, check_collisions
from .distributed import Collectives, raise_if_any_failed
from .errors import (
    ConfigError,
    DistributedError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    UnrestorableStateError,
)
from .format.common import METADATA_FNAME, encode
from .loading import allowed_globals, refusal
from .naming import SnapshotName
from .plugins import get_plugin_manager
from .stores import INDEX_FNAME, LocalStore, Store, open_store, split_snapshot_path

logger = logging.getLogger(__name__)


def latest_snapshot(
    dirpath: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    collectives: Optional[Collectives] = None,
    verified: bool = False,
) -> Optional[str]:
    """The path of the newest complete snapshot in ``dirpath`` (rank 0 decides), or None.

    ``verified``: skip, with a warning, snapshots whose files are missing or truncated.
    """
    coll = collectives or Collectives(None)
    store = open_store(dirpath, storage_options)

    def newest() -> Optional[str]:
        for found in reversed(store.complete_snapshots()):
            problem = verify.check(store, found.text).problem if verified else None
            if problem is None:
                return store.child(found.text)
            warnings.warn(
                f"skipping damaged snapshot {store.child(found.text)}: {problem}", stacklevel=4
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
    from . import retention

    if mode not in retention.MODES:
        raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
    coll = collectives or Collectives(None)

    def pick() -> Optional[str]:  # rank 0's dirpath only (the others may pass "")
        store = open_store(dirpath, storage_options)
        found = retention.best(store.listed(), metric, mode)
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
    _checked: Optional[verify.Verdict] = None,
) -> list[str]:
    """Load snapshot ``path`` into ``app_state`` (key -> Stateful); the RNG state last.

    ``optional_keys`` may be absent from the snapshot (a warning names them); any other key the
    snapshot lacks raises :class:`StateMismatchError` when ``strict``. Modules are checked
    against the snapshot (keys, shapes, dtypes) before anything is loaded. If ``rest`` is a dict,
    every other entry of the snapshot (none of ``app_state``'s keys, no plugin's, not the RNG
    state) is read into it as a plain state dict: an adapter reads a framework's own checkpoint
    this way without objects to load it into.
    ``weights_only=False`` unpickles object entries with full pickle (trusted snapshots only);
    by default an object torch's restricted unpickler refuses raises UnrestorableStateError.
    Returns the keys that were loaded.

    Under torch.distributed rank 0's ``path`` is used (the others may pass anything). A snapshot
    that does not fit ``app_state`` raises StateMismatchError; an exception raised by an entry's
    own ``state_dict()``/``load_state_dict()`` propagates as it is (torch's own classes: as a
    StateMismatchError naming the entry); only a failure to read or decode the snapshot's files
    raises SnapshotCorruptError. ``io_concurrency``: how many files (object-store ranges) a rank
    reads at once (torchtnt's ``KnobOptions.max_per_rank_io_concurrency``; None: the store's
    default, 8 files on local disk and 4 ranged reads on S3).
    """
    coll = collectives or Collectives(None)
    started = time.perf_counter()
    pm = plugin_manager if plugin_manager is not None else get_plugin_manager()
    path = coll.broadcast(path)
    dirpath, name = split_snapshot_path(path)
    store = open_store(dirpath, storage_options)
    _require_complete(store, name, path, coll)

    # Every check before loading runs on every rank, and the ranks agree on the outcome before
    # anyone reads or loads (a module's load_state_dict may run collectives, FSDP's do): a
    # rank-local problem (a module that does not match, unreadable metadata) is then raised on
    # every rank instead of leaving the others waiting in a collective for the timeout.
    error: Optional[SnapshotError] = None
    currents: dict[str, Any] = {}  # the modules' state dicts, asked for by the checks
    try:
        sources = [
            (f"tnt_snapshot_plugin_extra_state result #{i}", dict(r))
            for i, r in enumerate(pm.hook.tnt_snapshot_plugin_extra_state(event="restore", epoch=-1, step=-1))
            if r
        ]
        # Adapters check the unit's own keys before adding reserved entries (the train dataloader).
        check_collisions([k for k in app_state if k not in RESERVED_KEYS], sources)
        wanted = dict(app_state)
        for _source, entries in sources:
            wanted.update(entries)

        from .format import reader as fmt

        read_into, file_size, verifier = reading_io(store, name, path, io_concurrency)
        try:
            if _checked is not None and _checked.metadata is not None:
                meta = _checked.metadata  # read and checked by restore_from_latest, on this rank
            else:
                meta = fmt.parse_metadata(read_metadata(store, name, verifier), path)
            saved_world_size = meta.world_size
            # A rank the snapshot did not have checks against rank 0's entries; the world-size
            # check below decides what it may load.
            check_rank = coll.rank if coll.rank < saved_world_size else 0
            manifest = fmt.rank_view(meta, check_rank)
        except SnapshotError:
            raise  # damaged metadata, or the storage is unreachable
        except Exception as exc:
            raise SnapshotCorruptError(f"snapshot {path} has unreadable metadata: {exc}") from exc
        if not manifest:
            raise SnapshotCorruptError(f"snapshot {path} has an empty manifest: it holds no entries")
        present = fmt.saved_keys(manifest)
        restore_rng = True
        if saved_world_size != coll.world_size:
            mapped = present if rest is not None else (set(wanted) | {RNG_STATE_KEY}) & present
            restore_rng = _fit_world_size(path, meta, read_into, file_size, verifier, mapped, coll)

        optional = set(optional_keys)
        load: dict[str, Any] = {}
        missing = []
        for key, obj in wanted.items():
            if key in present:
                load[key] = obj
            elif key in optional:
                warnings.warn(
                    f"{key} was passed to restore but snapshot {path} holds no {key} state "
                    "(snapshots taken at epoch ends hold none); it was not restored",
                    stacklevel=3,
                )
            else:
                missing.append(key)
        if missing and strict:
            raise StateMismatchError(
                f"snapshot {path} holds no entries {sorted(missing)} (it holds {sorted(present)}); "
                "restore into the same kind of unit that was saved, or pass strict=False to skip them"
            )
        for key in missing:
            warnings.warn(f"{key} is not in snapshot {path}; left as it is (strict=False)", stacklevel=3)
        if strict:
            currents = _check_modules(path, load, manifest)
        sinks: dict[str, Value] = {}
        if rest is not None:
            sinks = {key: Value() for key in sorted(present - set(wanted) - {RNG_STATE_KEY})}
            load.update(sinks)

    except SnapshotError as exc:
        error = exc
    # Damage any rank found (and nothing else) is raised on every rank as such: all fall back.
    raise_if_any_failed(coll, error, f"restoring {path}", together=SnapshotCorruptError)

    order = [key for key in load if key != RNG_STATE_KEY]
    if RNG_STATE_KEY in present and restore_rng:
        order.append(RNG_STATE_KEY)  # last: loading the other entries may draw random numbers
        load[RNG_STATE_KEY] = RNGState()
    view = manifest if check_rank == coll.rank else fmt.rank_view(meta, coll.rank)
    # Every entry is read first; the ranks agree on the outcome (a damaged file anywhere: every
    # rank falls back together); only then is anything loaded into the app state.
    states: dict[str, Any] = {}
    read_errors: list[tuple[str, BaseException]] = []
    own_error: Optional[StatefulError] = None
    with allowed_globals():
        for key in order:
            target = load[key]
            try:
                current = currents.pop(key) if key in currents else target.state_dict()
            except Exception as exc:
                if not _is_users(target):
                    raise
                own_error = own_error or StatefulError(key, "state_dict", target, exc)
                continue
            try:
                states[key] = fmt.read_state_dict(
                    view, key, current, read_into,
                    verifier=verifier, file_size=file_size, weights_only=bool(weights_only),
                )
            except Exception as exc:  # agreed on below, on every rank
                read_errors.append((key, exc))
    _agree_on_read_errors(path, read_errors, coll)
    failure: Optional[BaseException] = None  # a load of the plugin's own (the RNG state, values)
    if own_error is None:
        for key in order:
            target = load[key]
            try:
                if isinstance(target, _nn_module()):
                    target.load_state_dict(states[key], strict=strict)
                else:
                    target.load_state_dict(states[key])
            except SnapshotError as exc:
                failure = exc
                break
            except Exception as exc:
                if _is_users(target):
                    own_error = StatefulError(key, "load_state_dict", target, exc)
                else:
                    failure = SnapshotCorruptError(f"could not load snapshot {path}: {key}: {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
                break
    if coll.world_size > 1:
        _agree_after_loading(path, own_error or failure, coll)
    if failure is not None:
        raise failure
    if own_error is not None:
        _raise_own_error(path, own_error)
    if rest is not None:
        rest.update((key, sink.value) for key, sink in sinks.items())
    keys = sorted(k for k in load if k != RNG_STATE_KEY) + ([RNG_STATE_KEY] if RNG_STATE_KEY in present and restore_rng else [])
    logger.info("restored snapshot %s in %.3fs (%s)", path, time.perf_counter() - started, ", ".join(keys))
    pm.hook.tnt_snapshot_plugin_after_restore(path=path, keys=keys)
    return keys


def restore_from_latest(
    dirpath: str,
    app_state: Mapping[str, Any],
    *,
    optional_keys: Iterable[str] = (),
    storage_options: Optional[dict[str, Any]] = None,
    collectives: Optional[Collectives] = None,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    strict: bool = True,
    fallback: bool = True,
    io_concurrency: Optional[int] = None,
    weights_only: bool = True,
    rest: Optional[dict[str, Any]] = None,
    newest: Optional[str] = None,
    loaded_keys: Optional[list[str]] = None,
) -> Optional[str]:
    """Restore the newest complete snapshot of ``dirpath``; the restored path, or None if none.

    A snapshot whose files are missing or truncated, or that fails to load, is skipped with a
    warning naming it, and the previous one is tried (``fallback=False`` raises instead); when
    snapshots exist but none can be restored, SnapshotCorruptError is raised rather than letting
    training start from scratch. A file whose bytes differ from the checksum recorded at write
    time is damage too. Under torch.distributed rank 0 chooses (in rank 0's ``dirpath``); a
    snapshot that any rank fails to read is skipped by every rank together (the ranks agree after
    the load, so none is left waiting in a collective). After a fallback every entry is loaded
    from the older snapshot; an optional entry it lacks is put back as it was before the restore,
    with a warning. A snapshot
    that is intact but does not fit ``app_state`` (StateMismatchError), or an error raised by an
    entry's own ``load_state_dict``, is raised at once: an older snapshot would not fit either.
    ``weights_only`` and ``rest``: as :func:`restore`. ``newest``: a snapshot name; only it and
    the snapshots before it are tried. ``loaded_keys``: a list that gets the keys :func:`restore`
    loaded from the snapshot restored (the RNG state's only if it was restored: not after a
    world-size change).
    """
    coll = collectives or Collectives(None)
    dirpath = coll.broadcast(dirpath)  # rank 0's, as the saver writes to rank 0's
    store = open_store(dirpath, storage_options)
    problem = coll.on_rank0(lambda: _not_a_directory(store))
    if problem is not None:
        raise ConfigError(f"dirpath {dirpath!r} {problem}; pass the directory the saver wrote to")
    candidates: list[str] = coll.on_rank0(
        lambda: [s.text for s in reversed(store.complete_snapshots())]
    )
    if coll.rank == 0 and newest is None:
        for name in _uncommitted_after(store, candidates[0] if candidates else None):
            warnings.warn(
                f"skipping snapshot {store.child(name)}: it holds the plugin's index but no "
                f".snapshot_metadata, so it was damaged after its commit or its commit was "
                "interrupted; the newest complete snapshot before it is restored instead",
                stacklevel=2,
            )
    if newest is not None and newest in candidates:
        candidates = candidates[candidates.index(newest):]
    damaged: list[str] = []
    # A failed load may have loaded some entries already: the fallback loads every entry again
    # from the older snapshot, and an optional entry that one lacks is put back as it was
    # before the restore (kept here, deep-copied, only for optional entries: small by nature).
    optional = [k for k in optional_keys if k in app_state]
    before: dict[str, Any] = {}
    for name in candidates:
        path = store.child(name)
        checked: list[verify.Verdict] = []  # rank 0's: its metadata is not read twice
        problem = coll.on_rank0(functools.partial(_check, store, name, checked))
        if problem is None:
            if not damaged:
                before = _optional_state(app_state, optional)
            try:
                loaded = restore(
                    path,
                    app_state,
                    optional_keys=optional_keys,
                    storage_options=storage_options,
                    collectives=coll,
                    plugin_manager=plugin_manager,
                    strict=strict,
                    io_concurrency=io_concurrency,
                    rest=rest,
                    weights_only=weights_only,
                    _checked=checked[0] if checked else None,
                )
                if damaged:
                    logger.info("restore_from_latest(%s) used %s; skipped: %s", dirpath, path, "; ".join(damaged))
                    _reset_unloaded(app_state, before, loaded, path)
                if loaded_keys is not None:
                    loaded_keys.extend(loaded)
                return path
            except SnapshotCorruptError as exc:
                if coll.world_size > 1 and not getattr(exc, "all_ranks", False):
                    raise  # raised on this rank only: the others cannot follow to another snapshot
                problem = str(exc)
        if not fallback:
            raise SnapshotCorruptError(
                f"the newest snapshot {path} is damaged: {problem}; pass fallback=True to restore "
                "the previous one instead"
            )
        damaged.append(f"{path} ({problem})")
        warnings.warn(
            f"skipping damaged snapshot {path}: {problem}; falling back to the previous snapshot",
            stacklevel=2,
        )
    if damaged:
        # Never start from scratch silently when snapshots exist but none can be read.
        raise SnapshotCorruptError(
            f"every snapshot in {dirpath} is damaged: {'; '.join(damaged)}. Nothing was restored; "
            "restore a snapshot by path, or move the directory aside to start from scratch"
        )
    logger.info("restore_from_latest(%s): no complete snapshot; nothing restored", dirpath)
    return None


def _uncommitted_after(store: Store, newest: Optional[str]) -> list[str]:
    """Snapshot-named directories later (by epoch and step) than complete snapshot ``newest``
    that hold the plugin's index but no metadata: a commit writes the index just before the
    metadata (and on local disk renames the whole directory into place), so such a directory
    is damage, or at most an interrupted commit on an object store."""
    after = SnapshotName.parse(newest).sort_key[:2] if newest is not None else None
    found = []
    for text in store.list_names():
        name = SnapshotName.parse(text)
        if name is None or name.phase_aware or (after is not None and name.sort_key[:2] <= after):
            continue
        if not store.is_complete(text) and store.has_file(text, INDEX_FNAME):
            found.append(text)
    return sorted(found)


def _check(store: Store, name: str, out: list[verify.Verdict]) -> Optional[str]:
    """``verify.check``'s problem with snapshot ``name``, or None; the verdict goes to ``out``."""
    out.append(verify.check(store, name))
    return out[-1].problem


def _optional_state(app_state: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    import copy

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
                    stacklevel=3,
                )
                continue
            except Exception:
                pass
        warnings.warn(
            f"{key} is not in {path}, the snapshot restored after falling back, and could not be "
            "put back as it was before the restore: it may hold values of the damaged snapshot; "
            "reset it yourself",
            stacklevel=3,
        )


def _agree_on_read_errors(path: str, errors: list[tuple[str, BaseException]], coll: Collectives) -> None:
    """Raise on every rank if any rank failed to read its entries of snapshot ``path`` (a
    damaged or truncated file): SnapshotCorruptError marked ``all_ranks``, so that
    restore_from_latest falls back on every rank together; UnrestorableStateError where
    torch's restricted unpickler refused an object."""
    refused = next((exc for _key, exc in errors if _refused_by_weights_only(exc)), None)
    # The plugin's own errors other than corruption (an object store that went away) are not
    # damage: raised as they are, never fallen back from.
    other = next(
        (exc for _key, exc in errors if isinstance(exc, SnapshotError) and not isinstance(exc, SnapshotCorruptError)),
        None,
    )
    mine: Optional[tuple[str, str]] = None
    if other is not None:
        mine = ("other", f"{type(other).__name__}: {other}")
    elif refused is not None:
        mine = ("refused", refusal(refused))
    elif errors:
        mine = ("corrupt", "; ".join(f"{key}: {type(exc).__name__}: {exc}" for key, exc in errors))
    reports = coll.all_gather(mine) if coll.world_size > 1 else [mine]
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    if other is not None:
        raise other
    if any(kind == "other" for _rank, (kind, _msg) in failed):
        raise DistributedError(
            f"restoring {path} failed on another rank: "
            + "; ".join(f"rank {rank}: {msg}" for rank, (_kind, msg) in failed)
        )
    cause = refused if refused is not None else (errors[0][1] if errors else None)
    where = "" if coll.world_size == 1 else " on " + ", ".join(f"rank {rank}" for rank, _ in failed)
    detail = "; ".join(
        (msg if coll.world_size == 1 else f"rank {rank}: {msg}") for rank, (_kind, msg) in failed
    )
    if any(kind == "refused" for _rank, (kind, _msg) in failed):
        raise UnrestorableStateError(
            f"snapshot {path} holds an object that torch.load(weights_only=True) refuses{where}: "
            f"{detail}. If the type is safe, allow it with torch.serialization.add_safe_globals([...]); "
            "if you trust this snapshot (you wrote it), pass weights_only=False to load it with full pickle"
        ) from cause
    error = SnapshotCorruptError(f"could not load snapshot {path}{where}: {detail}")
    error.all_ranks = True  # type: ignore[attr-defined]
    raise error from cause


def _agree_after_loading(path: str, error: Optional[BaseException], coll: Collectives) -> None:
    """After the loads: if loading failed on any rank (most often an entry's own
    ``load_state_dict``), a rank that loaded everything raises DistributedError naming it rather
    than training on alone, to wait in training's first collective for the process group's
    timeout. The rank that failed raises its own error afterwards. (A load that runs collectives
    itself, FSDP's, may still leave the other ranks waiting inside it: the process group's
    timeout ends that.)"""
    reports = coll.all_gather(None if error is None else str(error))
    failed = [f"rank {rank}: {msg}" for rank, msg in enumerate(reports) if msg is not None]
    if failed and error is None:
        raise DistributedError(
            f"restoring {path} failed on another rank ({'; '.join(failed)}); this rank loaded "
            "every entry but stops too, so that no rank trains on while another cannot"
        )


def _raise_own_error(path: str, error: Any) -> None:
    """Raise what an entry's own ``state_dict()``/``load_state_dict()`` raised (outside the
    handler that caught it, so it carries no added context): as it is for the user's classes; as
    a StateMismatchError for torch's modules, optimizers and schedulers, whose loaders raise only
    when the saved state does not fit them."""
    method = getattr(type(error.target), error.method, None)
    if getattr(method, "__module__", "").startswith("torch."):
        raise StateMismatchError(
            f"cannot restore {path}: it does not fit {error.key} "
            f"({type(error.target).__name__}.{error.method}: {type(error.original).__name__}: "
            f"{error.original}); restore into the same kind of unit that was saved"
        ) from error.original
    raise error.original


class StatefulError(Exception):
    """A stateful's own ``state_dict()`` or ``load_state_dict()`` raised during a restore.

    ``key``: its app-state key; ``method``: which of the two; ``original``: what it raised.
    Told apart from failures to read the snapshot, which are the snapshot's fault.
    """

    def __init__(self, key: str, method: str, target: Any, exc: BaseException) -> None:
        super().__init__(f"{key}.{method}() raised {type(exc).__name__}: {exc}")
        self.key = key
        self.method = method
        while hasattr(target, "__wrapped__"):  # the plugin's wrappers: the object they wrap
            target = target.__wrapped__
        self.target = target
        self.original = exc


def _is_users(stateful: Any) -> bool:
    """Whether ``stateful`` runs the user's code (or is the plugin's wrapper around it), as
    opposed to one of the plugin's own statefuls (the RNG state, a plain value)."""
    return not type(stateful).__module__.startswith("tnt_snapshot_plugin.") or hasattr(stateful, "__wrapped__")


def _nn_module() -> Any:
    import torch

    return torch.nn.Module


def reading_io(store: Store, name: str, path: str, concurrency: Optional[int] = None) -> tuple[Any, Any, Any]:
    """How the reader reaches snapshot ``name``'s files: ``(read_into, file_size, verifier)``;
    ``read_into`` reads up to ``concurrency`` files at once (None: the store's default).

    File sizes come from the plugin's index where it has one (one read), else from the store
    (snapshots torchtnt or torchsnapshot wrote); the verifier holds the index's checksums (None
    for a snapshot without them)."""
    from . import index as index_file
    from .checksums import Verifier

    try:
        index: Optional[bytes] = store.read_file(name, INDEX_FNAME)
    except FileNotFoundError:
        index = None
    parsed: Any = None
    if index is not None:
        parsed = index_file.parse(index, path)
    listed = parsed.get("files") if isinstance(parsed, dict) else None
    sizes: dict[str, Any] = listed if isinstance(listed, dict) else {}
    records = parsed.get("checksums") if isinstance(parsed, dict) else None
    verifier = Verifier(path, records, sizes) if isinstance(records, dict) and records else None

    def file_size(rel: str) -> Optional[int]:
        size = sizes.get(rel)
        return size if isinstance(size, int) else store.file_size(name, rel)

    return functools.partial(store.read_into, name, concurrency=concurrency), file_size, verifier


def read_metadata(store: Store, name: str, verifier: Any) -> bytes:
    """Snapshot ``name``'s metadata, checked against its checksum where the index has one
    (``verifier``, from :func:`reading_io`): it holds the primitive values (numbers, strings)
    themselves. SnapshotCorruptError on a mismatch."""
    data = store.read_file(name, METADATA_FNAME)
    if verifier is not None:
        verifier.check(METADATA_FNAME, 0, data)
    return data


def _refused_by_weights_only(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is torch's restricted unpickler refusing what a snapshot
    holds (a global not allowed, a construct it cannot build), as opposed to bytes that are no
    pickle at all (damage: torch says "Unsupported operand" for those, or fails to unpack)."""
    import pickle

    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if (
            isinstance(exc, pickle.UnpicklingError)
            and "weights_only" in text.lower().replace(" ", "_")
            and "Unsupported operand" not in text
        ):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


def _not_a_directory(store: Store) -> Optional[str]:
    """What is wrong with a local ``dirpath`` that exists but is no directory, else None."""
    if isinstance(store, LocalStore) and os.path.lexists(store.root) and not os.path.isdir(store.root):
        return "is a file, not a directory of snapshots"
    return None


def _require_complete(store: Store, name: str, path: str, coll: Collectives) -> None:
    def check() -> Optional[str]:
        if store.is_complete(name):
            return None
        if name in store.list_names():
            inner = store.nested(name).complete_snapshots()
            if inner:
                return (
                    f"{path} is a directory of snapshots, not a snapshot; pass one of them (the "
                    f"newest is {store.child(name)}/{inner[-1].text}) or use restore_from_latest"
                )
            if SnapshotName.parse(name) is None:
                return (
                    f"{path} is not a snapshot: it holds no .snapshot_metadata and is not named "
                    "epoch_E_step_S; pass a snapshot directory written by the saver"
                )
            return (
                f"{path} is not a complete snapshot (it has no .snapshot_metadata: an interrupted "
                "write?); pass a committed snapshot directory"
            )
        if isinstance(store, LocalStore) and os.path.islink(os.path.join(store.root, name)):
            return (
                f"{path} is a symlink; snapshots are never read through symlinks: pass the "
                f"snapshot directory itself ({os.path.realpath(os.path.join(store.root, name))})"
            )
        if isinstance(store, LocalStore) and os.path.lexists(os.path.join(store.root, name)):
            return f"{path} is a file, not a snapshot directory; pass a directory written by the saver"
        return f"snapshot {path} does not exist; pass a directory written by the saver"

    problem = coll.on_rank0(check)
    if problem is not None:
        raise SnapshotNotFoundError(problem)


#: How many entries a world-size error names before it counts the rest.
_NAMED_ENTRIES = 12


def _fit_world_size(
    path: str, meta: Any, read_into: Any, file_size: Any, verifier: Any, keys: Iterable[str], coll: Collectives
) -> bool:
    """Make the entries of ``keys`` that map exactly onto this world size available to every rank,
    or raise StateMismatchError naming those that cannot; whether the RNG state maps.

    A snapshot taken on N ranks restores exactly on M != N ranks where every entry is replicated
    (saved once for all ranks), sharded (ShardedTensor, DTensor: resharded as they are read), or
    saved per rank with the same value on every rank (progress counters, a full state dict saved
    on every rank: read and compared here, on rank 0). A per-rank entry whose values differ (an
    optimizer's flat FSDP1 shards, a loader's position) has no value for a rank of another world
    size. The RNG state, per rank by nature, is then not restored, with a warning, rather than
    refusing every world-size change. Every rank reaches the same verdict (rank 0 decides).
    """
    from .format import reader as fmt

    saved = meta.world_size
    wanted = {encode(key) for key in keys}

    def per_rank_entries() -> dict[str, list[Any]]:
        """logical path -> each saved rank's entry (None where a rank has none)."""
        out: dict[str, list[Any]] = {}
        replicated: set[str] = set()
        for full, entry in meta.manifest.items():
            rank, _, logical = full.partition("/")
            kind = entry.get("type")
            if logical.split("/", 1)[0] not in wanted or kind in _CONTAINERS:
                continue
            if kind in ("ShardedTensor", "DTensor") or entry.get("replicated"):
                replicated.add(logical)
                continue
            out.setdefault(logical, [None] * saved)[int(rank)] = entry
        for logical in replicated:
            out.pop(logical, None)
        return out

    def read(rank: int, logical: str) -> Any:
        # Verified as every read is: a damaged copy is damage (restore_from_latest falls back
        # to an older snapshot), not a value that differs (which refuses the world-size change).
        return fmt.read_value(meta.manifest, f"{rank}/{logical}", read_into, file_size=file_size, verifier=verifier)

    def verdict() -> tuple[list[str], list[str], Optional[str]]:
        """(logical paths equal on every saved rank, those that are not, a read error)."""
        entries = per_rank_entries()
        same: list[str] = []
        differ: list[str] = []
        to_read: list[str] = []
        for logical, by_rank in entries.items():
            if any(e is None for e in by_rank):
                differ.append(logical)
            elif all(e.get("type") in _PRIMITIVES for e in by_rank):
                values = {(e["type"], e.get("serialized_value")) for e in by_rank}
                (same if len(values) == 1 else differ).append(logical)
            else:
                to_read.append(logical)
        try:
            for logical in to_read:
                first = read(0, logical)
                equal = all(_same_value(first, read(r, logical)) for r in range(1, saved))
                (same if equal else differ).append(logical)
        except Exception as exc:  # damaged bytes: every rank raises it as corruption below
            return [], [], f"{type(exc).__name__}: {exc}"
        return sorted(same), sorted(differ), None

    same, differ, unreadable = coll.on_rank0(verdict)
    if unreadable is not None:
        raise SnapshotCorruptError(
            f"could not read snapshot {path}'s per-rank entries to restore it on "
            f"{_ranks(coll.world_size)} (taken on {_ranks(saved)}): {unreadable}"
        )
    rng_prefix = encode(RNG_STATE_KEY) + "/"
    rng_differs = [p for p in differ if p.startswith(rng_prefix)]
    differ = [p for p in differ if not p.startswith(rng_prefix)]
    if differ:
        named = ", ".join(unquote(p) for p in differ[:_NAMED_ENTRIES])
        more = f" and {len(differ) - _NAMED_ENTRIES} more" if len(differ) > _NAMED_ENTRIES else ""
        raise StateMismatchError(
            f"cannot restore {path} on {_ranks(coll.world_size)}: it was taken on {_ranks(saved)}, "
            "and these entries were saved per rank with different values (or not by every rank), "
            f"so they have no value for a world of {_ranks(coll.world_size)}: {named}{more}. "
            f"Restore on {_ranks(saved)}; or save such state replicated (replicated=[...]) or "
            "sharded (FSDP's SHARDED_STATE_DICT, DTensor); or leave those entries out of the restore"
        )
    # Entries equal on every saved rank are rank 0's for every rank of the new world: marked
    # replicated in this in-memory copy of the metadata (nothing is written).
    for logical in same:
        entry = meta.manifest.get(f"0/{logical}")
        if entry is not None and "replicated" in entry:
            entry["replicated"] = True
    if rng_differs:
        warnings.warn(
            f"snapshot {path} was taken on {_ranks(saved)} and is restored on {_ranks(coll.world_size)}: "
            "its RNG states are per rank, so they are not restored (every other entry is)",
            stacklevel=4,
        )
        return False
    return True


_CONTAINERS = frozenset({"dict", "OrderedDict", "list"})
_PRIMITIVES = frozenset({"int", "str", "bool", "bytes", "float"})


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _same_value(a: Any, b: Any) -> bool:
    """Whether two values read from a snapshot are the same, bit for bit for tensors."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(a_bytes, b_bytes)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is not a truth value: not provably the same
        return False


def _global_shape(entry: Any) -> Optional[tuple[int, ...]]:
    """The whole tensor's shape of a manifest entry: a dense entry's own, or the extent of a
    ShardedTensor's or DTensor's shards (every rank's, merged into the entry); None if no tensor."""
    shape = entry.get("shape")
    if shape is not None:
        return tuple(shape)
    shards = entry.get("shards")
    if not shards:
        return None
    return tuple(
        max(shard["offsets"][d] + shard["sizes"][d] for shard in shards)
        for d in range(len(shards[0]["sizes"]))
    )


def _check_modules(path: str, load: Mapping[str, Any], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Raise StateMismatchError unless every module of ``load`` has the snapshot's tensors, of
    the snapshot's shapes; the modules' state dicts (read into next, not asked for twice)."""
    import torch

    problems: list[str] = []
    currents: dict[str, Any] = {}
    for key, obj in load.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        current = currents[key] = obj.state_dict()
        expected = {name: t for name, t in current.items() if isinstance(t, torch.Tensor)}
        prefix = key + "/"
        cut = len(prefix)
        saved: dict[str, tuple[int, ...]] = {}
        for entry_path, entry in manifest.items():
            if entry_path.startswith(prefix) and (shape := _global_shape(entry)) is not None:
                saved[entry_path[cut:]] = shape
        if expected.keys() != saved.keys():  # (sorted only to say what differs)
            missing = sorted(set(expected) - set(saved))
            unexpected = sorted(set(saved) - set(expected))
            if missing:
                problems.append(f"{key}: the module has {missing} that the snapshot lacks")
            if unexpected:
                problems.append(f"{key}: the snapshot has {unexpected} that the module lacks")
        # torch.Size is a tuple: compared with the saved shape as is, one tensor at a time
        for name in sorted(n for n, t in expected.items() if n in saved and t.shape != saved[n]):
            problems.append(
                f"{key}.{name}: shape {list(expected[name].shape)} in the module, "
                f"{list(saved[name])} in the snapshot"
            )
    if problems:
        raise StateMismatchError(
            f"cannot restore {path}: the modules do not match the snapshot: " + "; ".join(problems)
        )
    return currents
