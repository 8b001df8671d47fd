"""The torchtnt adapter's static restores (torchtnt 0.2.4's signatures): each maps its
arguments onto one :class:`~tnt_snapshot_plugin.restoring.RestoreRequest` for the unit and runs
it; and the RNG state a restore hands, through the unit it restored, to the saver of the run that
follows."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Optional

import pluggy
from torchtnt.framework.unit import AppStateMixin

from tnt_snapshot_plugin import restoring
from tnt_snapshot_plugin.adapters.torchtnt.options import knobs_of
from tnt_snapshot_plugin.adapters.torchtnt.state import unit_state
from tnt_snapshot_plugin.adapters.torchtnt.titan import TitanRestore, is_titan
from tnt_snapshot_plugin.app_state import TRAIN_DATALOADER_KEY, RNGState, check_collisions, is_stateful
from tnt_snapshot_plugin.distributed import require_process_group
from tnt_snapshot_plugin.errors import ConfigError, DataLoaderReplayWarning, NothingToRestoreWarning
from tnt_snapshot_plugin.naming import TORCHTITAN
from tnt_snapshot_plugin.restoring import RestoreRequest

TRAIN_PROGRESS_KEY = "train_progress"
EVAL_PROGRESS_KEY = "eval_progress"

#: The attribute of a restored unit that holds the RNG state its restore set, until the saver of
#: the run that follows takes it (:func:`take_restored_rng`, at train start). A plain dict: the
#: unit does not track it as state, and it is never saved.
RESTORED_RNG_ATTR = "_tnt_snapshot_plugin_restored_rng"


def take_restored_rng(unit: Any) -> Optional[dict[str, Any]]:
    """The RNG state the last restore of ``unit`` set (None: none since the last train start),
    taken off the unit: each restore hands it to one run."""
    return vars(unit).pop(RESTORED_RNG_ATTR, None) if hasattr(unit, "__dict__") else None


def restore(
    path: str,
    unit: AppStateMixin,
    *,
    train_dataloader: Optional[Any] = None,
    process_group: Optional[Any] = None,
    restore_options: Optional[Any] = None,
    storage_options: Optional[dict[str, Any]] = None,
    knob_options: Optional[Any] = None,
    strict: Optional[bool] = None,
    restore_train_progress: Optional[bool] = None,
    restore_eval_progress: Optional[bool] = None,
    restore_optimizers: Optional[bool] = None,
    restore_lr_schedulers: Optional[bool] = None,
    collective_timeout_s: float = 600.0,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    weights_only: bool = True,
    planner: Optional[Any] = None,
) -> None:
    """Restore the snapshot at ``path`` into ``unit`` (and ``train_dataloader``, if given).

    torchtnt 0.2.4's signature: ``restore_options=RestoreOptions(restore_train_progress,
    restore_eval_progress, restore_optimizers, restore_lr_schedulers, strict)`` says what to
    load; ``knob_options.max_per_rank_io_concurrency`` caps the files read at once (default 8
    on local disk, 4 ranged reads on S3).
    The same switches may be passed as keyword arguments (a keyword that contradicts
    ``restore_options`` raises ConfigError). An entry not restored keeps the unit's value.
    Under torch.distributed rank 0's ``path`` is used (the others may pass ``""``).

    A ``unit`` that is not a torchtnt unit raises ConfigError (restore modules with
    :func:`tnt_snapshot_plugin.restore` and a dict). A mid-epoch snapshot restored without the
    loader's position (a ``train_dataloader`` without ``state_dict``/``load_state_dict``) gives a
    DataLoaderReplayWarning saying how many batches the resumed epoch runs again.
    Raises SnapshotNotFoundError if ``path`` is not a complete snapshot, StateMismatchError
    if the unit does not fit it, SnapshotCorruptError if its files cannot be read; an error
    raised by the unit's own ``load_state_dict`` propagates as it is.
    ``weights_only=False`` loads the snapshot's objects with full pickle (only for snapshots
    you trust); by default an object torch's restricted unpickler refuses raises
    UnrestorableStateError. ``planner``: a DCP ``LoadPlanner`` that plans the tensor reads of a
    snapshot in DCP's format (ConfigError for one in torchsnapshot's).

    A torchtitan checkpoint (``.../step-N``) is restored into what maps onto the unit (its
    model, optimizer, LR scheduler and step count: :mod:`.titan`), the rest named in a
    PartialRestoreWarning.
    """
    request, options = unit_request(
        unit, train_dataloader, restore_options, storage_options, knob_options, plugin_manager, weights_only,
        strict=strict, restore_train_progress=restore_train_progress, restore_eval_progress=restore_eval_progress,
        restore_optimizers=restore_optimizers, restore_lr_schedulers=restore_lr_schedulers, planner=planner,
    )
    with request.on_ranks(process_group, collective_timeout_s) as request:
        assert request.collectives is not None
        path = request.collectives.broadcast(path)  # rank 0's
        rank = request.collectives.rank
        if is_titan(path):
            titan = options.titan(unit, request)
            titan.request.restore(path)
            titan.apply(path, rank)
            return
        request.restore(path)
    options.hand_rng_to_saver(unit)
    options.warn_replay(unit, train_dataloader, path, rank)


def restore_from_latest(
    dirpath: str,
    unit: AppStateMixin,
    *,
    train_dataloader: Optional[Any] = None,
    process_group: Optional[Any] = None,
    restore_options: Optional[Any] = None,
    storage_options: Optional[dict[str, Any]] = None,
    knob_options: Optional[Any] = None,
    strict: Optional[bool] = None,
    restore_train_progress: Optional[bool] = None,
    restore_eval_progress: Optional[bool] = None,
    restore_optimizers: Optional[bool] = None,
    restore_lr_schedulers: Optional[bool] = None,
    fallback: bool = True,
    collective_timeout_s: float = 600.0,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    weights_only: bool = True,
    planner: Optional[Any] = None,
) -> bool:
    """Restore the newest complete snapshot in ``dirpath`` (arguments as :meth:`restore`).

    Returns True if one was restored; False, with a NothingToRestoreWarning naming ``dirpath``
    and what it holds (no such directory, nothing, other tools' checkpoints, snapshots never
    committed), where it holds no complete snapshot. A damaged newest snapshot is skipped with a
    SnapshotFallbackWarning naming it and the problem, and the previous one restored (``fallback=False`` raises SnapshotCorruptError instead); if snapshots exist
    but none can be read, SnapshotCorruptError is raised rather than returning False. A
    snapshot that does not fit the unit, or an error from the unit's own code, is raised at
    once, with no fallback. Under torch.distributed rank 0's ``dirpath`` is used and rank 0
    picks the snapshot.
    ``weights_only``, ``planner``: as :meth:`restore`.

    Besides the plugin's snapshots it considers other tools' checkpoints in ``dirpath``:
    torchtnt's savers' (``epoch_E_train_step_S``, in torchsnapshot's or DCP's format) and
    torchtitan's (``step-N``, restored as :meth:`restore` restores them). They order by their
    names, before every snapshot of the plugin's (see restoring.restore_from_latest).
    """
    request, options = unit_request(
        unit, train_dataloader, restore_options, storage_options, knob_options, plugin_manager, weights_only,
        strict=strict, restore_train_progress=restore_train_progress, restore_eval_progress=restore_eval_progress,
        restore_optimizers=restore_optimizers, restore_lr_schedulers=restore_lr_schedulers, planner=planner,
    )
    with request.on_ranks(process_group, collective_timeout_s) as request:
        titan = options.titan(unit, request)
        restored = restoring.restore_from_latest(
            dirpath, request=request, fallback=fallback, layouts={TORCHTITAN: titan.request}
        )
        rank = request.collectives.rank if request.collectives is not None else 0
        if restored is not None and is_titan(restored):
            titan.apply(restored, rank)
            return True
    if restored is not None:
        options.hand_rng_to_saver(unit)
        options.warn_replay(unit, train_dataloader, restored, rank)
    return restored is not None


def restore_from_best(
    dirpath: str,
    unit: AppStateMixin,
    metric_name: str,
    mode: str,
    *,
    train_dataloader: Optional[Any] = None,
    process_group: Optional[Any] = None,
    restore_options: Optional[Any] = None,
    storage_options: Optional[dict[str, Any]] = None,
    knob_options: Optional[Any] = None,
    strict: Optional[bool] = None,
    restore_train_progress: Optional[bool] = None,
    restore_eval_progress: Optional[bool] = None,
    restore_optimizers: Optional[bool] = None,
    restore_lr_schedulers: Optional[bool] = None,
    collective_timeout_s: float = 600.0,
    plugin_manager: Optional[pluggy.PluginManager] = None,
    weights_only: bool = True,
    planner: Optional[Any] = None,
) -> bool:
    """Restore the best complete snapshot in ``dirpath`` by ``metric_name`` (torchtnt 0.2.4's
    signature; other arguments as :meth:`restore`).

    ``mode="min"`` picks the lowest value, ``"max"`` the highest (NaN ranks worst; of equal
    values, the one committed first). Snapshots carry the metric in their names
    (``..._<metric>=<value>``, as ``best_checkpoint_config`` writes them, and torchtnt's own
    saver too). Returns False, with a NothingToRestoreWarning, when no complete snapshot carries it. Under
    torch.distributed rank 0 picks the snapshot.
    """
    request, options = unit_request(
        unit, train_dataloader, restore_options, storage_options, knob_options, plugin_manager, weights_only,
        strict=strict, restore_train_progress=restore_train_progress, restore_eval_progress=restore_eval_progress,
        restore_optimizers=restore_optimizers, restore_lr_schedulers=restore_lr_schedulers, planner=planner,
    )
    with request.on_ranks(process_group, collective_timeout_s) as request:
        path = restoring.best_snapshot(
            dirpath, metric_name, mode, storage_options=storage_options, collectives=request.collectives
        )
        if path is not None:
            request.restore(path)
        rank = request.collectives.rank if request.collectives is not None else 0
    if path is None:
        if rank == 0:
            warnings.warn(
                f"restore_from_best: no complete snapshot in {dirpath} carries the metric "
                f"{metric_name!r}: nothing was restored; snapshots carry it in their names when "
                "the saver has best_checkpoint_config",
                NothingToRestoreWarning,
                stacklevel=2,
            )
        return False
    options.hand_rng_to_saver(unit)
    options.warn_replay(unit, train_dataloader, path, rank)
    return True


@dataclass(frozen=True)
class Options:
    """What to restore: torchtnt's RestoreOptions, merged with the keyword arguments."""

    restore_train_progress: bool = True
    restore_eval_progress: bool = True
    restore_optimizers: bool = True
    restore_lr_schedulers: bool = True
    strict: bool = True

    @classmethod
    def merge(cls, restore_options: Any, **given: Optional[bool]) -> Options:
        """The options of ``restore_options`` (torchtnt's RestoreOptions, or None), overridden by
        the keyword arguments that are not None; ConfigError where the two contradict."""
        names = [f.name for f in fields(cls)]
        if restore_options is not None and not all(hasattr(restore_options, n) for n in names):
            raise ConfigError(
                "restore_options must be a RestoreOptions (torchtnt.framework.callbacks."
                f"checkpointer_types) or None, got {restore_options!r}"
            )
        values = {}
        for name in names:
            from_options = getattr(restore_options, name) if restore_options is not None else None
            value = given[name]
            if value is not None and from_options is not None and value != from_options:
                raise ConfigError(
                    f"{name}={value!r} contradicts restore_options.{name}={from_options!r}; pass "
                    "the setting once (in restore_options or as a keyword argument)"
                )
            value = value if value is not None else from_options
            value = True if value is None else value
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
            values[name] = value
        return cls(**values)

    def warn_replay(self, unit: Any, train_dataloader: Optional[Any], path: str, rank: int) -> None:
        """After restoring snapshot ``path`` (its train progress loaded): on rank 0, a
        DataLoaderReplayWarning when the snapshot was taken mid-epoch and ``train_dataloader``
        has no state_dict/load_state_dict (its position is not restored), saying how many batches
        the resumed epoch runs again."""
        progress = getattr(unit, "train_progress", None)
        replayed = getattr(progress, "num_steps_completed_in_epoch", 0)
        if rank != 0 or not self.restore_train_progress or not replayed:
            return
        if train_dataloader is None or is_stateful(train_dataloader):
            return
        warnings.warn(
            f"snapshot {path} was taken {replayed} batches into an epoch, and train_dataloader has "
            "no state_dict/load_state_dict, so its position is not restored: the resumed epoch "
            f"starts again at the loader's first batch and runs {replayed} batches more than an "
            "uninterrupted run; a loader with state_dict/load_state_dict (torchdata's "
            "StatefulDataLoader) resumes at the next batch",
            DataLoaderReplayWarning,
            stacklevel=3,
        )

    def titan(self, unit: Any, request: RestoreRequest) -> TitanRestore:
        """The restore of a torchtitan checkpoint into ``unit`` as these options say."""
        skip = set()
        if not self.restore_train_progress:
            skip.add(TRAIN_PROGRESS_KEY)
        if not self.restore_eval_progress:
            skip.add(EVAL_PROGRESS_KEY)
        if not self.restore_optimizers:
            skip.update(unit.tracked_optimizers())
        if not self.restore_lr_schedulers:
            skip.update(unit.tracked_lr_schedulers())
        return TitanRestore(unit, request, skip, self.strict)

    def hand_rng_to_saver(self, unit: Any) -> None:
        """After a restore that loaded the train progress: the RNG state it set, kept on the unit
        for the saver of the run that follows (set again after the first batch of a mid-epoch
        resume)."""
        if self.restore_train_progress and hasattr(unit, "__dict__"):
            # set in the instance's dict: the unit's __setattr__ would not track a dict anyway
            vars(unit)[RESTORED_RNG_ATTR] = RNGState().state_dict()


