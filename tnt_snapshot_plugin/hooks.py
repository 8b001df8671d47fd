"""The pluggy seam: one plugin manager per saver, built-in adapters and third-party plugins alike.

Nothing is built or loaded at import time, and nothing is kept between managers. Each saver (and
each standalone restore) gets a manager of its own from :func:`new_plugin_manager`, as pytest
builds one per configuration: the hook specifications, then every plugin of the
``tnt_snapshot_plugin`` entry-point group, read from the installed distributions by that manager
(the built-in adapters are two of them; a plugin describing an adapter whose framework is not
installed is blocked, not registered). A plugin registered on one saver's manager is never seen by
another saver or by a restore that was not given that manager.

Registration is checked at once (:meth:`PluginManager.register`): an unknown
``tnt_snapshot_plugin_*`` name, a hook method without the ``@hookimpl`` marker or a parameter the
hook does not have raises :class:`~tnt_snapshot_plugin.errors.ConfigError` naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pluggy

from tnt_snapshot_plugin import hookspecs
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.hookspecs import PROJECT_NAME

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Every hook name starts with this; any other attribute of a plugin is not a hook.
HOOK_PREFIX = f"{PROJECT_NAME}_"


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter plugin tells about itself through ``tnt_snapshot_plugin_adapters``.

    Objects are named by dotted path (``"package.module:attr"``) and imported only when used, so
    listing adapters never imports a framework.
    """

    name: str
    #: the module the framework imports as, e.g. ``"torchtnt"``
    framework: str
    #: the saver callback class
    saver: str
    #: ``demo(dirpath: str, *, epochs: int, steps_per_epoch: int, interrupt_at: int) -> dict``
    demo: Optional[str] = None
    #: how to install the framework, for the error when it is missing (None: ``install <framework>``)
    install: Optional[str] = None

    @property
    def installed(self) -> bool:
        """Whether the framework can be imported (found without importing it)."""
        return importlib.util.find_spec(self.framework) is not None

    def load_saver(self) -> type:
        return self._load(self.saver)

    def load_demo(self) -> Callable[..., dict]:
        if self.demo is None:
            raise LookupError(f"adapter {self.name!r} has no demo")
        return self._load(self.demo)

    def _load(self, dotted: str) -> Any:
        module_name, _, attr = dotted.partition(":")
        if not self.installed:
            raise ImportError(
                f"{dotted} needs {self.framework}, which is not installed: "
                f"{self.install or f'install {self.framework}'}"
            )
        module = importlib.import_module(module_name)
        return getattr(module, attr)


class PluginManager(pluggy.PluginManager):
    """The hooks of one saver (or one restore): pluggy's manager with the project's hook
    specifications, whose :meth:`register` checks a plugin against them at once and whose
    registrations and removals are told to the saver (:meth:`on_change`), so what is implemented
    is read again after each."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self._listeners: list[weakref.WeakMethod] = []

    def register(self, plugin: Any, name: Optional[str] = None) -> Optional[str]:
        """Register ``plugin`` (an object or module with ``@hookimpl`` methods) and return its
        name; None if that name is blocked. Raises ConfigError, registering nothing, when a
        ``tnt_snapshot_plugin_*`` attribute is not a known hook, is not marked with ``@hookimpl``,
        or takes a parameter its hook does not have."""
        registered = _register_checked(self, super().register, super().unregister, plugin, name)
        self._changed()
        return registered

    def unregister(self, plugin: Any = None, name: Optional[str] = None) -> Any:
        """Remove a plugin (by object or name); returns it, as pluggy does."""
        removed = super().unregister(plugin, name)
        self._changed()
        return removed

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call the bound method ``listener()`` after each registration and removal (held weakly:
        a saver that is gone is not kept alive by its manager)."""
        self._listeners.append(weakref.WeakMethod(listener))  # type: ignore[arg-type]

    def _changed(self) -> None:
        alive = []
        for ref in self._listeners:
            listener = ref()
            if listener is not None:
                alive.append(ref)
                listener()
        self._listeners = alive


def check_plugin(pm: pluggy.PluginManager, plugin: Any, name: Optional[str] = None) -> Optional[str]:
    """Register ``plugin`` on ``pm`` (any pluggy manager with the project's hook specs), checked as
    :meth:`PluginManager.register` checks it; returns its name (None: the name is blocked)."""
    if isinstance(pm, PluginManager):
        return pm.register(plugin, name)
    return _register_checked(pm, pm.register, pm.unregister, plugin, name)


