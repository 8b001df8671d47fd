"""Staging copies: the state dicts of an asynchronous snapshot copied into buffers reused from one
snapshot to the next (:class:`Stager`), so training mutates its own tensors freely while the copy
is written; and the state dicts of a synchronous snapshot handed over as they are
(:func:`freeze_without_copy`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from operator import attrgetter, eq
from typing import Any, Callable, Mapping, Optional

import torch

from tnt_snapshot_plugin.app_state import Frozen

#: Tensors staged into reused buffers. A Parameter is copied as a Parameter (its type and
#: ``requires_grad`` are saved with it), a sparse tensor as itself.
_PLAIN_TENSOR_TYPES = (torch.Tensor,)
#: The staging-buffer path component of a sharded tensor's local shards.
_SHARD = "<local shard>"
# What a staging buffer must still match, each compared as one list per dict, in C (three
# single-attribute passes cost less than one pass building a tuple per tensor).
_SHAPE, _DTYPE, _LAYOUT = attrgetter("shape"), attrgetter("dtype"), attrgetter("layout")


def sharded_kind(obj: Any) -> Optional[str]:
    """``"sharded"`` for a ``ShardedTensor``, ``"dtensor"`` for a ``DTensor``, else None."""
    if not isinstance(obj, torch.Tensor) or type(obj) in (torch.Tensor, torch.nn.Parameter):
        return None
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, ShardedTensor):
        return "sharded"
    if isinstance(obj, DTensor):
        return "dtensor"
    return None


def local_shards(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds of ``tensor``: its local shards if it is a ShardedTensor or a
    DTensor (whose ``numel()`` and storage are not this rank's), else ``[tensor]``."""
    kind = sharded_kind(tensor)
    if kind == "sharded":
        return [shard.tensor for shard in tensor.local_shards()]  # type: ignore[attr-defined]
    if kind == "dtensor":
        return [tensor.to_local()]  # type: ignore[attr-defined]
    return [tensor]


def _plain_tensor(obj: Any) -> bool:
    return (
        type(obj) in _PLAIN_TENSOR_TYPES
        and obj.layout == torch.strided
        and not obj.is_quantized
    )


class _Layout:
    """A dict staged last time whose values were all plain tensors: its keys, their buffers,
    and the staged dict itself (``staged``: the same keys and buffers, handed out again).

    ``groups``: for a dict of CPU tensors, its buffers are views into one flat arena per dtype,
    in the dict's order, and each group is ``(arena, indices of its values or None for all,
    whether they are all 1-D)``: its values are copied with one ``torch.cat(out=arena)``.
    Empty for a dict with a tensor on an accelerator (copied tensor by tensor)."""

    __slots__ = ("keys", "shapes", "dtypes", "layouts", "types", "buffers", "on_device", "staged", "groups")

    def __init__(self, keys: tuple[Any, ...], values: list[torch.Tensor], staged: dict[Any, torch.Tensor],
                 on_device: list[bool], groups: list[_Group]) -> None:
        self.keys = keys
        self.shapes = list(map(_SHAPE, values))
        self.dtypes = list(map(_DTYPE, values))
        self.layouts = list(map(_LAYOUT, values))
        self.types = list(map(type, values))
        self.staged = staged
        self.buffers = list(staged.values())
        self.on_device = on_device
        self.groups = groups


#: (flat arena of one dtype, the indices of the dict's values staged into it or None for all,
#: whether those values are all 1-D)
_Group = tuple[torch.Tensor, Optional[list[int]], bool]
#: a copy of one group: (arena, its source tensors, whether they are all 1-D)
_Cat = tuple[torch.Tensor, list[torch.Tensor], bool]


def _normal_tensors() -> Any:
    """A context in which new tensors are normal ones, even inside ``torch.inference_mode()``:
    a staging buffer made while a snapshot is taken in inference mode (a hook run during
    evaluation) is copied into again by later snapshots, and an inference tensor refuses in-place
    updates outside inference mode."""
    return torch.inference_mode(False)


