"""How the objects of a snapshot are unpickled, and the saver's check that they can be.

torchsnapshot stores every value that is not a tensor or a plain number/string/bytes (an
"object entry": a numpy array, a ``datetime``, an ``argparse.Namespace``...) with ``torch.save``,
and the plugin reads it back with ``torch.load(weights_only=True)``: torch's restricted unpickler,
which builds only tensors, containers and the classes on an allow-list, and so runs no code a
snapshot carries. A snapshot is still trusted input, as a pickle is.

* While the plugin restores (and only then), :func:`safe_globals` are added to torch's allow-list
  (:func:`allowed_globals`); what the user added with ``torch.serialization.add_safe_globals``
  stays allowed, and nothing the user added is removed afterwards.
* ``weights_only=False`` (restore, the adapters' restore methods, Lightning's
  ``fit(weights_only=False)``) loads objects with full pickle: for trusted snapshots only.
* :class:`LoadCheck`: at every snapshot, before anything is written, each object entry whose
  types were not checked yet in this run is serialized and loaded back the way restore will
  load it; one that cannot be loaded fails the save with :class:`UnrestorableStateError`, naming
  the entry and the type. Later snapshots with the same types cost a walk over the objects.
"""

from __future__ import annotations

import collections
import contextlib
import io
import threading
from collections import deque
from typing import Any, Iterator, Mapping, Optional

from tnt_snapshot_plugin.errors import UnrestorableStateError
from tnt_snapshot_plugin.format.torchsnapshot.manifest import PRIMITIVE_TYPES


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    found: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: one dtype class per dtype
    if dtypes is not None:
        found += [
            cls for name in dir(dtypes)
            if isinstance(cls := getattr(dtypes, name), type) and issubclass(cls, np.dtype)
        ]
    return found


def _safe_globals() -> list[Any]:
    import argparse
    import builtins
    import datetime

    return [
        *_numpy_globals(),
        datetime.datetime,
        datetime.date,
        datetime.time,
        datetime.timedelta,
        datetime.timezone,
        argparse.Namespace,
        # builtins that pickle by name; each only builds a value
        builtins.frozenset,
        builtins.slice,
        builtins.range,
    ]


_lock = threading.Lock()
_cached: Optional[list[Any]] = None


def safe_globals() -> list[Any]:
    """The classes and functions the plugin's restores allow beyond torch's own list.

    numpy arrays, scalars and dtypes (``_reconstruct``, ``scalar``, ``ndarray``, ``dtype`` and
    ``numpy.dtypes``' classes, as torch's documentation lists them), ``datetime``'s ``datetime``,
    ``date``, ``time``, ``timedelta`` and ``timezone``, ``argparse.Namespace``, and the builtins
    ``frozenset``, ``slice`` and ``range``. Enums,
    dataclasses and other classes of your own load once you allow them:
    ``torch.serialization.add_safe_globals([MyEnum, MyConfig])``. (torch's own list already has
    ``dict``, ``OrderedDict``, ``Counter``, ``set``, ``tuple`` and ``complex``; a
    ``collections.deque`` or ``defaultdict`` cannot be loaded with ``weights_only`` at all, allowed
    or not: save a list or a dict, or use ``weights_only=False``.)
    """
    global _cached
    with _lock:
        if _cached is None:
            _cached = _safe_globals()
        return list(_cached)


_active = 0
_scope: Any = None  # torch.serialization.safe_globals over what the plugin added, while in use
_scope_lock = threading.Lock()


@contextlib.contextmanager
def allowed_globals() -> Iterator[None]:
    """Allow :func:`safe_globals` in ``torch.load(weights_only=True)`` while inside.

    torch's allow-list is process-wide: the plugin's entries that are not on it already are
    added (torch's own ``torch.serialization.safe_globals`` scope) when the first restore of any
    thread enters, and exactly those are removed when the last one exits; the list is never
    cleared, so entries the user adds meanwhile, from any thread, stay (but for one of the
    plugin's own, which is taken away with the rest).
    """
    global _active, _scope
    import torch.serialization as serialization

    with _scope_lock:
        if _active == 0:
            present = set(map(id, serialization.get_safe_globals()))
            _scope = serialization.safe_globals([g for g in safe_globals() if id(g) not in present])
            _scope.__enter__()
        _active += 1
    try:
        yield
    finally:
        with _scope_lock:
            _active -= 1
            if _active == 0:
                scope, _scope = _scope, None
                scope.__exit__(None, None, None)


def load_object(buf: Any, *, weights_only: bool = True) -> Any:
    """An object entry's bytes (written by ``torch.save``) as the object; its tensors on CPU
    unless CUDA is available (where torchsnapshot's own reader puts them). A sparse tensor is
    checked as it is built (indices within its shape), so damaged bytes raise instead of
    making a tensor that reads out of bounds."""
    import torch

    data = buf if isinstance(buf, (bytes, bytearray)) else bytes(buf)
    location = None if torch.cuda.is_available() else torch.device("cpu")
    with allowed_globals(), torch.sparse.check_sparse_tensor_invariants(enable=True):
        return torch.load(io.BytesIO(data), map_location=location, weights_only=weights_only)