def unit_request(
    unit: AppStateMixin,
    train_dataloader: Optional[Any],
    restore_options: Any,
    storage_options: Optional[dict[str, Any]],
    knob_options: Any,
    plugin_manager: Optional[pluggy.PluginManager],
    weights_only: bool,
    planner: Optional[Any] = None,
    **flags: Optional[bool],
) -> tuple[RestoreRequest, Options]:
    """The request that restores ``unit`` (and ``train_dataloader``) as torchtnt's arguments
    say, with the options it was built from. ``flags``: ``strict`` and the ``restore_*``
    switches given as keyword arguments."""
    if not isinstance(unit, AppStateMixin):
        kind = f"{type(unit).__module__}.{type(unit).__qualname__}"
        raise ConfigError(
            f"unit must be a torchtnt unit (a TrainUnit, EvalUnit or other AppStateMixin), got a "
            f"{kind}; to restore modules or other objects with state_dict/load_state_dict, pass "
            "them in a dict: tnt_snapshot_plugin.restore(path, {'model': module}) (or "
            "restore_from_latest(dirpath, {...}))"
        )
    require_process_group("restoring")
    options = Options.merge(restore_options, **flags)
    knobs = knobs_of("knob_options", knob_options)
    check_planner(planner)
    app_state, optional = restore_state(unit, train_dataloader, options)
    request = RestoreRequest(
        app_state, optional_keys=optional, storage_options=storage_options, plugin_manager=plugin_manager,
        strict=options.strict, io_concurrency=knobs.max_per_rank_io_concurrency, weights_only=weights_only,
        planner=planner,
    )
    return request, options