def _arena_views(values: list[torch.Tensor], empty: Callable[[int, torch.dtype], torch.Tensor]) -> tuple[list[torch.Tensor], list[_Group]]:
    """Staging buffers for ``values`` (CPU plain tensors): views, in order, into one new flat
    tensor per dtype (``empty(numel, dtype)``); and the groups that copy into them (see _Layout)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(i)
    buffers: list[torch.Tensor] = [values[0]] * len(values)  # placeholders, each replaced below
    groups: list[_Group] = []
    for dtype, indices in by_dtype.items():
        with _normal_tensors():  # reused by later snapshots, taken outside inference mode too
            arena = empty(sum(values[i].numel() for i in indices), dtype)
        at = 0
        for i in indices:
            n = values[i].numel()
            buffers[i] = arena[at:at + n].view(values[i].shape)
            at += n
        flat = all(values[i].dim() == 1 for i in indices)
        groups.append((arena, None if len(indices) == len(values) else indices, flat))
    return buffers, groups


class Stager:
    """Copies state dicts into staging buffers that are reused from one snapshot to the next.

    The training thread is blocked only for these copies; the write then runs from the copies
    while training mutates the originals. A buffer is reallocated only when the tensor at that
    place in the state changes shape, dtype or layout (for a dict of CPU tensors: the dict's
    arenas, when any of its tensors or keys changes); buffers of places that disappeared are
    released. A ShardedTensor's or DTensor's local shards are staged the same way (into a new
    ShardedTensor / DTensor with the same global metadata). Everything else a state dict holds
    (numbers, strings, other tensor subclasses) is copied afresh each time.

    The copies run after every ``state_dict()`` has been called, batched so that a state with
    thousands of tensors does not pay the per-call cost of ``copy_`` thousands of times: a dict
    of CPU tensors (a module's state dict, an optimizer's per-parameter state) is staged into one
    flat arena per dtype and copied with one ``torch.cat(out=arena)``, one kernel call for the
    whole dict, where ``torch._foreach_copy_`` into separate buffers dispatches a ``copy_`` per
    tensor on the CPU (``benchmarks/run.py``'s 10,000 x 4 KiB state measures the stall); the
    other tensors are copied with one ``torch._foreach_copy_``. A
    dict whose keys and tensor shapes are those of last time is matched to its buffers in one
    pass without rebuilding anything. Tensors on an accelerator are copied into pinned host buffers with non-blocking
    copies and one synchronisation per device at the end.

    ``allocate(numel, dtype)``: where every buffer comes from, a new flat tensor (the process
    writer's shared memory; its buffers are then not pinned); None: ``torch.empty``.
    """

    def __init__(self, allocate: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None) -> None:
        self._allocate = allocate
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self._used: set[tuple[Any, ...]] = set()
        self._used_layouts: set[tuple[Any, ...]] = set()
        self._dst: list[torch.Tensor] = []
        self._src: list[torch.Tensor] = []
        self._dst_device: list[torch.Tensor] = []
        self._src_device: list[torch.Tensor] = []
        self._cats: list[_Cat] = []
        #: the last stage's source tensors, until the caller takes them (``take_sources``)
        self._sources: Optional[tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]] = None

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype) if self._allocate is None else self._allocate(numel, dtype)

    @staticmethod
    def _on_device(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on an accelerator (copied into pinned memory, non-blocking)."""
        return tensor.device.type != "cpu"

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers between snapshots."""
        seen: dict[int, torch.Tensor] = {id(b): b for b in self._buffers.values()}
        for layout in self._layouts.values():
            seen.update((id(b), b) for b in layout.buffers)
        return sum(b.numel() * b.element_size() for b in seen.values())

    def stage(self, app_state: Mapping[str, Any]) -> dict[str, Frozen]:
        """Frozen copies of every entry's ``state_dict()``.

        The state dicts' tensors copied from are then held until :meth:`take_sources`: the
        caller lets go of them off the training thread (a module's ``state_dict()`` makes a new
        tensor object for each of its tensors, and freeing 10,000 of them takes about 2.5 ms)."""
        self._used = set()
        self._used_layouts = set()
        try:
            staged = {
                key: Frozen(self._copy(obj.state_dict(), (key,))) for key, obj in app_state.items()
            }
            with torch.no_grad():
                for arena, sources, flat in self._cats:
                    torch.cat(sources if flat else [t.reshape(-1) for t in sources], out=arena)
                if self._src:
                    torch._foreach_copy_(self._dst, self._src)
                if self._src_device:
                    torch._foreach_copy_(self._dst_device, self._src_device, non_blocking=True)
                    _wait_for(self._src_device)
        finally:  # handed to the caller: held no longer than until it takes them
            self._sources = (self._src, self._src_device, [sources for _, sources, _ in self._cats])
            self._dst, self._src, self._dst_device, self._src_device, self._cats = [], [], [], [], []
        for stale in [k for k in self._buffers if k not in self._used]:
            del self._buffers[stale]
        for stale in [k for k in self._layouts if k not in self._used_layouts]:
            del self._layouts[stale]
        return staged

    def take_sources(self) -> Any:
        """The last stage's source tensors (an opaque object: drop it where freeing them does not
        block training); the stager holds no reference to the training's tensors afterwards."""
        sources, self._sources = self._sources, None
        return sources

    def _schedule(self, buf: torch.Tensor, src: torch.Tensor, on_device: bool) -> None:
        if on_device:
            self._dst_device.append(buf)
            self._src_device.append(src)
        else:
            self._dst.append(buf)
            self._src.append(src)

    def _buffer(self, where: tuple[Any, ...], obj: torch.Tensor) -> tuple[torch.Tensor, bool]:
        on_device = self._on_device(obj)
        buf = self._buffers.get(where)
        pin = on_device and self._allocate is None and _can_pin()
        if (
            buf is None
            or buf.shape != obj.shape
            or buf.dtype != obj.dtype
            or (pin and not buf.is_pinned())
        ):
            with _normal_tensors():
                if self._allocate is None:
                    buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
                else:
                    buf = self._allocate(obj.numel(), obj.dtype).view(obj.shape)
            self._buffers[where] = buf
        self._used.add(where)
        return buf, on_device

    def _copy(self, obj: Any, where: tuple[Any, ...]) -> Any:
        if _plain_tensor(obj):
            buf, on_device = self._buffer(where, obj)
            self._schedule(buf, obj, on_device)
            return buf
        if isinstance(obj, torch.Tensor):
            kind = sharded_kind(obj)
            if kind is not None:
                return self._copy_sharded(obj, kind, where)
            if type(obj) is torch.nn.Parameter:
                return torch.nn.Parameter(obj.detach().clone(), requires_grad=obj.requires_grad)
            return obj.detach().clone()
        if isinstance(obj, dict):
            layout = self._layouts.get(where)
            if layout is not None:
                staged = self._reuse(obj, where, layout)
                if staged is not None:
                    return staged
                # Something changed: go the long way. Buffers of their own that fit are reused;
                # an arena is let go of first, so that the dict's old and new copies (a whole
                # model's, for a module's state dict) are never held at once.
                del self._layouts[where]
                if not layout.groups:
                    for key, buf in zip(layout.keys, layout.buffers, strict=True):
                        self._buffers.setdefault(where + (key,), buf)
                del layout
            return self._copy_dict(obj, where)
        if isinstance(obj, list):
            return [self._copy(v, where + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copy(v, where + (i,)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_sharded(self, obj: Any, kind: str, where: tuple[Any, ...]) -> torch.Tensor:
        """A ShardedTensor or DTensor over staged copies of this rank's shards (no collective).

        Shards on an accelerator are cloned there: the global metadata names their device.
        """
        def staged(shard: torch.Tensor, at: tuple[Any, ...]) -> torch.Tensor:
            shard = shard.detach()
            if self._on_device(shard) or not _plain_tensor(shard):
                return shard.clone()
            buf, on_device = self._buffer(at, shard)
            self._schedule(buf, shard, on_device)
            return buf

        if kind == "sharded":
            from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

            shards = [
                Shard(staged(shard.tensor, where + (_SHARD, i)), shard.metadata)
                for i, shard in enumerate(obj.local_shards())
            ]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, obj.metadata(), process_group=obj._process_group
            )
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            staged(obj.to_local(), where + (_SHARD, 0)),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )

    def _copy_dict(self, obj: dict[Any, Any], where: tuple[Any, ...]) -> dict[Any, Any]:
        values = list(obj.values())
        if values and type(obj) in (dict, OrderedDict) and all(map(_plain_tensor, values)):
            on_device = [self._on_device(v) for v in values]
            if any(on_device):
                out = {k: self._copy(v, where + (k,)) for k, v in obj.items()}
                groups: list[_Group] = []
            else:
                buffers, groups = _arena_views(values, self._empty)
                out = dict(zip(obj, buffers, strict=True))
                self._schedule_groups(groups, values)
            if type(obj) is not dict:
                out = type(obj)(out)
            self._layouts[where] = _Layout(tuple(obj), values, out, on_device, groups)
            self._used_layouts.add(where)
            return out
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = self._copy(v, where + (k,))
        return out

    def _schedule_groups(self, groups: list[_Group], values: list[torch.Tensor]) -> None:
        for arena, indices, flat in groups:
            self._cats.append((arena, values if indices is None else [values[i] for i in indices], flat))

    def _reuse(self, obj: dict[Any, Any], where: tuple[Any, ...], layout: _Layout) -> Optional[dict[Any, Any]]:
        """``obj`` staged into ``layout``'s buffers, or None if its type, keys or tensors changed."""
        if type(obj) is not type(layout.staged):
            return None
        keys = tuple(obj)
        if keys != layout.keys:
            return None
        values = list(obj.values())
        # Compared in C: the same tensor types, shapes, dtypes and layouts. Each shape is a new
        # torch.Size, compared and dropped one at a time: a list of 10,000 of them, held for the
        # comparison, was enough for Python's collector to move them to its oldest generation.
        if (
            list(map(type, values)) != layout.types
            or not all(map(eq, map(_SHAPE, values), layout.shapes))
            or list(map(_DTYPE, values)) != layout.dtypes
            or list(map(_LAYOUT, values)) != layout.layouts
        ):
            return None
        if layout.groups:
            self._schedule_groups(layout.groups, values)
        else:
            for buf, src, on_device in zip(layout.buffers, values, layout.on_device, strict=True):
                self._schedule(buf, src, on_device)
        self._used_layouts.add(where)
        # The dict staged last time: the same type, keys and buffers (nothing downstream
        # mutates a staged state, and the previous snapshot's write is over).
        return layout.staged


def _can_pin() -> bool:
    return torch.cuda.is_available()


def _wait_for(sources: list[torch.Tensor]) -> None:
    """Wait for the non-blocking copies from each accelerator device in ``sources``."""
    devices = {t.device for t in sources}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def freeze_without_copy(app_state: Mapping[str, Any]) -> dict[str, Frozen]:
    """Each entry's ``state_dict()`` as is: for synchronous snapshots, where nothing runs meanwhile."""
    return {key: Frozen(obj.state_dict()) for key, obj in app_state.items()}


# ------------------------------------------------------------------------------------------------
# Replicated entries
