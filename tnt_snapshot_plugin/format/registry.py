"""Which formats the plugin writes and reads: the built-in ones (torchsnapshot's, the default, and
DCP's, ``"dcp"``), and any other registered with :func:`register_format` (a format of one's own, a test's).

A snapshot's format is the one the plugin's index records (``"snapshot_format"``; an index
without it is torchsnapshot's), or, for a snapshot another tool wrote, the format whose metadata
file it holds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional, Union

from tnt_snapshot_plugin.errors import ConfigError

if TYPE_CHECKING:
    from tnt_snapshot_plugin.format.base import Format
    from tnt_snapshot_plugin.stores.base import Store

#: The format a snapshot has when nothing says otherwise.
DEFAULT = "torchsnapshot"

#: The built-in formats, by name: (module, attribute), imported on first use.
_BUILTIN: dict[str, tuple[str, str]] = {
    "torchsnapshot": ("tnt_snapshot_plugin.format.torchsnapshot", "FORMAT"),
    "dcp": ("tnt_snapshot_plugin.format.dcp", "FORMAT"),
}

#: The built-in formats' metadata files (each format's ``metadata_file`` is its entry here), known
#: without importing the formats: listing a dirpath imports nothing heavy.
BUILTIN_METADATA = {"torchsnapshot": ".snapshot_metadata", "dcp": ".metadata"}

#: Formats registered by name (:func:`register_format`), beside the built-in ones.
_registered: dict[str, Format] = {}


def register_format(fmt: Format, *, replace: bool = False) -> None:
    """Make ``fmt`` (an object with the :class:`~tnt_snapshot_plugin.format.base.Format` protocol)
    available by its name to savers (``SnapshotConfig(format=...)``), restore, verify and the
    command line. ConfigError if the name is taken, unless ``replace``."""
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name or not isinstance(getattr(fmt, "metadata_file", None), str):
        raise ConfigError(f"{fmt!r} is not a format: it needs a name and a metadata_file (tnt_snapshot_plugin.format.base.Format)")
    if not replace and (name in _BUILTIN or name in _registered):
        raise ConfigError(f"a format named {name!r} is registered already")
    _registered[name] = fmt


def unregister_format(name: str) -> None:
    """Forget the format registered as ``name`` (the built-in ones stay)."""
    _registered.pop(name, None)


def _builtin(name: str) -> Format:
    module, attr = _BUILTIN[name]
    fmt: Format = getattr(importlib.import_module(module), attr)
    return fmt


def get_format(spec: Union[str, Format, Any]) -> Format:
    """The format ``spec`` names (or ``spec`` itself, a format object); ConfigError if unknown."""
    if not isinstance(spec, str):
        if isinstance(getattr(spec, "name", None), str) and isinstance(getattr(spec, "metadata_file", None), str):
            return spec  # type: ignore[no-any-return]
        raise ConfigError(f"format must be a format's name ({', '.join(names())}) or a Format, got {spec!r}")
    if spec in _registered:
        return _registered[spec]
    if spec in _BUILTIN:
        return _builtin(spec)
    raise ConfigError(f"format must be one of {', '.join(repr(n) for n in names())}, got {spec!r}")


def names() -> list[str]:
    return [*_BUILTIN, *(n for n in _registered if n not in _BUILTIN)]


def formats() -> list[Format]:
    """Every format known, the built-in ones first."""
    return [get_format(name) for name in names()]


def metadata_files() -> list[str]:
    """The metadata file of every format known (a snapshot holding one is complete)."""
    found: list[str] = []
    for name in names():
        metadata = BUILTIN_METADATA.get(name) if name not in _registered else _registered[name].metadata_file
        if metadata is None:
            metadata = get_format(name).metadata_file
        if metadata not in found:
            found.append(metadata)
    return found




def format_of(store: Store, name: str, index: Optional[dict[str, Any]]) -> Optional[Format]:
    """The format of snapshot ``name``: its index's ``"snapshot_format"`` (an index without one is
    torchsnapshot's), else the first format whose metadata file it holds; None if none."""
    if isinstance(index, dict):
        recorded = index.get("snapshot_format", DEFAULT)
        if isinstance(recorded, str) and recorded in names():
            return get_format(recorded)
        return None
    for fmt_name in names():
        metadata = BUILTIN_METADATA.get(fmt_name) if fmt_name not in _registered else _registered[fmt_name].metadata_file
        if metadata is not None and store.has_file(name, metadata):
            return get_format(fmt_name)
    return None
