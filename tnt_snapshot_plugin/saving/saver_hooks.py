"""The saver's side of the pluggy seam: registering plugins on one saver, the hooks that name a
snapshot and add extra state, and metrics through the saver's own manager. A part of
:class:`~tnt_snapshot_plugin.saving.saver.Snapshotter`."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

from tnt_snapshot_plugin.app_state import check_collisions
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.hooks import PluginManager, check_plugin, extra_state_sources
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.saving.parts import SaverParts


class SaverPlugins(SaverParts):
    """Plugins registered on one saver, and the hooks the saver calls to name and fill a snapshot."""

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register ``plugin`` on this saver only (its ``@hookimpl`` methods apply from the next
        hook on) and return its name. Raises ConfigError, registering nothing, when a
        ``tnt_snapshot_plugin_*`` attribute is not a known hook (a misspelling), lacks the
        ``@hookimpl`` marker, or takes a parameter its hook does not have."""
        pm = self.plugin_manager
        if isinstance(pm, PluginManager):
            return pm.register(plugin, name)  # checked, and tells _plugins_changed
        registered = check_plugin(pm, plugin, name)
        self._plugins_changed()
        return registered

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered on this saver; its hooks are not called from then on."""
        self.plugin_manager.unregister(plugin)
        if not isinstance(self.plugin_manager, PluginManager):
            self._plugins_changed()

    def _plugins_changed(self) -> None:
        """A plugin came or went: read again which optional hooks are implemented."""
        self._ask_should = self._plugin_decision.active
        self._regate()

    def report_metrics(self, sink: Optional[Callable[[dict[str, float], int], None]]) -> None:
        """Send each committed snapshot's figures (:func:`metrics.snapshot_metrics`) to
        ``sink(metrics, step)`` on rank 0, until training ends; None stops. Adapters pass the
        framework's logger here."""
        from tnt_snapshot_plugin.metrics import MetricsReporter

        if self._metrics is not None:
            with contextlib.suppress(ValueError):
                self.plugin_manager.unregister(self._metrics)
            self._metrics = None
        if sink is not None:
            self._metrics = MetricsReporter(sink, self)
            self.plugin_manager.register(self._metrics)

    def _name(
        self,
        epoch: int,
        step: int,
        eval_step: Optional[int] = None,
        metric: Optional[tuple[str, float]] = None,
    ) -> SnapshotName:
        try:
            default = SnapshotName.of(epoch, step, eval_step, metric)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the monitored metric {metric!r} cannot name a snapshot: {exc}") from exc
        chosen = self.plugin_manager.hook.tnt_snapshot_plugin_snapshot_name(
            epoch=epoch, step=step, default=default.text
        )
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

    def _extra_state_sources(self, event: str, epoch: int, step: int) -> list[tuple[str, dict[str, Any]]]:
        return extra_state_sources(self.plugin_manager, event, epoch, step)

    def _extra_state(self, event: str, epoch: int, step: int, unit_keys: Iterable[str]) -> dict[str, Any]:
        sources = self._extra_state_sources(event, epoch, step)
        check_collisions(unit_keys, sources)
        merged: dict[str, Any] = {}
        for _source, entries in sources:
            merged.update(entries)
        return merged
