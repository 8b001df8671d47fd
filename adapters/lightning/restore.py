"""The Lightning adapter's restores outside ``fit`` (weights, optimizer and LR scheduler states
into a module, for evaluation or fine-tuning): each builds one
:class:`~tnt_snapshot_plugin.restoring.RestoreRequest` and runs it."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import pluggy

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.errors import StateMismatchError
from tnt_snapshot_plugin.restoring import RestoreRequest


def restore(
    path: str,
    module: Any,
    *,
    optimizers: Optional[Sequence[Any]] = None,
    lr_schedulers: Optional[Sequence[Any]] = None,
    storage_options: Optional[dict[str, Any]] = None,
    process_group: Optional[Any] = None,
    strict: bool = True,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    weights_only: bool = True,
    collective_timeout_s: float = 600.0,
) -> None:
    """Load snapshot ``path``'s weights into ``module`` (and optimizer / LR scheduler states).

    For evaluation or fine-tuning outside ``fit``; to resume training use
    ``trainer.fit(model, ckpt_path=path)``. ``module`` is the LightningModule (or any module
    with the same ``state_dict`` keys); ``optimizers`` / ``lr_schedulers`` are lists in the
    order ``configure_optimizers`` returns them. The RNG state is restored too. Raises
    SnapshotNotFoundError if ``path`` is not a complete snapshot, StateMismatchError if the
    module or the number of optimizers does not match it. ``weights_only=False`` loads the
    snapshot's objects with full pickle (trusted snapshots only). ``collective_timeout_s``:
    how long a collective of the restore (under torch.distributed) waits for a failed rank.
    """
    request = module_request(module, optimizers, lr_schedulers, storage_options, plugin_manager, strict, weights_only)
    with request.on_ranks(process_group, collective_timeout_s) as request:
        request.restore(path)
    _raise_mismatch(request.app_state)


def restore_from_latest(
    dirpath: str,
    module: Any,
    *,
    optimizers: Optional[Sequence[Any]] = None,
    lr_schedulers: Optional[Sequence[Any]] = None,
    storage_options: Optional[dict[str, Any]] = None,
    process_group: Optional[Any] = None,
    strict: bool = True,
    fallback: bool = True,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    weights_only: bool = True,
    collective_timeout_s: float = 600.0,
) -> bool:
    """:meth:`restore` the newest complete snapshot in ``dirpath``.

    Returns True if one was restored; False, with a NothingToRestoreWarning naming ``dirpath`` and
    what it holds, where it holds no complete snapshot. A damaged newest snapshot is skipped with
    a SnapshotFallbackWarning and the previous one restored (``fallback=False`` raises SnapshotCorruptError instead). ``weights_only``,
    ``collective_timeout_s``: as :meth:`restore`.
    """
    request = module_request(module, optimizers, lr_schedulers, storage_options, plugin_manager, strict, weights_only)
    with request.on_ranks(process_group, collective_timeout_s) as request:
        restored = restoring.restore_from_latest(dirpath, request=request, fallback=fallback)
    _raise_mismatch(request.app_state)
    return restored is not None


def module_request(
    module: Any,
    optimizers: Optional[Sequence[Any]],
    lr_schedulers: Optional[Sequence[Any]],
    storage_options: Optional[dict[str, Any]],
    plugin_manager: Optional[pluggy.PluginManager],
    strict: bool,
    weights_only: bool,
) -> RestoreRequest:
    """The request that loads a Lightning snapshot's weights into ``module`` (its
    ``state_dict`` entry), and its optimizer and LR scheduler states into those given."""
    app_state: dict[str, Any] = {"state_dict": module}
    if optimizers is not None:
        app_state["optimizer_states"] = _Each("optimizer states", optimizers)
    if lr_schedulers is not None:
        app_state["lr_schedulers"] = _Each("LR scheduler states", lr_schedulers)
    return RestoreRequest(
        app_state, storage_options=storage_options, plugin_manager=plugin_manager, strict=strict,
        weights_only=weights_only,
    )


class _Each:
    """A Stateful over a list of Statefuls (the optimizers, the LR schedulers).

    A count that does not match the snapshot loads none of them and is reported after the
    restore (so that every rank makes the same calls, and the restore fails as a whole).
    """

    def __init__(self, what: str, objects: Sequence[Any]) -> None:
        self.what = what
        self.objects = list(objects)
        self.mismatch: Optional[str] = None

    def state_dict(self) -> list[Any]:
        return [obj.state_dict() for obj in self.objects]

    def load_state_dict(self, states: list[Any]) -> None:
        if len(states) != len(self.objects):
            self.mismatch = (
                f"the snapshot holds {len(states)} {self.what}, {len(self.objects)} were given "
                "(none of them was loaded); pass them all, in the order configure_optimizers returns them"
            )
            return
        for obj, state in zip(self.objects, states, strict=True):
            obj.load_state_dict(state)


def _raise_mismatch(app_state: Mapping[str, Any]) -> None:
    problems = [e.mismatch for e in app_state.values() if isinstance(e, _Each) and e.mismatch]
    if problems:
        raise StateMismatchError("; ".join(problems))

