"""Restoring snapshots: one chosen path, or the latest complete one in a directory.

Snapshots are trusted input, as a pickle is: torchsnapshot stores non-tensor objects with
``torch.save`` and reads them back with ``torch.load``. Restore only snapshots you (or your own
jobs) wrote.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import unquote

import pluggy

from .app_state import RESERVED_KEYS, RNG_STATE_KEY, RNGState, Value, check_collisions
from .distributed import Collectives, raise_if_any_failed
from .errors import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
)
from .naming import SnapshotName
from .plugins import get_plugin_manager
from .storage import LocalStore, Store, open_store, split_snapshot_path

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
            problem = store.verify(found.text) if verified else None
            if problem is None:
                return store.child(found.text)
            warnings.warn(
                f"skipping damaged snapshot {store.child(found.text)}: {problem}", stacklevel=4
            )
        return None

    return coll.on_rank0(newest)


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
) -> list[str]:
    """Load snapshot ``path`` into ``app_state`` (key -> Stateful); the RNG state last.

    ``optional_keys`` may be absent from the snapshot (a warning names them); any other key the
    snapshot lacks raises :class:`StateMismatchError` when ``strict``. Modules are checked
    against the snapshot (keys, shapes, dtypes) before anything is loaded. If ``rest`` is a dict,
    every other entry of the snapshot (none of ``app_state``'s keys, no plugin's, not the RNG
    state) is read into it as a plain state dict: an adapter reads a framework's own checkpoint
    this way without objects to load it into.
    Returns the keys that were loaded.
    """
    coll = collectives or Collectives(None)
    pm = plugin_manager if plugin_manager is not None else get_plugin_manager()
    dirpath, name = split_snapshot_path(path)
    store = open_store(dirpath, storage_options)
    _require_complete(store, name, path, coll)

    # Every check before loading runs on every rank, and the ranks agree on the outcome before
    # anyone enters torchsnapshot's restore collectives: a rank-local problem (a module that does
    # not match, unreadable metadata) is then raised on every rank instead of leaving the others
    # waiting in a collective for the timeout.
    error: Optional[SnapshotError] = None
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

        from torchsnapshot.manifest_ops import get_manifest_for_rank

        from .compat import Snapshot, gc_paused, manifest_for_rank

        snapshot = Snapshot(store.torchsnapshot_url(name), pg=coll.group, storage_options=storage_options)
        try:
            manifest = manifest_for_rank(snapshot.metadata, coll.rank)
            if manifest is None:
                manifest, _ = get_manifest_for_rank(metadata=snapshot.metadata, rank=coll.rank)
        except Exception as exc:
            _close_leaked_event_loops(exc)
            raise SnapshotCorruptError(f"snapshot {path} has unreadable metadata: {exc}") from exc
        if not manifest:
            raise SnapshotCorruptError(f"snapshot {path} has an empty manifest: it holds no entries")
        present = {unquote(key.split("/", 1)[0]) for key in manifest}

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
            _check_modules(path, load, manifest)
        sinks: dict[str, Value] = {}
        if rest is not None:
            sinks = {key: Value() for key in sorted(present - set(wanted) - {RNG_STATE_KEY})}
            load.update(sinks)

    except SnapshotError as exc:
        error = exc
    raise_if_any_failed(coll, error, f"restoring {path}")

    try:
        if RNG_STATE_KEY in present:
            load[RNG_STATE_KEY] = RNGState()  # restored last (compat.Snapshot._pop_rng_state)
        with gc_paused():
            snapshot.restore(load, strict=strict)
    except SnapshotError:
        raise
    except Exception as exc:
        _close_leaked_event_loops(exc)
        raise SnapshotCorruptError(
            f"could not load snapshot {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if rest is not None:
        rest.update((key, sink.value) for key, sink in sinks.items())
    keys = sorted(k for k in load if k != RNG_STATE_KEY) + ([RNG_STATE_KEY] if RNG_STATE_KEY in present else [])
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
) -> Optional[str]:
    """Restore the newest complete snapshot of ``dirpath``; the restored path, or None if none.

    A snapshot whose files are missing or truncated, or that fails to load, is skipped with a
    warning naming it, and the previous one is tried (``fallback=False`` raises instead); when
    snapshots exist but none can be restored, SnapshotCorruptError is raised rather than letting
    training start from scratch. Under torch.distributed rank 0 chooses (in rank 0's ``dirpath``);
    with more than one rank, a load error on any rank is raised, not fallen back from.
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
    damaged: list[str] = []
    for name in candidates:
        path = store.child(name)
        problem = coll.on_rank0(functools.partial(store.verify, name))
        if problem is None:
            try:
                restore(
                    path,
                    app_state,
                    optional_keys=optional_keys,
                    storage_options=storage_options,
                    collectives=coll,
                    plugin_manager=plugin_manager,
                    strict=strict,
                )
                return path
            except SnapshotCorruptError as exc:
                if coll.world_size > 1:
                    raise
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
    return None


def _close_leaked_event_loops(exc: BaseException) -> None:
    """Close the event loop a failed torchsnapshot restore leaves open (it closes it on success
    only), so a damaged snapshot costs a warning that names it, not a ResourceWarning later."""
    import asyncio

    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, asyncio.AbstractEventLoop) and not (
                value.is_running() or value.is_closed()
            ):
                value.close()
        tb = tb.tb_next


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


def _check_modules(path: str, load: Mapping[str, Any], manifest: Mapping[str, Any]) -> None:
    import torch

    problems: list[str] = []
    for key, obj in load.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        expected = {
            name: t for name, t in obj.state_dict().items() if isinstance(t, torch.Tensor)
        }
        saved = {
            entry_path[len(key) + 1:]: entry
            for entry_path, entry in manifest.items()
            if entry_path.startswith(key + "/") and hasattr(entry, "shape")
        }
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing:
            problems.append(f"{key}: the module has {missing} that the snapshot lacks")
        if unexpected:
            problems.append(f"{key}: the snapshot has {unexpected} that the module lacks")
        for name in sorted(set(expected) & set(saved)):
            shape = list(saved[name].shape)
            if list(expected[name].shape) != shape:
                problems.append(
                    f"{key}.{name}: shape {list(expected[name].shape)} in the module, "
                    f"{shape} in the snapshot"
                )
    if problems:
        raise StateMismatchError(
            f"cannot restore {path}: the modules do not match the snapshot: " + "; ".join(problems)
        )
