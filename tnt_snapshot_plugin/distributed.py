"""Checkpoint collectives on a dedicated gloo group.

Snapshots are written on a background thread while training may run its own collectives on the
default group; sharing a group between two threads can pair up the wrong operations. Every
collective of the plugin therefore runs on a gloo group of its own (created once, by all ranks,
in the saver's constructor or setup), with a finite timeout so a failed rank never leaves the
others waiting forever. Without an initialised process group every method is a local no-op.

One group serves one thread at a time: gloo pairs up the collectives of a group in the order each
rank issues them, so two threads of one rank sharing a group can issue theirs in different orders
on different ranks and deadlock (or exchange the wrong data). The preemption agreement that runs on
the training thread while a snapshot is being written (:class:`AgreedFlag`) therefore gets a group
of its own (the Snapshotter creates it next to the writer's).

A collective that times out or loses a peer raises :class:`DistributedError` saying so.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any, Callable, Optional, TypeVar, cast

import torch
import torch.distributed as dist

from tnt_snapshot_plugin import errors
from tnt_snapshot_plugin.errors import ConfigError, DistributedError, SnapshotError

T = TypeVar("T")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def require_process_group(what: str) -> None:
    """A ConfigError when the environment says this is one of several processes
    (``WORLD_SIZE`` > 1, as torchrun sets it) but torch.distributed is not initialised yet:
    each rank would then use its own dirpath (other ranks may pass ``""``) instead of rank 0's."""
    if is_initialized():
        return
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world_size > 1:
        raise ConfigError(
            f"WORLD_SIZE={world_size} is set but torch.distributed is not initialised: call "
            f"torch.distributed.init_process_group() before {what}, so that every rank uses "
            "rank 0's dirpath (or unset WORLD_SIZE for a single process)"
        )


#: (default group, timeout) -> the restores' gloo group, in a world of one process.
_solo_groups: list[tuple[Any, float, Any]] = []


