"""Hook specifications of tnt_snapshot_plugin.

Implement them with :data:`tnt_snapshot_plugin.hookimpl` in a class or module and either register
it on one saver (``saver.register(obj)``, checked against these specifications at once) or publish
it under the ``tnt_snapshot_plugin`` entry-point group (loaded into every saver's manager). Hooks are always called with keyword arguments;
a hookimpl may accept any subset of the parameters, and its parameters take no defaults.

Under ``torch.distributed`` every hook runs on every rank; a hook whose answer decides what is
written (``should_snapshot``, ``snapshot_name``, ``extra_state``) must answer the same on every rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import pluggy

#: The one project name: pluggy's markers, the plugin manager and the entry-point group.
PROJECT_NAME = "tnt_snapshot_plugin"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def tnt_snapshot_plugin_adapters() -> Any:
    """Describe a framework adapter this plugin provides.

    Called each time :func:`tnt_snapshot_plugin.hooks.adapters` lists them (the demo command uses
    it to find ``--framework`` choices). Call mode: all results are collected.

    :return: a :class:`tnt_snapshot_plugin.hooks.AdapterInfo`, or None.
    """


@hookspec
def tnt_snapshot_plugin_extra_state(event: str, epoch: int, step: int) -> Optional[Mapping[str, Any]]:
    """Contribute extra application-state entries to a snapshot or a restore.

    Called on every rank when a snapshot is about to be taken (``event`` is the adapter event:
    ``"step"``, ``"epoch"``, ``"train_end"``, ``"preemption"``) and before a restore
    (``event="restore"``; ``epoch``/``step`` are -1 then). Call mode: all results are collected and
    merged; a key that collides with the unit's state, the plugin's reserved keys or another
    plugin's raises :class:`~tnt_snapshot_plugin.errors.KeyCollisionError`.

    :param event: why the state is collected.
    :param epoch: epochs completed at this moment.
    :param step: train steps completed across all epochs.
    :return: a mapping of key -> object with ``state_dict()``/``load_state_dict()``, or None.
    """


@hookspec(firstresult=True)
def tnt_snapshot_plugin_should_snapshot(
    event: str, epoch: int, step: int, default: bool
) -> Optional[bool]:
    """Decide whether to take a snapshot now, overriding the configured cadence.

    Called at each train step end (``event="step"``), epoch end (``event="epoch"``) and, in
    adapters that snapshot after eval epochs, eval epoch end (``event="eval_epoch"``), only when
    at least one plugin implements it (so a saver without such a plugin pays nothing per step).
    Call mode: ``firstresult``: the first non-None answer wins; None defers to the next plugin
    and finally to ``default``.

    :param event: ``"step"``, ``"epoch"`` or ``"eval_epoch"``.
    :param epoch: epochs completed.
    :param step: train steps completed across all epochs.
    :param default: what the configured cadence decided.
    """


@hookspec(firstresult=True)
def tnt_snapshot_plugin_snapshot_name(epoch: int, step: int, default: str) -> Optional[str]:
    """Choose the directory name of the snapshot about to be written.

    Called once per snapshot, before anything is written. Call mode: ``firstresult``. The answer
    must parse as a snapshot name with the same epoch and step (``default`` plus an optional
    ``_metric=value`` suffix, say), else the save fails with a ConfigError: restore could not
    find it otherwise.

    :param epoch: epochs completed.
    :param step: train steps completed across all epochs.
    :param default: ``epoch_{epoch}_step_{step}``.
    """


@hookspec
def tnt_snapshot_plugin_snapshot_committed(path: str, epoch: int, step: int, record: Any) -> None:
    """Be told that a snapshot is complete and visible to restore.

    Called on every rank, on the training thread, at the first hook after the snapshot's commit
    (for asynchronous snapshots) or right after it (synchronous ones). Call mode: all
    implementations are called; return values are ignored.

    :param path: the committed snapshot's path (a local path or URL).
    :param epoch: epochs completed when it was taken.
    :param step: train steps completed when it was taken.
    :param record: its :class:`~tnt_snapshot_plugin.saving.jobs.SnapshotRecord`: what it cost
        (``stall_s``, ``durable_s``, ``bytes_written``, ``waited_s``, ``busy_waits``);
        :func:`tnt_snapshot_plugin.metrics.snapshot_metrics` turns it into logger metrics.
    """


@hookspec
def tnt_snapshot_plugin_after_restore(path: str, keys: list[str]) -> None:
    """Be told that a snapshot was restored.

    Called on every rank after all requested entries (and the RNG state) were loaded.
    Call mode: all implementations are called; return values are ignored.

    :param path: the snapshot that was restored.
    :param keys: the application-state keys that were loaded.
    """
