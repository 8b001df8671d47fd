"""The plugin manager: built-in adapters and third-party plugins load the same way.

Nothing is built or loaded at import time: :func:`get_plugin_manager` builds the shared manager on
first use. Adapters whose framework is not installed are blocked before entry points load, so a
missing optional dependency never breaks loading.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pluggy

from . import hookspecs
from .plugins_name import PROJECT_NAME

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Built-in adapters (entry-point name -> the module their framework imports as).
BUILTIN_ADAPTER_FRAMEWORKS: dict[str, str] = {
    "torchtnt": "torchtnt",
    "lightning": "pytorch_lightning",
}


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

    def load_saver(self) -> type:
        return _load(self.saver, self.framework)

    def load_demo(self) -> Callable[..., dict]:
        if self.demo is None:
            raise LookupError(f"adapter {self.name!r} has no demo")
        return _load(self.demo, self.framework)


def _load(dotted: str, framework: str) -> Any:
    module_name, _, attr = dotted.partition(":")
    if importlib.util.find_spec(framework) is None:
        raise ImportError(
            f"{dotted} needs {framework}, which is not installed: "
            f"pip install 'tnt-snapshot-plugin[{framework if framework == 'torchtnt' else 'lightning'}]'"
        )
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def new_plugin_manager(*, load_entrypoints: bool = True, blocked: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """A fresh plugin manager with the hook specs, optionally loading the entry-point group."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    if load_entrypoints:
        for ep in importlib.metadata.entry_points(group=PROJECT_NAME):
            framework = BUILTIN_ADAPTER_FRAMEWORKS.get(ep.name)
            if framework is not None and importlib.util.find_spec(framework) is None:
                pm.set_blocked(ep.name)
        pm.load_setuptools_entrypoints(PROJECT_NAME)
    pm.check_pending()
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built (and entry points loaded) on first call."""
    return new_plugin_manager()


def adapters(pm: Optional[pluggy.PluginManager] = None) -> dict[str, AdapterInfo]:
    """The adapters the registered plugins provide, by name."""
    pm = pm or get_plugin_manager()
    found: dict[str, AdapterInfo] = {}
    for info in pm.hook.tnt_snapshot_plugin_adapters():
        if info is None:
            continue
        if info.name in found:
            raise ValueError(f"two plugins provide an adapter named {info.name!r}")
        found[info.name] = info
    return found


def implemented(pm: pluggy.PluginManager, hook_name: str) -> bool:
    """Whether any registered plugin implements ``hook_name`` (read once, off the hot path)."""
    caller: Any = getattr(pm.hook, hook_name)
    return bool(caller.get_hookimpls())