#: What the plugin's DCP reader asks of a LoadPlanner; it never calls the others.
_PLANNER_CALLS = ("set_up_planner", "create_local_plan", "resolve_tensor", "commit_tensor")
_PLANNER_UNCALLED = ("create_global_plan", "finish_plan", "load_bytes")


def check_planner(planner: Any) -> None:
    """ConfigError unless ``planner`` is None or a DCP ``LoadPlanner`` whose overrides the
    plugin's DCP reader honours (it plans each rank's reads alone, and loads values that are not
    tensors under its allow-list, never through ``load_bytes``)."""
    if planner is None:
        return
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlanner

    if not isinstance(planner, LoadPlanner):
        raise ConfigError(
            f"planner must be a torch.distributed.checkpoint LoadPlanner (DefaultLoadPlanner or a "
            f"subclass) or None, got {type(planner).__name__}"
        )
    base = DefaultLoadPlanner if isinstance(planner, DefaultLoadPlanner) else LoadPlanner
    overridden = [name for name in _PLANNER_UNCALLED if getattr(type(planner), name) is not getattr(base, name)]
    if overridden:
        raise ConfigError(
            f"planner {type(planner).__name__} overrides {', '.join(overridden)}, which restore "
            f"never calls: it plans each rank's reads with {', '.join(_PLANNER_CALLS)} only, and "
            "loads values that are not tensors under its allow-list (torch.load(weights_only=True)); "
            "pass a planner that customises those methods only, or planner=None"
        )


