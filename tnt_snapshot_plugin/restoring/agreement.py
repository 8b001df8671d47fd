"""How the ranks of a restore agree: a failure to read on any rank is raised on every rank (so they
fall back together), and an error from an entry's own code is told apart from damage."""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import (
    DistributedError,
    SnapshotCorruptError,
    SnapshotError,
    StateMismatchError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.format.objects import refusal


def agree_on_read_errors(path: str, errors: list[tuple[str, BaseException]], coll: Collectives) -> None:
    """Raise on every rank if any rank failed to read its entries of snapshot ``path`` (a
    damaged or truncated file): SnapshotCorruptError marked ``all_ranks``, so that
    restore_from_latest falls back on every rank together; UnrestorableStateError where
    torch's restricted unpickler refused an object."""
    refused = next((exc for _key, exc in errors if refused_by_weights_only(exc)), None)
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


def agree_after_loading(path: str, error: Optional[BaseException], coll: Collectives) -> None:
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


def raise_own_error(path: str, error: Any) -> None:
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


def is_users(stateful: Any) -> bool:
    """Whether ``stateful`` runs the user's code (or is the plugin's wrapper around it), as
    opposed to one of the plugin's own statefuls (the RNG state, a plain value)."""
    return not type(stateful).__module__.startswith("tnt_snapshot_plugin.") or hasattr(stateful, "__wrapped__")


def refused_by_weights_only(exc: BaseException) -> bool:
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
