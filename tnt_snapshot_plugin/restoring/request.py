"""One restore, in phases: resolve the snapshot, check it against the state, read every entry,
agree across ranks, load. :class:`RestoreRequest` holds what a restore is asked to do; the
adapters' static restores build one and call :meth:`RestoreRequest.restore` or
:meth:`RestoreRequest.restore_from_latest`.

Every check before loading runs on every rank, and the ranks agree on the outcome before anyone
reads or loads (a module's ``load_state_dict`` may run collectives, FSDP's do): a rank-local
problem is raised on every rank instead of leaving the others waiting in a collective. Every entry
is read before anything is loaded, and the ranks agree on the reads too: a damaged file on any
rank makes every rank fall back together.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional

import pluggy

from tnt_snapshot_plugin.app_state import RESERVED_KEYS, RNG_STATE_KEY, RNGState, Value, check_collisions
from tnt_snapshot_plugin.distributed import Collectives, raise_if_any_failed
from tnt_snapshot_plugin.errors import (
    PartialRestoreWarning,
    SnapshotCorruptError,
    SnapshotError,
    StateMismatchError,
)
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.format.objects import allowed_globals
from tnt_snapshot_plugin.format.torchsnapshot.manifest import Metadata, rank_view, saved_keys
from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import Groups, PartialView, RankRegions
from tnt_snapshot_plugin.hooks import extra_state_sources, new_plugin_manager
from tnt_snapshot_plugin.restoring.agreement import (
    StatefulError,
    agree_after_loading,
    agree_on_read_errors,
    is_users,
    raise_own_error,
)
from tnt_snapshot_plugin.restoring.checks import check_modules
from tnt_snapshot_plugin.restoring.files import metadata_range, read_metadata, reading_io, require_complete
from tnt_snapshot_plugin.restoring.world_size import fit_world_size, mark_same
from tnt_snapshot_plugin.stores import Store, open_store, split_snapshot_path

logger = logging.getLogger("tnt_snapshot_plugin.restoring")


@dataclass(frozen=True)
class RestoreRequest:
    """What to restore into, and how.

    ``app_state``: key -> Stateful. ``optional_keys`` may be absent from the snapshot (a warning
    names them); any other key the snapshot lacks raises StateMismatchError when ``strict``.
    ``rest``: a dict that gets every other entry of the snapshot as a plain state dict (an
    adapter reads a framework's own checkpoint this way). ``io_concurrency``: files (object-store
    ranges) a rank reads at once (None: the store's default). ``weights_only=False`` unpickles
    object entries with full pickle (trusted snapshots only). ``plugin_manager``: the saver's
    (its ``tnt_snapshot_plugin_extra_state`` and ``after_restore`` hooks are called); None: a new
    manager with the entry-point plugins only.
    """

    app_state: Mapping[str, Any]
    optional_keys: Iterable[str] = ()
    storage_options: Optional[dict[str, Any]] = None
    collectives: Optional[Collectives] = None
    plugin_manager: Optional[pluggy.PluginManager] = None
    strict: bool = True
    rest: Optional[dict[str, Any]] = None
    io_concurrency: Optional[int] = None
    weights_only: bool = True

    def replace(self, **changes: Any) -> RestoreRequest:
        return dataclasses.replace(self, **changes)

    @contextmanager
    def on_ranks(self, process_group: Optional[Any], collective_timeout_s: Any) -> Iterator[RestoreRequest]:
        """This request with collectives made for one restore over ``process_group``'s ranks
        (default: all; none outside torch.distributed), each waiting at most
        ``collective_timeout_s`` for a failed rank, and closed afterwards. ConfigError if the
        timeout is not a positive number of seconds. The adapters' static restores run in it."""
        from tnt_snapshot_plugin.config import collective_timeout

        with Collectives.create(process_group, collective_timeout(collective_timeout_s), for_restore=True) as collectives:
            yield self.replace(collectives=collectives)

    def restore(self, path: str, checked: Optional[verify.Verdict] = None) -> list[str]:
        """Load snapshot ``path``; the keys loaded (the RNG state last). ``checked``: rank 0's
        verdict on it (``verify.check``), whose parsed metadata is used instead of reading it
        again; without one, rank 0 makes that check first, and a snapshot it finds damaged is
        refused on every rank (SnapshotCorruptError) before anything is read into the state."""
        return _Restore(self, path, checked).run()

    def restore_from_latest(self, dirpath: str, **kwargs: Any) -> Optional[str]:
        """:func:`restoring.restore_from_latest` with this request."""
        from tnt_snapshot_plugin.restoring.latest import restore_from_latest

        return restore_from_latest(dirpath, request=self, **kwargs)


@dataclass
class _Checked:
    """What the check phase found: what to load, from which view of the manifest."""

    meta: Metadata
    view: dict[str, dict]
    present: set[str]
    load: dict[str, Any]
    currents: dict[str, Any] = field(default_factory=dict)  # state dicts already asked for
    sinks: dict[str, Value] = field(default_factory=dict)
    restore_rng: bool = True
    view_rank: int = 0


class _Restore:
    """The phases of one restore of ``path``."""

    def __init__(self, request: RestoreRequest, path: str, checked: Optional[verify.Verdict]) -> None:
        self.request = request
        self.coll = request.collectives or Collectives(None)
        self.pm = request.plugin_manager if request.plugin_manager is not None else new_plugin_manager()
        self.path = path
        self.verdict = checked
        self.started = time.perf_counter()
        self.groups: Optional[Groups] = None  # the groups of the metadata read, where read by rank
        self.same: list[str] = []  # per-rank entries equal on every saved rank (another world size)

    def run(self) -> list[str]:
        store, name = self.resolve()
        checked: Optional[_Checked] = None
        error: Optional[SnapshotError] = None
        try:
            checked = self.check(store, name)
        except SnapshotError as exc:
            error = exc
        # Damage any rank found (and nothing else) is raised on every rank as such: all fall back.
        raise_if_any_failed(self.coll, error, f"restoring {self.path}", together=SnapshotCorruptError)
        assert checked is not None
        order = self.order(checked)
        states, own_error = self.read(checked, order)
        keys = self.load(checked, order, states, own_error)
        logger.info("restored snapshot %s in %.3fs (%s)", self.path, time.perf_counter() - self.started, ", ".join(keys))
        self.pm.hook.tnt_snapshot_plugin_after_restore(path=self.path, keys=keys)
        return keys

    # -- resolve ------------------------------------------------------------------------------

    def resolve(self) -> tuple[Store, str]:
        """The snapshot (rank 0's path), complete, and intact as ``verify.check`` finds it."""
        self.path, checked = self.coll.broadcast((self.path, self.verdict is not None))
        dirpath, name = split_snapshot_path(self.path)
        store = open_store(dirpath, self.request.storage_options)
        require_complete(store, name, self.path, self.coll)
        if not checked:
            self.verdict = self.checked(store, name)
        # rank 0 under restore_from_latest: the index verify.check read and checked, not read again
        self.io = reading_io(store, name, self.path, self.request.io_concurrency, checked=self.verdict)
        self.store, self.name = store, name
        return store, name

    def checked(self, store: Store, name: str) -> Optional[verify.Verdict]:
        """Rank 0's ``verify.check`` of the snapshot, the check restore_from_latest makes before
        it restores one (the verdict on rank 0, None on the others); a damaged snapshot raises
        SnapshotCorruptError on every rank. Restored on several ranks from its groups of records,
        rank 0 leaves the metadata's whole-file checksum out: each rank checks the digest of the
        groups it reads (``format.rank_regions.Groups``)."""
        found: list[verify.Verdict] = []

        def check() -> Optional[str]:
            found.append(verify.check(store, name, restoring_ranks=self.coll.world_size, metadata_checksum=False))
            return found[-1].problem

        problem = self.coll.on_rank0(check)
        if problem is not None:
            error = verify.damaged(self.path, problem)
            error.all_ranks = True  # type: ignore[attr-defined]
            raise error
        return found[0] if found else None

    # -- check --------------------------------------------------------------------------------

    def wanted(self) -> dict[str, Any]:
        """The app state and every plugin's extra state, their keys checked for collisions."""
        app_state = self.request.app_state
        sources = extra_state_sources(self.pm, "restore", -1, -1)
        # Adapters check the unit's own keys before adding reserved entries (the train dataloader).
        check_collisions([k for k in app_state if k not in RESERVED_KEYS], sources)
        wanted = dict(app_state)
        for _source, entries in sources:
            wanted.update(entries)
        return wanted

    def metadata(self, store: Store, name: str) -> tuple[Metadata, Optional[dict[str, dict]]]:
        """The snapshot's metadata, and this rank's view where it was read by rank.

        A rank of several reads rank 0's records and its own (those of saved rank 0 on a rank
        the snapshot did not have), not every rank's (``format.rank_regions.Groups``: ranged
        reads of the groups the index locates, each checked against its digest); the groups of
        other ranks whose shards a target needs are read when the key is (:meth:`read`). Rank 0
        of a restore on another world size compares every saved rank's entries
        (``world_size.fit_world_size``), and one rank, or a snapshot without ranked groups,
        reads the whole metadata, checked against its checksum."""
        if self.verdict is not None and self.verdict.metadata is not None:
            return self.verdict.metadata, None  # read and checked by restore_from_latest, on this rank
        regions = RankRegions.from_index(self.io.snapshot_index) if self.coll.world_size > 1 else None
        if regions is not None and (len(regions.regions) == self.coll.world_size or self.coll.rank != 0):
            saved = len(regions.regions)
            view_rank = self.coll.rank if self.coll.rank < saved else 0
            self.groups = Groups(functools.partial(metadata_range, store, name), regions, self.path)
            self.groups.load(0)
            self.groups.load(view_rank)
            return self.groups.meta, self.groups.view(view_rank)
        return self.whole_metadata(), None

    def whole_metadata(self) -> Metadata:
        from tnt_snapshot_plugin.format.torchsnapshot.manifest import parse_metadata

        regions = RankRegions.from_index(self.io.snapshot_index)
        shapes = regions.shapes if regions is not None else None
        try:
            return parse_metadata(read_metadata(self.store, self.name, self.io.verifier), self.path, shapes)
        except SnapshotError:
            raise  # damaged metadata, or the storage is unreachable
        except Exception as exc:
            raise SnapshotCorruptError(f"snapshot {self.path} has unreadable metadata: {exc}") from exc

    def check(self, store: Store, name: str) -> _Checked:
        """What to load, checked against the snapshot; StateMismatchError where it does not fit."""
        request, coll, path = self.request, self.coll, self.path
        wanted = self.wanted()
        meta, view = self.metadata(store, name)
        # A rank the snapshot did not have checks against rank 0's entries; the world-size check
        # decides what it may load.
        view_rank = coll.rank if coll.rank < meta.world_size else 0
        if view is None:
            view = rank_view(meta, view_rank)
        if not view:
            raise SnapshotCorruptError(f"snapshot {path} has an empty manifest: it holds no entries")
        present = saved_keys(view)
        restore_rng = True
        if meta.world_size != coll.world_size:
            mapped = present if request.rest is not None else (set(wanted) | {RNG_STATE_KEY}) & present
            io = self.io
            restore_rng, self.same = fit_world_size(path, meta, io.read_into, io.file_size, io.verifier, mapped, coll)
        load = self.select(wanted, present)
        checked = _Checked(meta, view, present, load, restore_rng=restore_rng, view_rank=view_rank)
        if request.strict:
            checked.currents = check_modules(path, load, view)
        if request.rest is not None:
            checked.sinks = {key: Value() for key in sorted(present - set(wanted) - {RNG_STATE_KEY})}
            load.update(checked.sinks)
        return checked

    def select(self, wanted: dict[str, Any], present: set[str]) -> dict[str, Any]:
        """The entries of ``wanted`` the snapshot holds; the others warned about or refused."""
        path, optional = self.path, set(self.request.optional_keys)
        load: dict[str, Any] = {}
        missing = []
        for key, obj in wanted.items():
            if key in present:
                load[key] = obj
            elif key in optional:
                warnings.warn(
                    f"{key} was passed to restore but snapshot {path} holds no {key} state "
                    "(snapshots taken at epoch ends hold none); it was not restored",
                    category=PartialRestoreWarning, stacklevel=5,
                )
            else:
                missing.append(key)
        if missing and self.request.strict:
            raise StateMismatchError(
                f"snapshot {path} holds no entries {sorted(missing)} (it holds {sorted(present)}); "
                "restore into the same kind of unit that was saved, or pass strict=False to skip them"
            )
        for key in missing:
            warnings.warn(f"{key} is not in snapshot {path}; left as it is (strict=False)", category=PartialRestoreWarning, stacklevel=5)
        return load

    def order(self, checked: _Checked) -> list[str]:
        """The keys in the order they are read and loaded: the RNG state last (loading the other
        entries may draw random numbers)."""
        order = [key for key in checked.load if key != RNG_STATE_KEY]
        if RNG_STATE_KEY in checked.present and checked.restore_rng:
            order.append(RNG_STATE_KEY)
            checked.load[RNG_STATE_KEY] = RNGState()
        return order

    # -- read and agree -----------------------------------------------------------------------

    def read(self, checked: _Checked, order: list[str]) -> tuple[dict[str, Any], Optional[StatefulError]]:
        """Every entry's state dict, read; the ranks agree on the reads before anything loads."""
        view = checked.view
        if checked.view_rank != self.coll.rank:  # a rank the snapshot did not have
            view = self.groups.view(self.coll.rank) if self.groups is not None else rank_view(checked.meta, self.coll.rank)
        states: dict[str, Any] = {}
        read_errors: list[tuple[str, BaseException]] = []
        own_error: Optional[StatefulError] = None
        with allowed_globals():
            for key in order:
                target = checked.load[key]
                try:
                    current = checked.currents.pop(key) if key in checked.currents else target.state_dict()
                except Exception as exc:
                    if not is_users(target):
                        raise
                    own_error = own_error or StatefulError(key, "state_dict", target, exc)
                    continue
                try:
                    view, states[key] = self.read_widening(view, key, current)
                except Exception as exc:  # agreed on below, on every rank
                    read_errors.append((key, exc))
        agree_on_read_errors(self.path, read_errors, self.coll)
        return states, own_error

    def read_widening(self, view: dict[str, dict], key: str, current: Any) -> tuple[dict[str, dict], Any]:
        """The view the key was read with, and its state dict. A view read by rank that lacks
        shards a target needs (found as the read is planned, before anything is read) gets the
        groups of the ranks whose shards overlap those targets, then, if still short, the whole
        metadata."""
        try:
            return view, self.read_key(view, key, current)
        except PartialView as partial:
            assert self.groups is not None
            self.groups.load_overlapping(partial.boxes)
            view = self.groups.view(self.coll.rank)
        try:
            return view, self.read_key(view, key, current)
        except PartialView as partial:
            logger.info("restoring %s: %s needs shards of more ranks; reading the whole metadata", self.path, partial)
            whole = self.whole_metadata()
            mark_same(whole, self.same)
            view = rank_view(whole, self.coll.rank)
        return view, self.read_key(view, key, current)

    def read_key(self, view: dict[str, dict], key: str, current: Any) -> Any:
        from tnt_snapshot_plugin.format.torchsnapshot import reader as fmt

        io = self.io
        return fmt.read_state_dict(
            view, key, current, io.read_into,
            verifier=io.verifier, file_size=io.file_size, weights_only=bool(self.request.weights_only),
        )

    # -- load ---------------------------------------------------------------------------------

    def load(
        self, checked: _Checked, order: list[str], states: dict[str, Any], own_error: Optional[StatefulError]
    ) -> list[str]:
        """Load every state read into its stateful; the keys loaded."""
        failure: Optional[BaseException] = None  # a load of the plugin's own (the RNG state, values)
        if own_error is None:
            failure, own_error = self.load_all(checked, order, states)
        if self.coll.world_size > 1:
            agree_after_loading(self.path, own_error or failure, self.coll)
        if failure is not None:
            raise failure
        if own_error is not None:
            raise_own_error(self.path, own_error)
        if self.request.rest is not None:
            self.request.rest.update((key, sink.value) for key, sink in checked.sinks.items())
        rng = [RNG_STATE_KEY] if RNG_STATE_KEY in checked.present and checked.restore_rng else []
        return sorted(k for k in checked.load if k != RNG_STATE_KEY) + rng

    def load_all(
        self, checked: _Checked, order: list[str], states: dict[str, Any]
    ) -> tuple[Optional[BaseException], Optional[StatefulError]]:
        import torch

        for key in order:
            target = checked.load[key]
            try:
                if isinstance(target, torch.nn.Module):
                    target.load_state_dict(states[key], strict=self.request.strict)
                else:
                    target.load_state_dict(states[key])
            except SnapshotError as exc:
                return exc, None
            except Exception as exc:
                if is_users(target):
                    return None, StatefulError(key, "load_state_dict", target, exc)
                failure = SnapshotCorruptError(f"could not load snapshot {self.path}: {key}: {type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                return failure, None
        return None, None


__all__ = ["RestoreRequest"]