class _OptimizerStateOnLoad:
    """A tracked optimizer (or its FSDP wrapper) for restore: before its state is read, the
    optimizer's lazily created state is made to exist (torchtnt's ``init_optim_state``) so the
    snapshot's values load into it. Only when the snapshot is loaded, and without changing the
    parameters: the initialising zero-gradient step would move them under weight decay."""

    def __init__(self, stateful: Any, optimizer: Any) -> None:
        self._stateful = stateful
        self._optimizer = optimizer
        self.__wrapped__ = stateful  # what restore errors are attributed to

    def state_dict(self) -> Any:
        if not self._optimizer.state:
            import torch
            from torchtnt.utils.optimizer import init_optim_state

            params = [p for group in self._optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                kept = [p.detach().clone() for p in params]
                init_optim_state(self._optimizer)
                for param, value in zip(params, kept, strict=True):
                    param.copy_(value)
        return self._stateful.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self._stateful.load_state_dict(state_dict)


def restore_state(
    unit: AppStateMixin, train_dataloader: Optional[Any], options: Options
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(app state to load, keys the snapshot may lack) for a restore of ``unit``."""
    app_state = unit_state(unit)
    check_collisions(app_state.keys())
    for key, optimizer in unit.tracked_optimizers().items():
        if key in app_state:
            app_state[key] = _OptimizerStateOnLoad(app_state[key], optimizer)
    skipped: list[str] = []
    if not options.restore_train_progress:
        skipped.append(TRAIN_PROGRESS_KEY)
    if not options.restore_eval_progress:
        skipped.append(EVAL_PROGRESS_KEY)
    if not options.restore_optimizers:
        skipped += unit.tracked_optimizers().keys()
    if not options.restore_lr_schedulers:
        skipped += unit.tracked_lr_schedulers().keys()
    for key in skipped:  # not loaded: the unit keeps its own value
        app_state.pop(key, None)
    optional: tuple[str, ...] = (EVAL_PROGRESS_KEY,)
    # A loader without state_dict/load_state_dict is not restored; once the snapshot is chosen,
    # Options.warn_replay says whether that replays batches (only from a mid-epoch snapshot).
    if train_dataloader is not None and is_stateful(train_dataloader):
        app_state[TRAIN_DATALOADER_KEY] = train_dataloader
        optional += (TRAIN_DATALOADER_KEY,)
    return app_state, optional
