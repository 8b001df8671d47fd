"""The app state as DCP sees it, and back (the layout the package docstring describes).

* :func:`walk`: one app-state entry's leaves, split as DCP's ``flatten_state_dict`` splits a state
  dict (dicts by key, lists holding tensors or dicts by index, anything else whole), with the
  dicts whose keys include ints;
* :func:`fqn`: a leaf's fully qualified name (its path joined with dots, as DCP joins them);
* :class:`Layout`: the entries a snapshot holds for each rank, read from DCP's ``planner_data``
  (fully qualified name -> path);
* :func:`assemble`: one entry's state dict rebuilt from its leaves' values, dict keys typed as the
  target's state dict (or the index) has them.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Union

import torch

from tnt_snapshot_plugin.errors import UnrestorableStateError
from tnt_snapshot_plugin.format.torchsnapshot.manifest import MAX_PATH_DEPTH

#: The top-level key of the values every rank restores alike (torchtnt's DCP saver's).
APP_STATE = "app_state"
#: The top-level key of each rank's own values, on several ranks: ``per_rank.<R>.<key>.<...>``.
PER_RANK = "per_rank"

Token = Union[str, int]
#: A path in a state dict: dict keys as str, list indices as int.
Path = tuple[Token, ...]

_INT_TEXT = re.compile(r"-?[0-9]{1,30}\Z")


def fqn(prefix: Path, path: Path) -> str:
    """The fully qualified name of the leaf at ``path`` under ``prefix``, as DCP joins it."""
    return ".".join(map(str, prefix + path))


def _is_dict_container(value: Any) -> bool:
    """Whether a dict is split by key: a ``dict`` or ``OrderedDict`` (not a subclass), not empty,
    keys of type str or int whose ``str()`` are distinct (else it is saved whole)."""
    if type(value) is not dict and type(value) is not OrderedDict:
        return False
    if not value:
        return False
    kinds = set(map(type, value))
    if kinds == {str}:
        return True
    return kinds <= {str, int} and len({str(k) for k in value}) == len(value)


def _is_list_container(value: Any) -> bool:
    """Whether a list is split by index: as DCP's traversal decides, one holding a tensor, a dict
    or a list so split."""
    if type(value) is not list:
        return False
    for item in value:
        if isinstance(item, (torch.Tensor, Mapping)):
            return True
        if type(item) is list and _is_list_container(item):
            return True
    return False


def walk(key: str, state: Any) -> tuple[list[tuple[Path, Any]], list[list[Any]]]:
    """The leaves ``(path, value)`` of app-state entry ``key`` (``state``: its state dict; each
    path starts with ``key``), and ``[path, int keys]`` of every dict whose keys include ints.
    UnrestorableStateError for a state nested deeper than ``MAX_PATH_DEPTH``."""
    leaves: list[tuple[Path, Any]] = []
    int_keys: list[list[Any]] = []
    stack: list[tuple[Path, Any]] = [((key,), state)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_PATH_DEPTH:
            raise UnrestorableStateError(
                f"the app-state entry {'/'.join(map(str, path[:4]))}/... is nested deeper than "
                f"{MAX_PATH_DEPTH} levels, which a snapshot does not hold; flatten it"
            )
        if _is_dict_container(value):
            ints = [k for k in value if type(k) is int]
            if ints:
                int_keys.append([list(path), ints])
            stack.extend(((*path, str(k)), v) for k, v in reversed(list(value.items())))
        elif _is_list_container(value):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
        else:
            leaves.append((path, value))
    return leaves, int_keys


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor or a ShardedTensor (each rank saves its own chunks)."""
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return False
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(value, (DTensor, ShardedTensor))


class Replicated:
    """Which leaves of :func:`walk` are the same on every rank, given the logical paths
    (torchsnapshot's, ``key/sub/...``) the ``replicated`` globs matched on every rank (``agreed``)
    among all logical leaf paths (``logical``): a leaf is, when every logical leaf at or below it
    is."""

    def __init__(self, logical: Iterable[str], agreed: set[str]) -> None:
        self._total: dict[str, int] = {}
        self._matched: dict[str, int] = {}
        if not agreed:
            return
        for leaf in logical:
            parts = leaf.split("/")
            hit = leaf in agreed
            for n in range(1, len(parts) + 1):
                prefix = "/".join(parts[:n])
                self._total[prefix] = self._total.get(prefix, 0) + 1
                if hit:
                    self._matched[prefix] = self._matched.get(prefix, 0) + 1

    def __call__(self, path: Path) -> bool:
        if not self._total:
            return False
        from tnt_snapshot_plugin.format.torchsnapshot.common import encode

        logical = "/".join(encode(str(token)) for token in path)
        total = self._total.get(logical, 0)
        return total > 0 and self._matched.get(logical, 0) == total


# -- reading ----------------------------------------------------------------------------------


