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
    ConfigError,
    PartialRestoreWarning,
    SnapshotCorruptError,
    SnapshotError,
    StateMismatchError,
)
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.format.base import FormatReader
from tnt_snapshot_plugin.format.files import SnapshotFiles
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.objects import allowed_globals
from tnt_snapshot_plugin.format.registry import format_of, get_format, metadata_files
from tnt_snapshot_plugin.hooks import extra_state_sources, new_plugin_manager
from tnt_snapshot_plugin.restoring.agreement import (
    StatefulError,
    agree_after_loading,
    agree_on_read_errors,
    is_users,
    raise_own_error,
)
from tnt_snapshot_plugin.restoring.files import require_complete
from tnt_snapshot_plugin.stores import Store, open_store, split_snapshot_path

logger = logging.getLogger("tnt_snapshot_plugin.restoring")


@dataclass(frozen=True)
class RestoreRequest:
    """What to restore into, and how.

    ``app_state``: key -> Stateful. ``optional_keys`` may be absent from the snapshot (a warning
    names them); any other key the snapshot lacks raises StateMismatchError when ``strict``.
    ``rest``: a dict that gets every other entry of the snapshot as a plain state dict (an
    adapter reads a framework's own checkpoint this way), except the ``unread_keys``, which are
    not read at all. ``io_concurrency``: files (object-store
    ranges) a rank reads at once (None: the store's default). ``weights_only=False`` unpickles
    object entries with full pickle (trusted snapshots only). ``plugin_manager``: the saver's
    (its ``tnt_snapshot_plugin_extra_state`` and ``after_restore`` hooks are called); None: the
    entry-point plugins, loaded only when the snapshot holds entries that neither ``app_state``
    nor ``optional_keys`` name (entries a plugin's extra state may claim; on several ranks, when
    any rank's snapshot view holds one): a restore of the app state's own entries reads no
    entry points and calls no hooks. ``planner``: a DCP ``LoadPlanner`` that plans the
    tensor reads of a snapshot in DCP's format (``DcpReader.plan_with``); ConfigError for a
    snapshot in a format that has no planner.
    """

    app_state: Mapping[str, Any]
    optional_keys: Iterable[str] = ()
    storage_options: Optional[dict[str, Any]] = None
    collectives: Optional[Collectives] = None
    plugin_manager: Optional[pluggy.PluginManager] = None
    strict: bool = True
    rest: Optional[dict[str, Any]] = None
    unread_keys: Iterable[str] = ()
    io_concurrency: Optional[int] = None
    weights_only: bool = True
    planner: Optional[Any] = None

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

    def restore(self, path: str, checked: Optional[verify.Verdict] = None, *, store: Optional[Store] = None) -> list[str]:
        """Load snapshot ``path``; the keys loaded (the RNG state last). ``checked``: rank 0's
        verdict on it (``verify.check``), whose parsed metadata is used instead of reading it
        again; without one, rank 0 makes that check first, and a snapshot it finds damaged is
        refused on every rank (SnapshotCorruptError) before anything is read into the state.
        ``store``: the open store of the directory holding ``path`` (rank 0's, as every rank's
        is under torch.distributed), used instead of opening one (an S3 store makes a client,
        tens of milliseconds)."""
        return _Restore(self, path, checked, store).run()


@dataclass
class _Checked:
    """What the check phase found: what to load, and the format's reader of the snapshot."""

    reader: FormatReader
    present: set[str]
    load: dict[str, Any]
    currents: dict[str, Any] = field(default_factory=dict)  # state dicts already asked for
    sinks: dict[str, Value] = field(default_factory=dict)
    restore_rng: bool = True


