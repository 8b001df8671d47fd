"""Which store serves a URL scheme: the registry behind :func:`~tnt_snapshot_plugin.stores.open_store`.

A scheme (``file``, ``s3``, ``gs``, ...) maps to an *opener*: a callable
``opener(url, storage_options, timeout_s) -> Store``, named by a dotted path
(``"package.module:attribute"``) and imported only when a URL of that scheme is first opened.
Schemes come from three places, tried in this order:

1. :func:`register_store` calls, the built-in stores among them (:data:`BUILTIN_STORES`: local
   disk for paths without a scheme and ``file://``, S3 for ``s3://``), registered the same way;
2. the entry-point group ``tnt_snapshot_plugin.stores`` of installed distributions, read at each
   open of a scheme that is not registered: a package adds a store by declaring, in its setup.cfg::

       [options.entry_points]
       tnt_snapshot_plugin.stores =
           myscheme = my_package.my_store:open_my_store

3. any other scheme that fsspec knows (``gs``, ``az``, ``memory``, ...): the generic fsspec store
   (:mod:`.fsspec`), with fsspec imported only then.

A registration that would give a registered scheme another opener is refused (ConfigError), as
is an entry point that would; an unknown scheme is a ConfigError naming it and what to install.

The registrations (:func:`register_store`) are the one table this module keeps: like fsspec's
``register_implementation``, a registration is made for the process on purpose. Nothing read from
the installed distributions is kept: the entry points are read again by each open that needs them.
"""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any, Callable, Optional, Union

from tnt_snapshot_plugin.errors import ConfigError

#: The entry-point group stores are declared in (the project's name, then ``.stores``).
ENTRY_POINT_GROUP = "tnt_snapshot_plugin.stores"
#: The stores that come with the plugin, registered like any other (setup.cfg declares the same).
BUILTIN_STORES = (
    ("file", "tnt_snapshot_plugin.stores.local:open_local"),
    ("s3", "tnt_snapshot_plugin.stores.s3:open_s3"),
)

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")  # RFC 3986, lower case

Opener = Callable[[str, Optional[dict[str, Any]], Optional[float]], Any]

_lock = threading.RLock()
#: scheme -> dotted path or opener: the built-in stores and what register_store was given
_targets: dict[str, Union[str, Opener]] = {}


def register_store(scheme: str, target: Union[str, Opener], *, clobber: bool = False) -> None:
    """Serve URLs ``SCHEME://...`` with ``target``: an opener or its dotted path
    (``"module:attribute"``, imported when such a URL is first opened). Registering the same
    target again is harmless; another target for a registered scheme is refused unless
    ``clobber``."""
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise ConfigError(f"a store scheme is a URL scheme such as 's3', got {scheme!r}")
    if isinstance(target, str) and ":" not in target:
        raise ConfigError(f"the store for {scheme}:// must be named 'module:attribute', got {target!r}")
    with _lock:
        _builtins()
        current = _targets.get(scheme)
        if current is not None and current != target and not clobber:
            raise ConfigError(
                f"the URL scheme {scheme!r} is already served by {_name(current)}; refusing to "
                f"replace it with {_name(target)} (unregister_store({scheme!r}) first, or pass "
                "clobber=True)"
            )
        _targets[scheme] = target


def unregister_store(scheme: str) -> None:
    """Stop serving ``scheme`` (an entry point or fsspec may still serve it afterwards)."""
    with _lock:
        _targets.pop(scheme, None)


def registered_schemes() -> dict[str, str]:
    """Scheme -> the dotted path (or name) of its opener, entry points included."""
    with _lock:
        _builtins()
        targets = {**_declared(), **_targets}
    return {scheme: _name(target) for scheme, target in sorted(targets.items())}


def opener_for(scheme: str, url: str = "") -> Opener:
    """The opener of ``scheme``: registered, declared by an entry point, or fsspec's (``url``:
    the URL being opened, for the error if none serves it)."""
    with _lock:
        _builtins()
        target = _targets.get(scheme)
        if target is None:
            target = _declared().get(scheme)
    if target is None:
        from tnt_snapshot_plugin.stores.fsspec import fsspec_opener

        target = fsspec_opener(scheme, url or f"{scheme}://")
    return _load(scheme, target)


def _builtins() -> None:
    for scheme, target in BUILTIN_STORES:
        _targets.setdefault(scheme, target)


def _declared() -> dict[str, str]:
    """The stores installed distributions declare (scheme -> dotted path), read now; a
    ConfigError for one that would serve a registered scheme with another opener."""
    from importlib.metadata import entry_points

    declared: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        current = _targets.get(ep.name)
        if current is not None and current != ep.value:
            dist = getattr(getattr(ep, "dist", None), "name", "an installed distribution")
            raise ConfigError(
                f"{dist} declares the store {ep.value} for the URL scheme {ep.name!r} "
                f"(entry-point group {ENTRY_POINT_GROUP}), which {_name(current)} already "
                "serves; uninstall one of them"
            )
        declared[ep.name] = ep.value
    return declared


def _load(scheme: str, target: Union[str, Opener]) -> Opener:
    if not isinstance(target, str):
        return target
    module_name, _, attribute = target.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"the store for {scheme}:// ({target}) cannot be loaded ({type(exc).__name__}: {exc}); "
            "reinstall the package that declares it"
        ) from exc
    if not callable(value):
        raise ConfigError(f"the store for {scheme}:// ({target}) is not callable")
    return value  # type: ignore[no-any-return]


def _name(target: Union[str, Opener]) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


__all__ = [
    "BUILTIN_STORES",
    "ENTRY_POINT_GROUP",
    "opener_for",
    "register_store",
    "registered_schemes",
    "unregister_store",
]
