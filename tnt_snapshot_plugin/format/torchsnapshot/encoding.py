"""What a snapshot's state encodes to on one rank, and why it cannot: flattening the frozen state,
the load check restore relies on, the agreement on the paths written once for all ranks, and
the error a failed encoding is reported as (the state's own fault, UnrestorableStateError naming
the entry, or a write error). Used by :class:`~tnt_snapshot_plugin.saving.writer.SnapshotWriter`."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from tnt_snapshot_plugin.app_state import NEVER_REPLICATED_SUFFIX, RESERVED_KEYS, Frozen
from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import UnrestorableStateError, as_write_error
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt
from tnt_snapshot_plugin.format.torchsnapshot.coordination import agree_on_paths


def agree_replicated(coll: Collectives, job: Any, leaves: dict[str, Any]) -> set[str]:
    """The logical paths written once for all ranks: those the ``replicated`` globs match
    that every rank has (one collective under torch.distributed, made on every rank)."""
    globs, auto, never = job.replicas
    patterns = replicated_patterns(globs, job.frozen, auto, never)
    if not patterns:
        return set()
    return agree_on_paths(coll, fmt.replicable(leaves, patterns))


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
        return as_write_error(exc, f"snapshot {job.name}")
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


def replicated_patterns(
    patterns: Optional[list[str]],
    frozen: Mapping[str, Frozen],
    auto_replicated: Iterable[str] = (),
    never_replicated: Iterable[str] = (),
) -> list[str]:
    """The ``replicated`` globs of this snapshot (matched against logical manifest paths).

    The user's globs are matched against every saved path, but the RNG, the dataloader and the
    progress entries are never marked replicated: they differ between ranks, and marking them would
    restore rank 0's copy everywhere; nor are the ``never_replicated`` keys an adapter names (a
    framework's loop state holding per-rank loader positions, say). An entry matched whole becomes
    ``key/**``; a partly matched one lists its matched paths.
    """
    auto_replicated = list(auto_replicated)
    never = set(never_replicated)
    out = [f"{_escape(key)}/**" for key in auto_replicated if key in frozen]
    if not patterns:
        return out
    for key, entry in frozen.items():
        if (
            key in RESERVED_KEYS
            or key.endswith(NEVER_REPLICATED_SUFFIX)
            or key in auto_replicated
            or key in never
        ):
            continue
        _, flat = fmt.flatten(key, entry.state_dict())
        paths = list(flat)
        matched = [p for p in paths if any(fnmatch.fnmatch(p, g) for g in patterns)]
        if matched and len(matched) == len(paths):
            out.append(f"{_escape(key)}/**")
        else:
            out.extend(_escape(p) for p in matched)
    return out


def _escape(path: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)