def refusal(exc: BaseException) -> str:
    """The line of torch's ``weights_only`` refusal that says what it refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [
        line for line in lines
        if "global" in line.lower() or line.startswith(("Can only", "Unsupported"))
    ]
    named = [line for line in named if not line.startswith("Check the documentation")]
    return (named or lines or [repr(exc)])[0]


def _is_leaf_object(value: Any) -> bool:
    """Whether torchsnapshot stores ``value`` as an object entry (torch.save / torch.load)."""
    import torch

    return not isinstance(value, torch.Tensor) and type(value).__name__ not in _INLINED


_INLINED = PRIMITIVE_TYPES  # torchsnapshot's PrimitiveEntry
_WALK_BUDGET = 256


def _signature(value: Any) -> Any:
    """The types ``value`` is built from (containers, ``__dict__`` and dataclass fields walked,
    up to a budget): a new signature at a path means its types must be checked again."""
    seen: list[type] = []
    stack = [value]
    budget = _WALK_BUDGET
    while stack and budget:
        budget -= 1
        obj = stack.pop()
        seen.append(type(obj))
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict) and not isinstance(obj, type):
                stack.extend(attrs.values())
    return frozenset(seen)


#: How many values of an object :func:`holds_meta_tensor` looks at, at most.
_MAX_WALK = 1_000_000


def holds_meta_tensor(value: Any) -> bool:
    """Whether ``value`` (an unpickled object) is or holds, in its containers and attributes, a
    tensor on the meta device."""
    import torch

    todo, seen = [value], 0
    while todo and seen < _MAX_WALK:
        item = todo.pop()
        seen += 1
        if isinstance(item, torch.Tensor):
            if item.is_meta:
                return True
            continue
        kind = type(item)
        if kind in (str, bytes, int, float, bool, type(None)):
            continue
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, deque)):
            todo.extend(item)
        elif isinstance(getattr(item, "__dict__", None), dict):
            todo.extend(vars(item).values())
    return False


class LoadCheck:
    """Remembers, for one run, which (entry, types) were found loadable; checks the rest."""

    def __init__(self, *, weights_only: bool = True) -> None:
        self.weights_only = weights_only
        self._ok: set[tuple[str, Any]] = set()

    def check(self, frozen: Mapping[str, Any]) -> None:
        """Raise :class:`UnrestorableStateError` if an object entry of ``frozen`` (key ->
        Stateful) could not be loaded by restore."""
        if not self.weights_only:
            return  # the user restores with full pickle (and said so)
        import torch

        skip = {torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes, type(None)}
        walked = (list, dict, collections.OrderedDict)  # as torchsnapshot's flatten
        for key, stateful in frozen.items():
            root = stateful.state_dict()
            if type(root) not in walked:
                if type(root) not in skip and _is_leaf_object(root):
                    self._check_one(key, root)
                continue
            stack: list[tuple[str, Any]] = [(key, root)]
            while stack:
                prefix, container = stack.pop()
                items = enumerate(container) if type(container) is list else container.items()
                for name, value in items:
                    kind = type(value)
                    if kind in skip:
                        continue
                    if kind in walked:
                        stack.append((f"{prefix}/{name}", value))
                    elif _is_leaf_object(value):
                        self._check_one(f"{prefix}/{name}", value)

    def _check_one(self, path: str, value: Any) -> None:
        import torch

        signature = (path, _signature(value))
        if signature in self._ok:
            return
        buf = io.BytesIO()
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        try:
            torch.save(value, buf)
        except Exception as exc:
            raise UnrestorableStateError(
                f"the app-state entry {path!r} holds a {kind} that cannot be encoded into a "
                f"snapshot ({type(exc).__name__}: {exc}). Nothing was committed, and training stops "
                "whatever on_save_error says: every snapshot of this state would fail the same way. "
                "Store it as tensors or plain values (numbers, strings, lists, dicts), or make it "
                "picklable (a class defined at module level, a function by name, not a lambda)"
            ) from exc
        try:
            loaded = load_object(buf.getbuffer(), weights_only=True)
        except Exception as exc:
            raise UnrestorableStateError(
                f"the snapshot entry {path!r} holds a {kind} that restore could not load: "
                f"torch.load(weights_only=True) refuses it ({refusal(exc)}). Nothing was written. "
                "Allow the type with torch.serialization.add_safe_globals([...]) before training "
                "and restoring, store it as tensors or plain values, or, for snapshots you trust, "
                "pass weights_only=False to the saver and to restore"
            ) from exc
        if holds_meta_tensor(loaded):
            raise UnrestorableStateError(
                f"the snapshot entry {path!r} holds a tensor on the meta device, which has no data "
                "to save: restore refuses such a snapshot. Nothing was written. Materialize the "
                "tensor (to_empty(), or load real weights) before training, or leave it out of the "
                "state_dict"
            )
        self._ok.add(signature)


__all__ = ["LoadCheck", "allowed_globals", "holds_meta_tensor", "load_object", "safe_globals"]
