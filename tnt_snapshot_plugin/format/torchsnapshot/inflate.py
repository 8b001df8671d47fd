"""Containers rebuilt as torchsnapshot's ``inflate`` rebuilds them from a manifest's container
entries and the leaf values read: dicts keep the saved key order (a key that looks like an int
also matches the int), lists come in index order. No torch import."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any
from urllib.parse import unquote as decode

from tnt_snapshot_plugin.format.torchsnapshot.manifest import CONTAINER_TYPES
from tnt_snapshot_plugin.format.torchsnapshot.manifest import corrupt as _corrupt


def subtree(view: dict[str, dict], root: str) -> dict[str, dict]:
    below = root + "/"
    return {path: entry for path, entry in view.items() if path == root or path.startswith(below)}


_ABSENT = object()


def _is_int(token: str) -> bool:
    return token.isdigit() or (len(token) > 1 and token[0] in "+-" and token[1:].isdigit())


def inflate(root: str, tree: dict[str, dict], values: dict[str, Any], added: dict[str, list]) -> Any:
    """The object at ``root`` rebuilt from the container entries of ``tree`` and the leaf
    ``values``, as torchsnapshot's inflate rebuilds it."""
    children: dict[str, dict[str, str]] = {}
    for path in tree:
        if path != root:
            parent, _, token = path.rpartition("/")
            children.setdefault(parent, {})[token] = path

    def present(path: str) -> bool:
        return path in values or tree[path]["type"] in CONTAINER_TYPES

    def build(path: str) -> Any:
        entry = tree[path]
        kind = entry["type"]
        kids = children.get(path, {})
        if kind == "list":
            try:
                order = sorted(kids, key=int)
            except ValueError as exc:
                raise _corrupt(f"entry {path!r}", f"a list holds a non-index item ({exc})") from exc
            return [value(kids[token]) for token in order if present(kids[token])]
        by_key: dict[Any, str] = {}
        for token, child in kids.items():
            key = decode(token) if "%" in token else token
            by_key[key] = child
            if _is_int(key):
                by_key[int(key)] = child
        keys = entry.get("keys")
        if not isinstance(keys, list):
            raise _corrupt(f"entry {path!r}", f"a {kind} without a list of keys")
        out: dict = OrderedDict() if kind == "OrderedDict" else {}
        try:
            for key in keys + added.get(path, []):
                found = by_key.get(key)
                if found is None:
                    continue
                leaf = values.get(found, _ABSENT)  # value(found), in one lookup for a leaf
                if leaf is not _ABSENT:
                    out[key] = leaf
                elif tree[found]["type"] in CONTAINER_TYPES:
                    out[key] = build(found)
        except TypeError as exc:
            raise _corrupt(f"entry {path!r}", f"a key cannot be a dict key ({exc})") from exc
        return out

    def value(path: str) -> Any:
        if tree[path]["type"] in CONTAINER_TYPES:
            return build(path)
        return values[path]

    return value(root)


def note_added(tree: dict[str, dict], path: str, added: dict[str, list]) -> None:
    """A sharded entry this rank did not save: its key joins the parent dict's keys."""
    parent, _, token = path.rpartition("/")
    entry = tree.get(parent)
    if entry is not None and entry["type"] != "list":
        key = decode(token)
        keys = entry.get("keys") or []
        if key not in keys and not (_is_int(key) and int(key) in keys):
            added.setdefault(parent, []).append(key)