class _Restore:
    """The phases of one restore of ``path``."""

    def __init__(
        self, request: RestoreRequest, path: str, checked: Optional[verify.Verdict], store: Optional[Store] = None
    ) -> None:
        self.request = request
        self.opened = store  # the caller's store of the snapshot's directory, or None
        self.coll = request.collectives or Collectives(None)
        #: the hooks called: the request's manager; without one, the entry-point plugins where
        #: the snapshot holds entries the request does not name (``plugins_for``), else none
        self.pm: Optional[pluggy.PluginManager] = request.plugin_manager
        self.path = path
        self.verdict = checked
        self.started = time.perf_counter()
        #: what this rank met opening the snapshot's files (resolve), raised by check
        self.opening_error: Optional[BaseException] = None

    def run(self) -> list[str]:
        store, name = self.resolve()
        checked: Optional[_Checked] = None
        error: Optional[BaseException] = None
        try:
            checked = self.check(store, name)
        except Exception as exc:  # every rank reaches the agreement below, whatever it met
            error = exc
        # Damage any rank found (and nothing else) is raised on every rank as such: all fall back.
        # checked is None on a rank that learnt another rank failed: the agreement raises it.
        raise_if_any_failed(self.coll, error, f"restoring {self.path}", together=SnapshotCorruptError)
        assert checked is not None
        order = self.order(checked)
        states, own_error = self.read(checked, order)
        keys = self.load(checked, order, states, own_error)
        logger.info("restored snapshot %s in %.3fs (%s)", self.path, time.perf_counter() - self.started, ", ".join(keys))
        if self.pm is not None:
            self.pm.hook.tnt_snapshot_plugin_after_restore(path=self.path, keys=keys)
        return keys

    # -- resolve ------------------------------------------------------------------------------

    def resolve(self) -> tuple[Store, str]:
        """The snapshot (rank 0's path), complete, and intact as ``verify.check`` finds it."""
        self.path, checked = self.coll.broadcast((self.path, self.verdict is not None))
        dirpath, name = split_snapshot_path(self.path)
        store = self.opened if self.opened is not None else open_store(dirpath, self.request.storage_options)
        if not checked:  # the index and metadata read next, fetched together
            store.read_ahead(name, [(INDEX_FNAME, None), *((metadata, None) for metadata in metadata_files())])
        require_complete(store, name, self.path, self.coll)
        if not checked:
            self.verdict = self.checked(store, name)
        # every rank learns the format of rank 0's verdict (the others read the index themselves)
        fmt_name = self.coll.broadcast(self.verdict.format.name if self.verdict is not None and self.verdict.format else None)
        self.store, self.name = store, name
        try:  # this rank's own reads: a failure is raised once every rank has checked (run)
            # rank 0 under restore_from_latest: the index verify.check read and checked, not read again
            self.files = SnapshotFiles.open(
                store, name, self.path, concurrency=self.request.io_concurrency,
                index=self.verdict.index if self.verdict is not None else None,
                read_index=self.verdict is None,
            )
            self.files.read_ahead()  # the disk reads the payloads while the reads are planned
            fmt = get_format(fmt_name) if fmt_name is not None else format_of(store, name, self.files.index)
            if fmt is None:
                raise verify.damaged(self.path, "it holds the metadata of no format this version reads")
            self.format = fmt
        except Exception as exc:
            self.opening_error = exc
        return store, name

    def checked(self, store: Store, name: str) -> Optional[verify.Verdict]:
        """Rank 0's ``verify.check`` of the snapshot, the check restore_from_latest makes before
        it restores one (the verdict on rank 0, None on the others); a damaged snapshot raises
        SnapshotCorruptError on every rank. Restored on several ranks from the parts of its
        metadata each reads, rank 0 leaves the metadata's whole-file checksum out: each rank
        checks the digest of the parts it reads."""
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

    def plugins_for(self, present: set[str], failed: bool) -> tuple[Optional[pluggy.PluginManager], bool]:
        """The request's manager; without one, a new manager with the entry-point plugins
        (``new_plugin_manager``: the installed distributions read, a few milliseconds) only when
        the snapshot holds entries the request does not name, which a plugin's extra state may
        claim. On several ranks the ranks decide alike (a plugin's ``load_state_dict`` may run
        collectives): whether any rank's view holds such an entry, and whether any rank ``failed``
        to read the snapshot's metadata, are agreed in one gather before any other collective.
        Returns the manager (None: no hooks to call) and whether any rank failed."""
        named = set(self.request.app_state) | set(self.request.optional_keys) | {RNG_STATE_KEY}
        unnamed = bool(present - named)
        if self.coll.world_size > 1:
            views = self.coll.all_gather((unnamed, failed))
            unnamed, failed = any(u for u, _ in views), any(f for _, f in views)
        if self.request.plugin_manager is not None:
            return self.request.plugin_manager, failed
        return (new_plugin_manager() if unnamed else None), failed

    def wanted(self) -> dict[str, Any]:
        """The app state and every plugin's extra state, their keys checked for collisions."""
        app_state = self.request.app_state
        sources = extra_state_sources(self.pm, "restore", -1, -1) if self.pm is not None else []
        # Adapters check the unit's own keys before adding reserved entries (the train dataloader).
        check_collisions([k for k in app_state if k not in RESERVED_KEYS], sources)
        wanted = dict(app_state)
        for _source, entries in sources:
            wanted.update(entries)
        return wanted

    def check(self, store: Store, name: str) -> Optional[_Checked]:
        """What to load, checked against the snapshot; StateMismatchError where it does not fit.
        None where another rank failed to read the snapshot's metadata (:meth:`run` raises it)."""
        request, coll = self.request, self.coll
        error = self.opening_error
        present: set[str] = set()
        if error is None:
            verdict = self.verdict if self.verdict is not None and self.verdict.format is self.format else None
            try:
                reader = self.format.reader(self.files, coll, verdict, weights_only=bool(request.weights_only))
                present = reader.keys()
            except Exception as exc:  # raised after the ranks' agreement, which all make
                error = exc
        self.pm, any_failed = self.plugins_for(present, failed=error is not None)
        if error is not None:
            raise error
        if any_failed:  # no rank goes on to the collectives below while another cannot
            return None
        if request.planner is not None:
            plan_with = getattr(reader, "plan_with", None)
            if plan_with is None:
                raise ConfigError(
                    f"planner plans reads of checkpoints in DCP's format; {self.path} is in the "
                    f"{self.format.name} format, which has no planner: pass planner=None to restore it"
                )
            plan_with(request.planner)
        wanted = self.wanted()
        restore_rng = True
        if reader.world_size != coll.world_size:
            mapped = (
                present - set(request.unread_keys) if request.rest is not None
                else (set(wanted) | {RNG_STATE_KEY}) & present
            )
            restore_rng = reader.fit_world_size(mapped)
        load = self.select(wanted, present)
        checked = _Checked(reader, present, load, restore_rng=restore_rng)
        if request.strict:
            checked.currents = reader.check_modules(load)
        if request.rest is not None:
            unread = set(wanted) | {RNG_STATE_KEY} | set(request.unread_keys)
            checked.sinks = {key: Value() for key in sorted(present - unread)}
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
        reader = checked.reader
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
                    states[key] = reader.read(key, current)
                except Exception as exc:  # agreed on below, on every rank
                    read_errors.append((key, exc))
        agree_on_read_errors(self.path, read_errors, self.coll)
        return states, own_error

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
