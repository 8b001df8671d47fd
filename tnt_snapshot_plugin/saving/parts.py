"""What the parts of a saver share: the attributes its step gate depends on (each assignment
recomputes the gate), and, for the type checker, what each part (events.py, job.py,
run_guard.py, saver_plugins.py) reads from the others; :class:`~tnt_snapshot_plugin.saving.saver.
Snapshotter` combines the parts and defines all of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Optional, TypeVar

if TYPE_CHECKING:
    import pluggy

    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.naming import SnapshotName
    from tnt_snapshot_plugin.policies import PluginDecision
    from tnt_snapshot_plugin.saving.jobs import Job, SnapshotStats
    from tnt_snapshot_plugin.saving.preemption import PreemptionHandler
    from tnt_snapshot_plugin.saving.wall_clock import WallClock
    from tnt_snapshot_plugin.saving.writer import SnapshotWriter
    from tnt_snapshot_plugin.stores import DirLock, Store

T = TypeVar("T")


class _GateInput(Generic[T]):
    """An attribute that the step gate depends on: each assignment recomputes ``step_gate``.
    There is no ``__get__`` at run time, so reads come straight from the instance dict, as for a
    plain attribute."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __set__(self, obj: "SaverParts", value: T) -> None:
        obj.__dict__[self._name] = value
        obj._regate()

    if TYPE_CHECKING:  # what a read returns, for the type checker only

        def __get__(self, obj: "SaverParts", objtype: Optional[type] = None) -> T: ...


class SaverParts:
    """The state the parts of a saver share (see the module docstring)."""

    # What makes a step end more than a cadence check (see step_gate): the snapshot being
    # written (reaped at the next hook), prepare()'s second pass
    # (at the run's first step that does not snapshot), the wall-clock cadence, the signal handler.
    _pending: _GateInput[Optional[Job]] = _GateInput()
    _prepare_again: _GateInput[Optional[Callable[[], Mapping[str, Any]]]] = _GateInput()
    _wall: _GateInput[Optional[WallClock]] = _GateInput()
    _preemption: _GateInput[Optional[PreemptionHandler]] = _GateInput()

    if TYPE_CHECKING:  # defined by Snapshotter and the parts; declared here for the type checker
        config: SnapshotConfig
        plugin_manager: pluggy.PluginManager
        stats: SnapshotStats
        _store: Store
        _writer: SnapshotWriter
        _run_id: str
        _writes: int
        _last_name: Optional[str]
        _metric: Optional[Callable[[], Optional[tuple[str, float]]]]
        _plugin_decision: PluginDecision
        _ask_should: bool
        _metrics: Optional[Any]
        _lock: Optional[DirLock]

        @property
        def collectives(self) -> Collectives: ...

        def _regate(self) -> None: ...

        def save(self, epoch: int, step: int, app_state: Any, *, event: str = ..., eval_step: Optional[int] = ...) -> bool: ...

        def wait(self, *, warn_busy: bool = ..., raise_errors: bool = ..., timeout: Optional[float] = ...) -> bool: ...

        def _fail(self, name: SnapshotName, path: str, exc: BaseException) -> None: ...

        def _name(self, epoch: int, step: int, eval_step: Optional[int] = ..., metric: Any = ...) -> SnapshotName: ...

        def _plugins_changed(self) -> None: ...

        def _reap_if_done(self) -> None: ...

        def _stage_for_prepare(self, app_state: Callable[[], Mapping[str, Any]]) -> None: ...
