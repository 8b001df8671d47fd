"""The hooks one saver calls, through the plugin manager it owns: registering plugins on that
saver, naming a snapshot, the extra state plugins add, whether a plugin asks to decide each
snapshot, and the figures of each committed snapshot sent to a framework's logger."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import pluggy

from tnt_snapshot_plugin.app_state import check_collisions
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.hooks import PluginManager, check_plugin, extra_state_sources
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import Moment, PluginDecision


class SaverHooks:
    """One saver's plugin manager and the calls the saver makes through it.

    ``on_change()`` is called after each registration and removal (the saver's step gate depends
    on whether a plugin implements ``tnt_snapshot_plugin_should_snapshot``)."""

    def __init__(self, manager: pluggy.PluginManager, on_change: Callable[[], None]) -> None:
        #: the pluggy manager: this saver's own unless the adapter was given one
        self.manager = manager
        self._decision = PluginDecision(manager)
        #: whether a plugin implements ``tnt_snapshot_plugin_should_snapshot`` (asked at every
        #: step end while one does)
        self.asks_should = self._decision.active
        self._on_change = on_change
        self._metrics: Optional[Any] = None
        if isinstance(manager, PluginManager):
            manager.on_change(self._changed)

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register ``plugin`` on this saver only (its ``@hookimpl`` methods apply from the next
        hook on) and return its name. Raises ConfigError, registering nothing, when a
        ``tnt_snapshot_plugin_*`` attribute is not a known hook (a misspelling), lacks the
        ``@hookimpl`` marker, or takes a parameter its hook does not have."""
        if isinstance(self.manager, PluginManager):
            return self.manager.register(plugin, name)  # checked; tells _changed
        registered = check_plugin(self.manager, plugin, name)
        self._changed()
        return registered

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver; its hooks are not called from then on."""
        self.manager.unregister(plugin)
        if not isinstance(self.manager, PluginManager):
            self._changed()

    def _changed(self) -> None:
        self.asks_should = self._decision.active
        self._on_change()

    def decide(self, moment: Moment, default: bool) -> bool:
        """The plugins' word on a snapshot at ``moment`` (``default``: the policies' decision)."""
        return self._decision.decide(moment, default) if self.asks_should else default

    def name(
        self, epoch: int, step: int, eval_step: Optional[int] = None, metric: Optional[tuple[str, float]] = None
    ) -> SnapshotName:
        """The snapshot's name: the default one, or a ``snapshot_name`` hook's (same progress)."""
        try:
            default = SnapshotName.of(epoch, step, eval_step, metric)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the monitored metric {metric!r} cannot name a snapshot: {exc}") from exc
        chosen = self.manager.hook.tnt_snapshot_plugin_snapshot_name(epoch=epoch, step=step, default=default.text)
        if chosen is None or chosen == default.text:
            return default
        parsed = SnapshotName.parse(chosen) if isinstance(chosen, str) else None
        if (
            parsed is None
            or parsed.phase_aware
            or (parsed.epoch, parsed.step, parsed.eval_step) != (epoch, step, eval_step)
        ):
            raise ConfigError(
                f"a tnt_snapshot_plugin_snapshot_name hook returned {chosen!r}; it must be "
                f"{default.text!r}, optionally followed by '_metric=value', so restore can find it"
            )
        return parsed

    def extra_state_sources(self, event: str, epoch: int, step: int) -> list[tuple[str, dict[str, Any]]]:
        return extra_state_sources(self.manager, event, epoch, step)

    def extra_state(self, event: str, epoch: int, step: int, unit_keys: Iterable[str]) -> dict[str, Any]:
        """The plugins' extra entries for a snapshot, checked against ``unit_keys`` and each other."""
        sources = self.extra_state_sources(event, epoch, step)
        check_collisions(unit_keys, sources)
        merged: dict[str, Any] = {}
        for _source, entries in sources:
            merged.update(entries)
        return merged

    def committed(self, path: str, epoch: int, step: int, record: Any) -> None:
        self.manager.hook.tnt_snapshot_plugin_snapshot_committed(path=path, epoch=epoch, step=step, record=record)

    def report_metrics(self, sink: Optional[Callable[[dict[str, float], int], None]], reporter: Any = None) -> None:
        """Register ``reporter`` (a :class:`~tnt_snapshot_plugin.metrics.MetricsReporter` of
        ``sink``), replacing the last one; None for ``sink`` stops reporting."""
        if self._metrics is not None:
            with contextlib.suppress(ValueError):
                self.manager.unregister(self._metrics)
            self._metrics = None
        if sink is not None:
            self._metrics = reporter
            self.manager.register(reporter)
