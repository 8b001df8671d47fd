"""torchtitan's checkpoints (``step-N`` directories of ``dcp.save``) restored into a torchtnt unit.

torchtitan saves its model's parameters at the top level of the checkpoint, by their canonical
names (older versions: under ``model``), beside ``optimizer`` (flattened: ``state.<fqn>.<name>``
and ``param_groups.<fqn>.<option>``), ``lr_scheduler``, ``dataloader`` (one entry per
data-parallel rank) and ``train_state`` (``step``, ``ntokens_seen``). A torchtnt unit names its
state by its attributes instead; :class:`TitanRestore` reads the checkpoint with the plugin's
restore (every entry as a plain state dict: the allow-list, the checks of the metadata and the
records) and maps what has a counterpart onto the unit:

* the parameters and buffers -> the unit's one tracked module (``set_model_state_dict``, which
  knows DDP's and FSDP's names);
* ``optimizer`` -> its one tracked optimizer (``set_optimizer_state_dict``, flattened);
* ``lr_scheduler`` -> its one tracked LR scheduler (``last_epoch``; its learning rates are the
  optimizer's restored ones);
* ``train_state.step`` -> ``train_progress.num_steps_completed`` (torchtitan counts no epochs:
  epochs completed and steps in the epoch are 0).

``dataloader`` has no counterpart (torchtitan's loaders keep their own state per data-parallel
rank), nor has any other entry of the unit (its RNG state, other stateful attributes): those are
named in a PartialRestoreWarning and keep their values.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from torchtnt.framework.unit import AppStateMixin

from tnt_snapshot_plugin.errors import PartialRestoreWarning, StateMismatchError
from tnt_snapshot_plugin.naming import TORCHTITAN, SnapshotName
from tnt_snapshot_plugin.restoring import RestoreRequest
from tnt_snapshot_plugin.stores import split_snapshot_path

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state",
)
#: torchtitan's entries that are not the model's parameters.
_AUX = frozenset({OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE})


def is_titan(path: str) -> bool:
    """Whether ``path`` names a torchtitan checkpoint directory (``.../step-N``)."""
    if not path:
        return False
    parsed = SnapshotName.parse_listed(split_snapshot_path(path.rstrip("/"))[1])
    return parsed is not None and parsed.origin == TORCHTITAN


class TitanRestore:
    """One restore of a torchtitan checkpoint into ``unit``: :attr:`request` reads every entry
    of it into :attr:`rest`; :meth:`apply` then loads what maps onto the unit.

    ``skip``: the unit's entries that RestoreOptions leaves out (their keys: ``train_progress``,
    the optimizers', the LR schedulers'); ``strict``: the model's names must match exactly."""

    def __init__(self, unit: AppStateMixin, base: RestoreRequest, skip: set[str], strict: bool) -> None:
        self.unit = unit
        self.skip = skip
        self.strict = strict
        self.rest: dict[str, Any] = {}
        # what RestoreOptions leaves out is not read (an older train_state the allow-list refuses)
        unread = [TRAIN_STATE] if "train_progress" in skip else []
        if not any(k not in skip for k in unit.tracked_optimizers()):
            unread.append(OPTIMIZER)
        if not any(k not in skip for k in unit.tracked_lr_schedulers()):
            unread.append(LR_SCHEDULER)
        self.request = base.replace(app_state={}, optional_keys=(), rest=self.rest, unread_keys=tuple(unread))

    def apply(self, path: str, rank: int) -> list[str]:
        """Load the entries read from checkpoint ``path`` into the unit; the unit's keys loaded.
        StateMismatchError where the checkpoint does not fit the unit; a PartialRestoreWarning
        (rank 0) naming what was not restored."""
        rest, unit = self.rest, self.unit
        modules = unit.tracked_modules()
        optimizers = unit.tracked_optimizers()
        schedulers = unit.tracked_lr_schedulers()
        loaded: list[str] = []
        model_state = rest[MODEL] if isinstance(rest.get(MODEL), dict) else {k: v for k, v in rest.items() if k not in _AUX}
        # a module without parameters or buffers (a loss function) holds nothing to restore
        module_key, module = self._one("module", {k: m for k, m in modules.items() if m.state_dict()}, path)
        if model_state:
            self._load_model(module, model_state, path, module_key)
            loaded.append(module_key)
        elif module is not None:
            raise StateMismatchError(
                f"torchtitan checkpoint {path} holds no model parameters (it holds {sorted(rest)}); "
                "restore a checkpoint saved with the model"
            )
        opt_key, optimizer = self._one("optimizer", {k: v for k, v in optimizers.items() if k not in self.skip}, path)
        if optimizer is not None and OPTIMIZER in rest and self._load_optimizer(module, optimizer, rest[OPTIMIZER], path):
            loaded.append(opt_key)
        sched_key, scheduler = self._one("LR scheduler", {k: v for k, v in schedulers.items() if k not in self.skip}, path)
        if scheduler is not None and LR_SCHEDULER in rest:
            self._load_scheduler(scheduler, rest[LR_SCHEDULER], path)
            loaded.append(sched_key)
        progress = getattr(unit, "train_progress", None)
        if progress is not None and "train_progress" not in self.skip and TRAIN_STATE in rest:
            progress.load_state_dict(_progress(progress.state_dict(), rest[TRAIN_STATE], path))
            loaded.append("train_progress")
        if rank == 0:
            self._warn_unmapped(path, loaded)
        return loaded

    # -- the mapping ----------------------------------------------------------------------------

    @staticmethod
    def _one(kind: str, tracked: dict[str, Any], path: str) -> tuple[str, Any]:
        """(key, object) of the unit's one tracked ``kind``, ("", None) when it tracks none;
        StateMismatchError when it tracks several (torchtitan's checkpoint holds one)."""
        if not tracked:
            return "", None
        if len(tracked) > 1:
            raise StateMismatchError(
                f"torchtitan checkpoint {path} holds one {kind}'s state, and the unit tracks "
                f"{len(tracked)}: {sorted(tracked)}; restore it into a unit with one {kind}, or "
                "read it by path into a dict of your own (tnt_snapshot_plugin.restore)"
            )
        [(key, value)] = tracked.items()
        return key, value

    def _load_model(self, module: Any, state: dict[str, Any], path: str, key: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if module is None:
            raise StateMismatchError(
                f"torchtitan checkpoint {path} holds a model, and the unit tracks no module; "
                "assign the model as an attribute of the unit (self.model = ...)"
            )
        try:
            # full_state_dict: the values read are whole tensors, which a sharded (FSDP2) module
            # takes only this way; a plain module takes them alike
            set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=self.strict))
        except (RuntimeError, KeyError, ValueError) as exc:
            raise StateMismatchError(
                f"cannot restore torchtitan checkpoint {path} into the unit's {key}: "
                f"{' '.join(str(exc).split())}; restore into the model that was saved, or pass "
                "strict=False to load the parameters that match"
            ) from exc

    def _load_optimizer(self, module: Any, optimizer: Any, state: dict[str, Any], path: str) -> bool:
        """Whether the optimizer's state was loaded (it needs the model and a dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if module is None or not isinstance(state, dict):
            return False
        try:
            set_optimizer_state_dict(
                module, optimizer, state,
                options=StateDictOptions(flatten_optimizer_state_dict=True, strict=self.strict),
            )
        except (RuntimeError, KeyError, ValueError) as exc:
            raise StateMismatchError(
                f"cannot restore torchtitan checkpoint {path}'s optimizer into the unit's: "
                f"{' '.join(str(exc).split())}; restore into the optimizer that was saved, or "
                "pass RestoreOptions(restore_optimizers=False)"
            ) from exc
        return True

    @staticmethod
    def _load_scheduler(scheduler: Any, state: Any, path: str) -> None:
        last_epoch = state.get("last_epoch") if isinstance(state, dict) else None
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int):
            raise StateMismatchError(
                f"torchtitan checkpoint {path}'s lr_scheduler holds no last_epoch (it holds "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}); pass "
                "RestoreOptions(restore_lr_schedulers=False)"
            )
        merged = dict(scheduler.state_dict())
        merged.update({k: v for k, v in state.items() if k in merged})
        merged["_step_count"] = last_epoch + 1
        scheduler.load_state_dict(merged)
        # the learning rates in force: the optimizer's, restored with it
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    def _warn_unmapped(self, path: str, loaded: list[str]) -> None:
        unit_keys = set(self.unit.app_state()) - set(loaded) - self.skip
        lost = [DATALOADER] if DATALOADER in self.rest else []
        if not unit_keys and not lost:
            return
        parts = []
        if unit_keys:
            parts.append(f"the unit's entries without a counterpart keep their values ({', '.join(sorted(unit_keys))})")
        if lost:
            parts.append("its dataloader state (torchtitan's, per data-parallel rank) is not restored")
        warnings.warn(
            f"torchtitan checkpoint {path} restored what maps onto the unit ({', '.join(loaded) or 'nothing'}); "
            + "; ".join(parts) + "; the RNG state is not restored (torchtitan saves none)",
            PartialRestoreWarning,
            stacklevel=4,
        )


def _progress(current: dict[str, Any], train_state: Any, path: str) -> dict[str, Any]:
    """torchtnt's progress state dict with torchtitan's ``train_state.step`` in it."""
    step = train_state.get("step") if isinstance(train_state, dict) else None
    step = _integer(step)
    if step is None or step < 0:
        raise StateMismatchError(
            f"torchtitan checkpoint {path}'s train_state holds no step count (it holds "
            f"{sorted(train_state) if isinstance(train_state, dict) else type(train_state).__name__}); "
            "pass RestoreOptions(restore_train_progress=False)"
        )
    out = dict(current)
    out.update(num_steps_completed=step, num_epochs_completed=0, num_steps_completed_in_epoch=0)
    return out


def _integer(value: Any) -> Optional[int]:
    """``value`` as an int: an int, or a one-element integer tensor (older torchtitan)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    return None