class Layout:
    """The leaves a snapshot holds, by app-state key: ``app[key]`` (rest of path -> fully
    qualified name) and, for a snapshot of the plugin's on several ranks, ``ranks[R][key]``.

    ``paths``: fully qualified name -> path (DCP's ``planner_data``). ``plugin``: the plugin
    wrote it (else a checkpoint of ``dcp.save``: its entries are those under ``app_state`` when it
    has nothing else, as torchtnt's DCP saver writes them, else its top-level keys)."""

    def __init__(self, paths: Mapping[str, Path], plugin: bool) -> None:
        self.app: dict[str, dict[Path, str]] = {}
        self.ranks: dict[int, dict[str, dict[Path, str]]] = {}
        nested = plugin or (bool(paths) and all(len(p) >= 2 and p[0] == APP_STATE for p in paths.values()))
        for name, path in paths.items():
            if nested and path[0] == APP_STATE:
                self.app.setdefault(str(path[1]), {})[path[2:]] = name
            elif plugin and path[0] == PER_RANK:
                rank = int(path[1])
                self.ranks.setdefault(rank, {}).setdefault(str(path[2]), {})[path[3:]] = name
            else:
                self.app.setdefault(str(path[0]), {})[path[1:]] = name

    def keys(self, rank: Optional[int]) -> set[str]:
        """The app-state keys restored from saved rank ``rank``'s values (None: a snapshot
        without per-rank values)."""
        own = self.ranks.get(rank, {}) if rank is not None else {}
        return {key for key in set(self.app) | set(own) if self.view(key, rank)}

    def view(self, key: str, rank: Optional[int]) -> dict[Path, str]:
        """The leaves of ``key`` a rank restores: the shared ones and saved rank ``rank``'s own.
        (``app_state`` also holds rank 0's own values, for readers that know no ranks: those are
        not shared.)"""
        shared = self.app.get(key, {})
        if rank is None:
            return dict(shared)
        first = self.ranks.get(0, {}).get(key, {})
        out = {rest: name for rest, name in shared.items() if rest not in first}
        out.update(self.ranks.get(rank, {}).get(key, {}))
        return out

    def per_rank(self, keys: Iterable[str]) -> dict[tuple[str, Path], dict[int, str]]:
        """(key, rest of path) -> saved rank -> fully qualified name, of every value of ``keys``
        saved per rank."""
        out: dict[tuple[str, Path], dict[int, str]] = {}
        wanted = set(keys)
        for rank, by_key in self.ranks.items():
            for key, leaves in by_key.items():
                if key in wanted:
                    for rest, name in leaves.items():
                        out.setdefault((key, rest), {})[rank] = name
        return out


def int_keys_of(index: Optional[Mapping[str, Any]]) -> dict[Path, set[int]]:
    """The dicts whose keys include ints, as the plugin's index records them: path -> keys."""
    found: dict[Path, set[int]] = {}
    record = (index or {}).get("dcp")
    entries = record.get("int_keys") if isinstance(record, dict) else None
    if not isinstance(entries, list):
        return found
    for entry in entries:
        if (
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
            and all(type(t) in (str, int) for t in entry[0]) and isinstance(entry[1], list)
        ):
            found.setdefault(tuple(entry[0]), set()).update(k for k in entry[1] if type(k) is int)
    return found


class _Node:
    __slots__ = ("children", "value", "leaf")

    def __init__(self) -> None:
        self.children: dict[Token, _Node] = {}
        self.value: Any = None
        self.leaf = False


def assemble(
    key: str, items: list[tuple[Path, Any]], current: Any, int_keys: Optional[Mapping[Path, set[int]]]
) -> Any:
    """Entry ``key``'s state dict from its leaves ``(rest of path, value)`` (in saved order).

    Dicts are rebuilt (an ``OrderedDict`` where the target's state dict has one there), lists in
    index order; a dict key is typed as the target's state dict has it (``current``), else an
    int where the index records one (``int_keys``: path from the key). A checkpoint without the
    plugin's index (``int_keys`` None) records none: there, the per-parameter ``state`` of an
    optimizer's state dict (a dict beside ``param_groups`` whose ``params`` are ints) is keyed by
    those ints, as ``torch.optim.Optimizer.load_state_dict`` looks them up."""
    root = _Node()
    for rest, value in items:
        node = root
        for token in rest:
            node = node.children.setdefault(token, _Node())
        node.value, node.leaf = value, True
    return _build(root, (key,), current, int_keys if int_keys is not None else {}, int_keys is None)


def _build(node: _Node, path: Path, current: Any, int_keys: Mapping[Path, set[int]], guess: bool) -> Any:
    if node.leaf:
        return node.value
    tokens = list(node.children)
    indices = [t for t in tokens if type(t) is int]
    if tokens and len(indices) == len(tokens):
        out: list[Any] = [None] * (max(indices) + 1)
        for i in indices:
            below = current[i] if type(current) is list and i < len(current) else None
            out[i] = _build(node.children[i], (*path, i), below, int_keys, guess)
        return out
    by_text = {str(k): k for k in current} if isinstance(current, Mapping) else {}
    ints = int_keys.get(path, ())
    built: dict[Any, Any] = OrderedDict() if isinstance(current, OrderedDict) else {}
    meta = getattr(current, "_metadata", None)
    if meta is not None and isinstance(built, OrderedDict):
        built._metadata = meta  # type: ignore[attr-defined]  # a module's state-dict versions
    for token in tokens:
        text = str(token)
        name: Any = by_text.get(text, text)
        if name is text and _INT_TEXT.match(text) and int(text) in ints:
            name = int(text)
        below = current[name] if isinstance(current, Mapping) and name in current else None
        built[name] = _build(node.children[token], (*path, text), below, int_keys, guess)
    if guess:
        _key_optimizer_state(built)
    return built


def _key_optimizer_state(built: dict[Any, Any]) -> None:
    """In an optimizer's state dict rebuilt without a record of its key types, the ``state`` keys
    that are the text of a parameter id of ``param_groups`` become that int."""
    state, groups = built.get("state"), built.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return
    ids = {p for g in groups if isinstance(g, dict) for p in (g.get("params") or ()) if type(p) is int}
    if ids and all(isinstance(k, str) and _INT_TEXT.match(k) and int(k) in ids for k in state):
        built["state"] = {int(k): v for k, v in state.items()}


__all__ = [
    "APP_STATE", "PER_RANK", "Layout", "Path", "Replicated", "assemble", "fqn", "int_keys_of", "is_sharded", "walk",
]
