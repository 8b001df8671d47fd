"""What a torchtnt unit contributes to a snapshot: its app state (optimizers over FSDP modules
wrapped as torchtnt's saver wraps them), the train loader's state, the metric that
``best_checkpoint_config`` monitors, and the unit's metric logger."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional

from torchtnt.framework.state import State
from torchtnt.framework.unit import AppStateMixin

from tnt_snapshot_plugin.adapters.torchtnt.fsdp import wrap_fsdp_optimizers
from tnt_snapshot_plugin.app_state import TRAIN_DATALOADER_KEY, is_stateful
from tnt_snapshot_plugin.errors import ConfigError, ProgressOnlyWarning


def unit_state(unit: AppStateMixin) -> dict[str, Any]:
    """The unit's app state, its optimizers over FSDP modules saved through FSDP's optimizer
    state-dict APIs (as torchtnt's saver does)."""
    app_state = dict(unit.app_state())
    app_state.update(wrap_fsdp_optimizers(unit.tracked_modules(), unit.tracked_optimizers()))
    return app_state


#: The unit's progress entries: a snapshot holding nothing else cannot resume training.
PROGRESS_KEYS = frozenset({"train_progress", "eval_progress", "predict_progress"})


def warn_progress_only(unit: Any, keys: Iterable[str], snapshotter: Any) -> bool:
    """At train start: a ProgressOnlyWarning if ``unit``'s app state (``keys``) holds nothing but
    its progress and no plugin adds state to the snapshots (``snapshotter``'s plugins); whether
    it warned."""
    if not set(keys) <= PROGRESS_KEYS or snapshotter.plugin_manager.hook.tnt_snapshot_plugin_extra_state.get_hookimpls():
        return False
    if snapshotter.collectives.rank != 0:
        return True  # warned on rank 0
    warnings.warn(
        f"the unit {type(unit).__name__} tracks no modules, optimizers, LR schedulers or other "
        f"stateful attributes: its snapshots hold only its progress and the RNG state, and cannot "
        "resume its training; assign them as attributes of the unit (self.model = ..., "
        "self.optimizer = ...), which torchtnt tracks, or add state with a plugin "
        "(tnt_snapshot_plugin_extra_state)",
        ProgressOnlyWarning,
        stacklevel=5,
    )
    return True


def collector(state: State, unit: AppStateMixin) -> Callable[[bool], dict[str, Any]]:
    """What a snapshot of ``unit`` under ``state`` holds, collected when it is taken."""

    def collect(intra_epoch: bool) -> dict[str, Any]:
        # The loader's state is saved at epoch ends too (torchtnt's saver only saves it mid-epoch):
        # a loader that reshuffles by epoch would otherwise replay the first epoch's order.
        app_state = unit_state(unit)
        if state.train_state is not None:
            loader = state.train_state.dataloader
            if is_stateful(loader):
                app_state[TRAIN_DATALOADER_KEY] = loader
        return app_state

    return collect


def not_started(intra_epoch: bool) -> dict[str, Any]:
    """The collector of a saver whose ``on_train_start`` has not run."""
    raise RuntimeError(
        "TorchSnapshotSaver.on_train_start was not called before a snapshot was due; pass the "
        "saver in train()/fit()'s callbacks, which call its hooks in order"
    )


def unit_metric(unit: Any, attribute: str) -> Optional[tuple[str, float]]:
    """The unit's ``attribute`` as (attribute, float), None if its value is None; ConfigError
    if the unit has no such attribute or its value is not a number."""
    if not hasattr(unit, attribute):
        raise ConfigError(
            f"best_checkpoint_config monitors {attribute!r}, but the unit {type(unit).__name__} has "
            f"no attribute {attribute!r} when a snapshot is taken; set self.{attribute} in the unit "
            "(e.g. in eval_step or on_eval_epoch_end) before snapshots are taken"
        )
    value = getattr(unit, attribute)
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError(type(value).__name__)
        number = float(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"best_checkpoint_config monitors {attribute!r}, but the unit's {attribute} is "
            f"{value!r}, not a number (a float, int or one-element tensor): {exc}"
        ) from exc
    return attribute, number


def unit_metric_logger(unit: Any) -> Optional[Any]:
    """The unit's torchtnt MetricLogger (an attribute ``metric_logger`` or ``logger``), if any."""
    for name in ("metric_logger", "logger"):
        candidate = getattr(unit, name, None)
        if callable(getattr(candidate, "log_dict", None)):
            return candidate
    return None