def _register_checked(
    pm: pluggy.PluginManager,
    register: Callable[[Any, Optional[str]], Optional[str]],
    unregister: Callable[[Any], Any],
    plugin: Any,
    name: Optional[str],
) -> Optional[str]:
    _check_names(pm, plugin)
    try:
        registered = register(plugin, name)
    except pluggy.PluginValidationError as exc:
        raise ConfigError(f"plugin {plugin!r} does not match the hook specifications: {exc}") from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        unregister(plugin)
        raise ConfigError(f"{exc}; the hooks are listed in tnt_snapshot_plugin.hookspecs") from exc
    return registered


def _check_names(pm: pluggy.PluginManager, plugin: Any) -> None:
    """ConfigError naming the first ``tnt_snapshot_plugin_*`` attribute of ``plugin`` that is
    not a known hook or is not marked with ``@hookimpl`` (pluggy would never call it)."""
    known = {name for name in dir(hookspecs) if name.startswith(HOOK_PREFIX)}
    for attr in dir(plugin):
        if not attr.startswith(HOOK_PREFIX) or not callable(getattr(plugin, attr, None)):
            continue
        opts = pm.parse_hookimpl_opts(plugin, attr)
        hook = (opts.get("specname") if opts else None) or attr
        if hook not in known:
            raise ConfigError(
                f"unknown hook {hook!r} in plugin {plugin!r}; the hooks are "
                f"{', '.join(sorted(known))} (tnt_snapshot_plugin.hookspecs)"
            )
        if opts is None:
            raise ConfigError(
                f"{attr} in plugin {plugin!r} is not marked with @tnt_snapshot_plugin.hookimpl, "
                "so it would never be called; decorate it"
            )


def new_plugin_manager(*, load_entrypoints: bool = True, blocked: tuple[str, ...] = ()) -> PluginManager:
    """A new manager for one saver or restore: the hook specs and, unless ``load_entrypoints`` is
    False, every plugin of the ``tnt_snapshot_plugin`` entry-point group not named in ``blocked``.

    The group is read from the installed distributions' metadata by each manager (a few
    milliseconds; nothing is kept in the process). A plugin describing an adapter
    (``tnt_snapshot_plugin_adapters``) whose framework is not installed is blocked: its module
    is imported, so an entry point names a module that imports no framework itself."""
    pm = PluginManager()
    for name in blocked:
        pm.set_blocked(name)
    if load_entrypoints:
        for ep in importlib.metadata.entry_points(group=PROJECT_NAME):
            if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
                continue
            plugin = ep.load()
            if _framework_missing(pm, plugin):
                pm.set_blocked(ep.name)
                continue
            pm.register(plugin, name=ep.name)
    pm.check_pending()
    return pm


def _framework_missing(pm: pluggy.PluginManager, plugin: Any) -> bool:
    """Whether ``plugin`` describes an adapter whose framework is not installed (its
    ``tnt_snapshot_plugin_adapters`` hook, asked before it is registered)."""
    describe = getattr(plugin, "tnt_snapshot_plugin_adapters", None)
    if describe is None or pm.parse_hookimpl_opts(plugin, "tnt_snapshot_plugin_adapters") is None:
        return False
    try:
        info = describe()
    except Exception:  # a description that fails is reported where adapters are listed
        return False
    return isinstance(info, AdapterInfo) and not info.installed


def get_plugin_manager() -> PluginManager:
    """A new manager with the entry-point plugins loaded (:func:`new_plugin_manager`); each call
    builds one: there is no process-wide manager."""
    return new_plugin_manager()


def adapters(pm: Optional[pluggy.PluginManager] = None) -> dict[str, AdapterInfo]:
    """The adapters the registered plugins provide, by name."""
    pm = pm or new_plugin_manager()
    found: dict[str, AdapterInfo] = {}
    for info in pm.hook.tnt_snapshot_plugin_adapters():
        if info is None:
            continue
        if info.name in found:
            raise ValueError(f"two plugins provide an adapter named {info.name!r}")
        found[info.name] = info
    return found


def extra_state_sources(pm: pluggy.PluginManager, event: str, epoch: int, step: int) -> list[tuple[str, dict[str, Any]]]:
    """What the plugins' ``tnt_snapshot_plugin_extra_state`` hooks contribute, as (source, entries)
    pairs for :func:`tnt_snapshot_plugin.app_state.check_collisions`: the one place both the
    saver (before each snapshot) and restore (``event="restore"``, -1, -1) gather it."""
    results = pm.hook.tnt_snapshot_plugin_extra_state(event=event, epoch=epoch, step=step)
    return [(f"tnt_snapshot_plugin_extra_state result #{i}", dict(r)) for i, r in enumerate(results) if r]


def implemented(pm: pluggy.PluginManager, hook_name: str) -> bool:
    """Whether any registered plugin implements ``hook_name`` (read off the hot path)."""
    caller: Any = getattr(pm.hook, hook_name)
    return bool(caller.get_hookimpls())