def _solo_group(timeout_s: float) -> Any:
    """The gloo group of this world of one process for restores, made on first use; a default
    group destroyed and initialised again gets a new one."""
    world = dist.group.WORLD
    _solo_groups[:] = [g for g in _solo_groups if g[0] is world]  # the others died with theirs
    for _world, timeout, group in _solo_groups:
        if timeout == timeout_s:
            return group
    group = dist.new_group(ranks=[0], backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _solo_groups.append((world, timeout_s, group))
    return group


class Collectives:
    """The collectives the plugin needs, on ``group`` (None: a single process)."""

    def __init__(self, group: Optional[Any], timeout_s: float = 600.0, *, shared: bool = False) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self._shared = shared

    @classmethod
    def create(cls, process_group: Optional[Any], timeout_s: float, *, for_restore: bool = False) -> "Collectives":
        """A new gloo group over ``process_group``'s ranks (default: all); collective on WORLD.

        ``for_restore``: for one restore, on the calling thread. In a world of one process those
        share one group, made once: creating and destroying a gloo group costs 10-15 ms, a
        fifth of a 64 MiB restore, and there is no other rank to disagree with. (A saver keeps
        groups of its own: its writer thread must not share one with another thread.)
        """
        if not is_initialized():
            return cls(None, timeout_s)
        if for_restore and dist.get_world_size() == 1:
            return cls(_solo_group(timeout_s), timeout_s, shared=True)
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        group = dist.new_group(
            ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
        return cls(group, timeout_s)

    def close(self) -> None:
        """Destroy the group (for groups made for one operation, such as a restore)."""
        if self.group is not None:
            if not self._shared:
                dist.destroy_process_group(self.group)
            self.group = None

    def __enter__(self) -> "Collectives":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def alone(self) -> bool:
        """No other rank to exchange with (no group, or a group of one process, as under
        ``torchrun --nproc-per-node=1``): the collectives below return at once, as a group of
        one would (each gloo object collective costs 0.2-0.5 ms, a few per snapshot and restore)."""
        return self.world_size == 1

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.alone or self.group is None:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.group, 0), group=self.group
            )
        except RuntimeError as exc:  # a timeout or a lost peer, from the backend
            raise self.failed("broadcast", exc) from exc
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        if self.alone:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise self.failed("all_gather", exc) from exc
        return out

    def gather(self, obj: T) -> Optional[list[T]]:
        """Every rank's ``obj``, on rank 0 (in rank order); None on the other ranks."""
        if self.alone or self.group is None:
            return [obj]
        out: Optional[list[Any]] = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        except RuntimeError as exc:
            raise self.failed("gather", exc) from exc
        return out

    def barrier(self) -> None:
        if not self.alone:
            try:
                dist.barrier(group=self.group)
            except RuntimeError as exc:
                raise self.failed("barrier", exc) from exc

    def failed(self, what: str, exc: BaseException) -> DistributedError:
        """The typed error for a collective that timed out or lost a peer."""
        return DistributedError(
            f"checkpoint collective {what} on rank {self.rank} of {self.world_size} failed "
            f"({type(exc).__name__}: {exc}). Another rank has probably stopped (crashed, or left "
            f"training after an error) or is more than collective_timeout_s={self.timeout_s:g}s "
            "behind; look for the first error in the other ranks' logs. This rank stops instead "
            "of waiting for it."
        )

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and give every rank its result.

        If ``fn`` raises on rank 0, rank 0 re-raises it and every other rank raises an error
        carrying its message at once, instead of waiting for a result that never comes: of the
        same class when it is one of the plugin's errors (a bad dirpath is a ConfigError on every
        rank), a StorageUnavailableError (an OSError) for an I/O error, else a
        :class:`DistributedError`.
        """
        if self.alone:
            return fn()
        outcome: tuple[bool, Any]
        error: Optional[BaseException] = None
        if self.rank == 0:
            try:
                outcome = (True, fn())
            except Exception as exc:  # every rank must hear about it; re-raised below
                error = exc
                kind = type(exc).__name__
                if isinstance(exc, OSError) and not isinstance(exc, SnapshotError):
                    kind = "StorageUnavailableError"  # an I/O error of rank 0's storage
                outcome = (False, (kind, f"{type(exc).__name__}: {exc}"))
        else:
            outcome = (True, None)
        outcome = self.broadcast(outcome)
        if error is not None:
            raise error
        ok, value = outcome
        if not ok:
            kind, message = cast(tuple[str, str], value)
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, SnapshotError)):
                cls = DistributedError
            relayed = cls(f"rank 0 failed in a checkpoint step: {message}")
            relayed.consequence = True  # type: ignore[attr-defined]  # rank 0's is the cause
            raise relayed
        return cast(T, value)


#: How much training time passes between two agreements of :class:`AgreedFlag`, at most about:
#: rank 0 sets the number of steps between them from its step time. A gloo all-reduce has a
#: fixed cost that, paid at every step, would be a step's cost of its own
#: (``benchmarks/hooks.py`` measures the hooks under torch.distributed).
AGREE_EVERY_S = 0.25
#: ... and never more steps than this between two agreements.
AGREE_MAX_STEPS = 1000


class AgreedFlag:
    """An "any rank raised this flag?" agreement (MAX over the ranks' values) that costs no
    wait on the hot path, and no collective on most steps.

    The ranks agree at chosen steps, the same on every rank: the first step it is asked about,
    then every ``interval`` steps, where ``interval`` is rank 0's choice (about
    :data:`AGREE_EVERY_S` of training at rank 0's step time, at most :data:`AGREE_MAX_STEPS`),
    which rides on the agreement itself. At each agreement step (:meth:`due`) every rank calls
    :meth:`poll`: it starts a non-blocking MAX all-reduce of this rank's value and returns the
    previous agreement's result, which has long completed by then. So every rank sees a raised
    flag at the same step, one to two intervals after it was raised.

    It runs on the training thread while snapshots are written on a background thread, so
    ``collectives`` must be a group no other thread uses. ``clock``: rank 0's time source for its
    step time (the saver's clock; tests pass a fake one).
    """

    def __init__(self, collectives: Collectives, clock: Callable[[], float] = time.monotonic) -> None:
        self._coll = collectives
        self._clock = clock
        self._work: Optional[Any] = None
        self._value = torch.zeros(2, dtype=torch.int64)
        self._next_step: Optional[int] = None  # None: agree at the first step asked about
        self._last: Optional[tuple[int, float]] = None  # rank 0: (step, time) of its last poll

    def due(self, step: int) -> bool:
        """Whether the ranks agree at ``step`` (then every rank must call :meth:`poll`)."""
        return self._next_step is None or step >= self._next_step

    def next_due(self, step: int) -> int:
        """The first step from ``step`` on at which the ranks agree."""
        return step if self._next_step is None else max(step, self._next_step)

    def poll(self, local: int, step: int) -> int:
        """The MAX over the ranks of the ``local`` values given at the previous agreement (0 at
        the first); without a process group, or in a group of one rank, ``local`` itself at once
        (one rank has no one to agree with). A bool works as 0/1. Call it at the steps
        :meth:`due` names, on every rank."""
        if self._coll.alone:
            return int(local)
        agreed, interval = 0, 1
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._coll.failed("all_reduce (preemption and time-cadence agreement)", exc) from exc
            agreed, interval = int(self._value[0]), max(1, int(self._value[1]))
        self._value = torch.tensor([int(local), self._propose(step)], dtype=torch.int64)
        self._work = dist.all_reduce(
            self._value, op=dist.ReduceOp.MAX, group=self._coll.group, async_op=True
        )
        self._next_step = step + interval
        return agreed

    def _propose(self, step: int) -> int:
        """Rank 0's number of steps between agreements, from its step time since the last one
        (the other ranks propose 0: the MAX is rank 0's)."""
        if self._coll.rank != 0:
            return 0
        now = self._clock()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 1
        per_step = (now - last[1]) / (step - last[0])
        if per_step <= 0:
            return AGREE_MAX_STEPS
        return max(1, min(AGREE_MAX_STEPS, math.ceil(AGREE_EVERY_S / per_step)))

    def drain(self) -> None:
        """Wait for the last reduction; a failed one was (or will be) reported elsewhere."""
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except RuntimeError:
                pass  # cleanup after training: never raise over the error that ended it


def is_consequence(error: BaseException) -> bool:
    """Whether ``error`` only follows from a failure elsewhere (a collective that lost a peer,
    another rank's error relayed, a write refused after an earlier one failed): never the cause
    to report when the cause itself is known."""
    return isinstance(error, DistributedError) or bool(getattr(error, "consequence", False))


def raise_if_any_failed(
    coll: Collectives, error: Optional[BaseException], what: str, *, together: Optional[type[SnapshotError]] = None
) -> None:
    """Tell every rank whether any rank failed ``what``; raise the same error kind everywhere.

    Every rank reports the failures that caused it: a rank's error that only follows from
    another's (:func:`is_consequence`) is left out while a cause is known, so the rank where the
    failure began is the one named on every rank, however the ranks' timing fell.

    ``together``: an error class that, when every rank that failed raised one, is raised on every
    rank (those that did not fail too) marked ``all_ranks``: the ranks may then go on together
    (restore_from_latest falls back from a snapshot any rank found damaged)."""
    together_kind = together is not None and isinstance(error, together)
    consequence = error is not None and is_consequence(error)
    reports = coll.all_gather(
        None if error is None else (together_kind, f"{type(error).__name__}: {error}", consequence)
    )
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    causes = [(rank, report) for rank, report in failed if not report[2]] or failed
    own_cause = error is not None and (not consequence or len(causes) == len(failed))
    one_verdict = len({report[1] for _rank, report in causes}) == 1
    detail = "; ".join(f"rank {rank}: {report[1]}" for rank, report in causes)
    if together is not None and all(report[0] for _rank, report in causes):
        if error is not None and own_cause and one_verdict:
            error.all_ranks = True  # type: ignore[attr-defined]
            raise error
        shared = together(f"{what} failed: {detail}")
        shared.all_ranks = True  # type: ignore[attr-defined]
        raise shared from error
    if error is not None and own_cause and one_verdict:
        raise error  # this rank's own, or the same verdict on every rank that failed
    if isinstance(error, SnapshotError) and own_cause:
        raise type(error)(f"{what} failed: {detail}") from error
    raise DistributedError(f"{what} failed: {detail}") from error
