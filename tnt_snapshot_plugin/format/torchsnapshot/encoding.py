"""What a snapshot's state encodes to on one rank, and why it cannot: flattening the frozen state,
the load check restore relies on, the agreement on the paths written once for all ranks, and
the error a failed encoding is reported as (the state's own fault, UnrestorableStateError naming
the entry, or a write error). Used by :class:`~tnt_snapshot_plugin.saving.writer.SnapshotWriter`."""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import SnapshotError, SnapshotWriteError, UnrestorableStateError
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt
from tnt_snapshot_plugin.format.torchsnapshot.coordination import agree_on_paths


def check_loadable(load_check: Any, coll: Collectives, job: Any) -> None:
    """Refuse to write a snapshot restore could not load (off the training thread; every
    rank agrees before any writes)."""
    error: Optional[BaseException] = None
    try:
        load_check.check(job.frozen)
    except SnapshotError as exc:
        error = exc
    except Exception as exc:  # an object torch.save cannot even encode (pickle refuses it)
        error = unencodable(job, exc, None)
    if coll.world_size > 1:
        reports = coll.all_gather(None if error is None else str(error))
        failed = [f"rank {rank}: {msg}" for rank, msg in enumerate(reports) if msg is not None]
        if failed and (error is None or len(failed) > 1):
            raise UnrestorableStateError("; ".join(failed)) from error
    if error is not None:
        raise error


def agree_replicated(coll: Collectives, job: Any, leaves: dict[str, Any]) -> set[str]:
    """The logical paths written once for all ranks: those the ``replicated`` globs match
    that every rank has (one collective under torch.distributed, made on every rank)."""
    if not job.replicated:
        return set()
    return agree_on_paths(coll, fmt.replicable(leaves, job.replicated))


def flatten(job: Any) -> tuple[dict[str, dict[str, Any]], dict[str, Any], Optional[BaseException]]:
    """The containers and leaves of ``job``'s state, and the error encoding it (raised on
    every rank later, after the collectives every rank makes)."""
    containers: dict[str, dict[str, Any]] = {}
    leaves: dict[str, Any] = {}
    try:
        for key, frozen in job.frozen.items():
            c, leaf = fmt.flatten(key, frozen.state_dict())
            containers.update(c)
            leaves.update(leaf)
    except Exception as exc:  # recorded, and raised on every rank below
        return containers, leaves, unencodable(job, exc, leaves)
    return containers, leaves, None


def unencodable(job: Any, exc: BaseException, leaves: Optional[dict[str, Any]]) -> BaseException:
    """The error for ``exc``, raised while the state of ``job`` was encoded (flattened, pickled,
    laid out): UnrestorableStateError naming the entry and its type when encoding that entry
    alone fails too (the state's own fault: every snapshot of it would fail the same way), else
    the write error it always was (a transient failure, such as memory)."""
    if isinstance(exc, UnrestorableStateError):
        return exc
    found = _culprit(job, leaves)
    if found is None:
        return write_error(job, exc)
    path, value, cause = found
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    error = UnrestorableStateError(
        f"snapshot {job.name}: the app-state entry {path!r} holds a {kind} that cannot be "
        f"encoded into a snapshot ({type(cause).__name__}: {cause}). Nothing was committed, and "
        "training stops whatever on_save_error says: every snapshot of this state would fail "
        "the same way. Store it as tensors or plain values (numbers, strings, lists, dicts), or "
        "make it picklable (a class defined at module level, a function by name, not a lambda)"
    )
    error.__cause__ = cause
    return error


def _discard(payload: fmt.Payload) -> None:
    """An ``emit`` that keeps nothing (the encoding alone is tried)."""


def _culprit(job: Any, leaves: Optional[dict[str, Any]]) -> Optional[tuple[str, Any, BaseException]]:
    """The first (path, value, error) of the state of ``job`` whose encoding alone fails; None if
    each entry encodes on its own. ``leaves``: the flattened state, if flattening got that far."""
    if leaves is None:
        leaves = {}
        for key, frozen in job.frozen.items():
            try:
                leaves.update(fmt.flatten(key, frozen.state_dict())[1])
            except Exception as exc:
                return key, frozen.state_dict(), exc
    for path, value in leaves.items():
        try:
            fmt.plan({}, {path: value}, rank=0, world_size=1, replicated=set(), emit=_discard)
        except MemoryError:
            continue  # not the value's fault
        except Exception as exc:
            return path, value, exc
    return None


def write_error(job: Any, exc: BaseException) -> BaseException:
    if isinstance(exc, SnapshotError):
        return exc
    error = SnapshotWriteError(f"writing snapshot {job.name} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error

