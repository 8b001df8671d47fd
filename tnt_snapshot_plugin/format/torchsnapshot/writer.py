"""Write state dicts in torchsnapshot's on-disk format, without torchsnapshot.

The writer turns each rank's state into manifest records (each one entry of torchsnapshot's
schema, as its JSON text) and payloads (byte buffers to write to files); the caller writes the
payloads, gathers every rank's records on rank 0 (:func:`merge`) and writes ``.snapshot_metadata``
(:func:`metadata_bytes`) last. Stock torchsnapshot restores what it writes.

Records are JSON text (a str is not tracked by Python's garbage collector) and buffers numpy
arrays (``common.flat_bytes``: one tracked object a tensor): a snapshot of 10,000 tensors holds
10,000 of each until it is written, and as dicts and memoryviews (about seven tracked objects a
tensor) they set off a full collection of the training process's heap in most snapshots. A
pack whose tensors lie end to end in memory (an asynchronous snapshot's staging arena) is one
buffer, not one a tensor (:func:`byte_runs`); a reused plan copies a pack of tensors that lie
apart (a synchronous snapshot's model parameters) into one reused buffer (:class:`PackBuffer`).
The choices, where the format leaves room:

* **Paths.** :func:`flatten` builds logical paths exactly as torchsnapshot's ``flatten`` does:
  lists and dicts/OrderedDicts whose keys are all ``str``/``int`` with distinct ``str()`` are
  containers; anything else (tuples, sets, dicts with other keys, dict subclasses) is one value.
* **Files.** Everything rank R writes lives under ``R/`` or in ``batched/R-N``, so no two ranks
  ever write the same file. Small tensors (below ``pack_bytes``) are packed end to end into
  ``batched/R-N`` files of about ``pack_bytes`` (``byte_range`` says where); a larger tensor or an
  object gets a file of its own at ``R/<logical path>``, a shard at ``R/<logical path>/shard_<offsets>``.
  Path components the filesystem would read as navigation (``""``, ``"."``, ``".."``), NUL bytes,
  and components too long for a file name are rewritten into names ``encode`` never produces, so a
  location never leaves the snapshot directory and two values never share a file.
* **Bytes.** Tensors of the raw dtypes (``common.RAW_DTYPES``) are stored as their bytes,
  zero-copy over CPU contiguous tensors (GPU and non-contiguous tensors are copied first). Other
  dtypes (complex, quantized) and empty tensors are ``torch.save``'d: stock torchsnapshot cannot
  rebuild an empty tensor from zero raw bytes. Objects are ``torch.save``'d to a file of their
  own; ``int``/``str``/``bool``/``bytes``/``float`` (exact types) are stored inline in the manifest.
  An ``int`` too long for ``str()`` (over ``sys.get_int_max_str_digits()`` digits, 4300 by default)
  is refused with UnrestorableStateError: restore could read it back neither as text nor pickled.
* **Replicated values** (logical paths the caller says every rank holds identically) are recorded
  once, under ``0/``: every rank computes the same assignment of writers from its own leaves
  (largest first, ties by path, each to the least loaded rank) and only the assigned rank writes
  the bytes and emits the record.
* **ShardedTensor / DTensor**: each rank records its own local shards. A DTensor shard held by
  several ranks (a replica group) is written by one of them, chosen from the path alone, and every
  rank of the group records the same location; a fully replicated DTensor is recorded once, under ``0/``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tnt_snapshot_plugin.errors import ConfigError, UnrestorableStateError
from tnt_snapshot_plugin.format.base import Payload
from tnt_snapshot_plugin.format.torchsnapshot.common import (
    DTYPE_NAMES,
    RAW,
    RAW_DTYPES,
    TORCH_SAVE,
    encode,
    flat_bytes,
)
from tnt_snapshot_plugin.format.torchsnapshot.common import PRIMITIVES as _PRIMITIVES
from tnt_snapshot_plugin.format.torchsnapshot.common import distributed_types as _distributed_types
from tnt_snapshot_plugin.format.torchsnapshot.common import is_distributed as _is_distributed
from tnt_snapshot_plugin.format.torchsnapshot.merging import json_str as _json_str
from tnt_snapshot_plugin.format.torchsnapshot.merging import merge, metadata_bytes  # noqa: F401  (re-exported: the writer's whole API)
from tnt_snapshot_plugin.format.torchsnapshot.mesh_aliases import MeshNames
from tnt_snapshot_plugin.format.torchsnapshot.plan_cache import PackBuffer, PlanCache, _Recorder, byte_runs  # noqa: F401  (byte_runs re-exported)
from tnt_snapshot_plugin.format.torchsnapshot.replication import (  # noqa: F401
    NOMINAL_OBJECT_BYTES,
    _replicated_writers,
    replicable,
)

#: A path component longer than this (in UTF-8 bytes) is shortened to stay a valid file name.
MAX_COMPONENT_BYTES = 200

_STRIDED = torch.strided




def _text(record: Mapping[str, Any]) -> str:
    """A manifest record as JSON text (as :func:`metadata_bytes` writes it)."""
    return json.dumps(record, ensure_ascii=False)


# --- flatten ----------------------------------------------------------------------------------


def flatten(key: str, state_dict: Any) -> tuple[dict[str, dict], dict[str, Any]]:
    """Split ``state_dict`` (saved under app-state ``key``) into its containers and its leaves.

    Returns ``(containers, leaves)``: logical path -> container record (``{"type": "dict",
    "keys": [...]}``, ``"OrderedDict"`` likewise, ``{"type": "list"}``) and logical path -> value.
    Paths are ``KEY/sub/...`` with the key and every dict key ``encode``d, list items by index,
    exactly as torchsnapshot's ``flatten`` builds them."""
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    _flatten_into(state_dict, encode(key), containers, leaves)
    return containers, leaves


def _flatten_into(value: Any, path: str, containers: dict[str, dict], leaves: dict[str, Any]) -> None:
    kind = type(value)
    if kind is list:
        containers[path] = {"type": "list"}
        for index, item in enumerate(value):
            _flatten_into(item, f"{path}/{index}", containers, leaves)
    elif (kind is dict or kind is OrderedDict) and _is_flattenable(value):
        containers[path] = {"type": "dict" if kind is dict else "OrderedDict", "keys": list(value)}
        for name, item in value.items():
            sub = f"{path}/{encode(name if type(name) is str else str(name))}"
            if type(item) in _CONTAINERS:
                _flatten_into(item, sub, containers, leaves)
            else:  # a leaf (most of a state: its tensors), without a call of its own
                leaves[sub] = item
    else:
        leaves[path] = value


_CONTAINERS = frozenset((list, dict, OrderedDict))
_STR_ONLY = frozenset((str,))


def _is_flattenable(mapping: Mapping[Any, Any]) -> bool:
    """A dict is a container when its keys are str/int with distinct ``str()`` (else one object)."""
    if set(map(type, mapping)) == _STR_ONLY:
        return True  # distinct keys of type str are their own distinct str()
    if not all(isinstance(name, (str, int)) for name in mapping):
        return False
    return len({str(name) for name in mapping}) == len(mapping)


# --- plan -------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What one rank writes: its manifest records (full paths ``RANK/...``, and ``0/...`` for the
    replicated values it writes; each record as JSON text, ``json.loads`` gives the dict), its
    payloads (none when they were handed to ``emit`` as they were completed), and their total
    size in bytes."""

    entries: dict[str, str]
    payloads: list[Payload]
    nbytes: int


def plan(
    containers: Mapping[str, dict],
    leaves: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    replicated: Set[str],
    pack_bytes: int = 4 << 20,
    emit: Optional[Callable[[Payload], None]] = None,
    cache: Optional[PlanCache] = None,
    pack_buffer: Optional[PackBuffer] = None,
) -> Plan:
    """This rank's manifest records and payloads for ``containers`` and ``leaves`` (from
    :func:`flatten`, every app-state key together: one plan per rank per snapshot).

    ``replicated``: the logical paths every rank holds identically (the same set on every rank);
    they are recorded once, under ``0/``, by the rank assigned to write them. ``pack_bytes``: tensors
    smaller than this are packed into shared files of about this size (0: no packing).
    ``emit``: given each payload as soon as it is complete (a file of its own at once, a pack
    when the next one starts, the last pack at the end), so that the caller can write it while
    the rest is planned; the plan's ``payloads`` are then empty.
    ``cache``: a :class:`PlanCache` kept from one snapshot to the next (the tensors' records and
    files are reused while the state's layout is unchanged). ``pack_buffer``: where a reused
    plan gathers each pack whose tensors lie apart in memory (:class:`PackBuffer`); only for an
    ``emit`` that is done with a payload's bytes when it returns.
    Raises :class:`~tnt_snapshot_plugin.errors.ConfigError` for a value the format cannot hold
    (payloads already emitted are the caller's to wait for)."""
    builder = _Builder(rank, pack_bytes, emit)
    builder.pack_buffer = pack_buffer
    for path, record in containers.items():
        builder.entries[f"{rank}/{path}"] = _text(record)
    if cache is not None and not replicated:
        if cache.reuse(builder, leaves):
            return builder.finish()
        builder.recorder = _Recorder()
    writers = _replicated_writers(leaves, replicated, world_size) if replicated else {}
    for path, value in leaves.items():
        writer = writers.get(path)
        if writer is None:
            builder.add(path, f"{rank}/{path}", value, False)
        elif writer == rank:
            builder.add(path, f"0/{path}", value, True)
    done = builder.finish()
    if cache is not None:
        cache.keep(builder, leaves)
    return done


class _Builder:
    """Collects one rank's records and payloads, packing small tensors as it goes."""

    def __init__(self, rank: int, pack_bytes: int, emit: Optional[Callable[[Payload], None]]) -> None:
        self.rank = rank
        self.pack_bytes = pack_bytes
        self.entries: dict[str, str] = {}
        self.payloads: list[Payload] = []
        #: a complete payload goes to ``emit`` (written at once), or else to ``payloads``
        self._emit = emit if emit is not None else self.payloads.append
        self._files = 0  # payloads so far (names the packs)
        self.nbytes = 0
        #: set by plan() when a PlanCache is to learn this plan
        self.recorder: Optional[_Recorder] = None
        #: set by plan(): where a reused plan gathers packs of tensors apart in memory
        self.pack_buffer: Optional[PackBuffer] = None
        self._pack: Optional[Payload] = None
        self._pack_size = 0
        self._pack_location = ""  # the pack's rel as a JSON string literal
        self._last_rel = ""  # the file the last tensor went to
        #: shape -> its JSON text (a model has few distinct shapes; formatting one costs microseconds)
        self._shapes: dict[tuple[int, ...], str] = {}
        self._meshes = MeshNames(rank)

    def finish(self) -> Plan:
        if self._pack is not None:
            self._emit(self._pack)
            self._pack = None
        return Plan(self.entries, self.payloads, self.nbytes)

    def add(self, path: str, manifest_path: str, value: Any, replicated: bool) -> None:
        kind = type(value)
        if kind is torch.Tensor and value.layout is _STRIDED:
            text = self.entries[manifest_path] = self.tensor(path, value, None, replicated)
            if self.recorder is not None:
                self._record(path, manifest_path, value, text)
        elif kind in _PRIMITIVES:
            try:
                record = _primitive_record(_PRIMITIVES[kind], value, replicated)
            except ValueError as exc:  # an int too long for str() (sys.get_int_max_str_digits)
                raise _int_too_long(path, value) from exc
            self.entries[manifest_path] = _text(record)
        elif isinstance(value, torch.Tensor) and _is_distributed(value):
            self._not_reusable()
            self.add_distributed(path, manifest_path, value, replicated)
        elif kind is torch.nn.Parameter or (isinstance(value, torch.Tensor) and value.layout is not _STRIDED):
            # A Parameter (its type and requires_grad) and a sparse tensor (COO, CSR, CSC, BSR,
            # BSC) are stored whole with torch.save, which keeps what raw bytes cannot.
            self._not_reusable()
            self.entries[manifest_path] = _text(self.object(path, _whole_tensor(value), replicated))
        elif isinstance(value, torch.Tensor):
            self._not_reusable()
            self.entries[manifest_path] = self.tensor(path, value, None, replicated)
        else:
            self.entries[manifest_path] = _text(self.object(path, value, replicated))

    def add_file(self, rel: str, views: list[Any], bounds: Optional[list[int]] = None) -> None:
        """A file of ``views``, laid out by an earlier plan (PlanCache); ``bounds``: a pack's,
        where its views are runs of several tensors (``Payload.bounds``)."""
        self._files += 1
        self.nbytes += sum(v.nbytes for v in views)
        self._emit(Payload(rel, views, bounds))

    def _record(self, path: str, manifest_path: str, tensor: torch.Tensor, text: str) -> None:
        """Tell the recorder where the plain tensor at ``path``, just planned, went."""
        recorder = self.recorder
        assert recorder is not None
        if not (tensor.is_cpu and tensor.is_contiguous() and tensor.dtype in RAW_DTYPES and tensor.numel()):
            recorder.reusable = False  # planned in full every time: a copy, or torch.save bytes
            return
        recorder.records[path] = text
        recorder.manifest_paths.append(manifest_path)
        recorder.files.setdefault(self._last_rel, []).append(path)

    def _not_reusable(self) -> None:
        if self.recorder is not None:
            self.recorder.reusable = False

    # -- tensors

    def tensor(
        self, path: str, tensor: torch.Tensor, own_rel: Optional[str], replicated: bool, pack: bool = True
    ) -> str:
        """The record (JSON text) of a dense tensor; its bytes go to a pack, or to ``own_rel``
        (default: the file of ``path`` under this rank's directory)."""
        dtype_name = DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise ConfigError(
                f"{path!r}: tensors of dtype {tensor.dtype} cannot be saved in torchsnapshot's format "
                f"(it knows {', '.join(sorted(DTYPE_NAMES.values()))}); convert the tensor in the "
                "state_dict (e.g. .to(torch.float32)) or store it as another type."
            )
        shape = self._shapes.get(tensor.shape)
        if shape is None:
            shape = self._shapes[tensor.shape] = json.dumps(list(tensor.shape))
        raw, view = _tensor_bytes(tensor)
        size = view.nbytes
        if pack and 0 < self.pack_bytes and size < self.pack_bytes:
            start = self._packed(view)
            location, byte_range = self._pack_location, f"[{start}, {start + size}]"
        else:
            rel = own_rel or f"{self.rank}/{_safe(path)}"
            self._own_file(rel, view)
            location, byte_range = _json_str(rel), "null"
        return _tensor_text(location, RAW if raw else TORCH_SAVE, dtype_name, shape, replicated, byte_range)

    def _packed(self, view: Any) -> int:
        """Append ``view`` to the current pack (a new one when it would overflow); its offset there."""
        size = view.nbytes
        pack = self._pack
        if pack is None or self._pack_size + size > self.pack_bytes:
            if pack is not None:
                self._emit(pack)  # full: written while the rest is planned
            pack = self._pack = Payload(f"batched/{self.rank}-{self._files}", [])
            self._files += 1
            self._pack_location = _json_str(pack.rel)
            self._pack_size = 0
        start = self._pack_size
        self._last_rel = pack.rel
        pack.views.append(view)
        self._pack_size = start + size
        self.nbytes += size
        return start

    def _own_file(self, rel: str, view: Any) -> None:
        self._last_rel = rel
        self._files += 1
        self.nbytes += view.nbytes
        self._emit(Payload(rel, [view]))

    # -- objects

    def object(self, path: str, value: Any, replicated: bool) -> dict:
        rel = f"{self.rank}/{_safe(path)}"
        self._own_file(rel, memoryview(_torch_save(value)))
        kind = type(value)
        return {
            "type": "object",
            "location": rel,
            "serializer": TORCH_SAVE,
            "obj_type": f"{kind.__module__}.{kind.__name__}",
            "replicated": replicated,
        }

    # -- ShardedTensor / DTensor

    def add_distributed(self, path: str, manifest_path: str, value: torch.Tensor, replicated: bool) -> None:
        sharded_tensor, _dtensor, _shard = _distributed_types()
        if sharded_tensor is not None and isinstance(value, sharded_tensor):
            self.entries[manifest_path] = _text(self.sharded_tensor(path, value))
        else:
            self.add_dtensor(path, manifest_path, value, replicated)

    def sharded_tensor(self, path: str, value: Any) -> dict:
        shards = []
        for local in value.local_shards():
            offsets = list(local.metadata.shard_offsets)
            rel = _shard_rel(self.rank, path, offsets)
            shards.append(
                {
                    "offsets": offsets,
                    "sizes": list(local.metadata.shard_sizes),
                    "tensor": json.loads(self.tensor(path, local.tensor, rel, False)),
                }
            )
        return {"type": "ShardedTensor", "shards": shards}

    def add_dtensor(self, path: str, manifest_path: str, value: Any, replicated: bool) -> None:
        layout = _dtensor_layout(path, value)
        if layout is None:  # this rank holds no part of it
            return
        group, offsets, sizes, dim_map = layout
        writer = group[zlib.crc32(path.encode()) % len(group)]
        fully_replicated = all(dims == [-1] for dims in dim_map)
        if replicated:  # a replicated value this rank was assigned to write
            writer = self.rank
        elif fully_replicated and writer != self.rank:
            return  # recorded once, by the writer
        rel = _shard_rel(writer, path, offsets)
        if writer == self.rank:
            # a shard no other rank records can be packed; one its replicas point at cannot
            text = self.tensor(path, value.to_local(), rel, False, pack=len(group) == 1 or fully_replicated)
        else:
            text = _pointer_record(rel, value.to_local())
        shards = [{"offsets": offsets, "sizes": sizes, "tensor": json.loads(text)}]
        key = manifest_path if replicated or not fully_replicated else f"0/{path}"
        own = not replicated and not fully_replicated and value.device_mesh.size() > 1
        self.dtensor_record(key, shards, value.device_mesh.mesh.tolist(), dim_map, named=own)

    def dtensor_record(
        self, manifest_path: str, shards: list[dict], mesh: list[Any], dim_map: list[list[int]], named: bool
    ) -> None:
        """Record a DTensor entry; ``named``: its mesh is written in full in this rank's first
        such record and named in the later ones (format/mesh_aliases.py). For a record of this
        rank's own shard on a mesh of several ranks; a replicated value's record (which several
        ranks may make, alike, under ``0/``) holds its mesh in full."""
        if not named:
            text = _text({"type": "DTensor", "shards": shards, "mesh": mesh, "dim_map": dim_map})
        else:
            head = _text({"type": "DTensor", "shards": shards})
            text = f'{head[:-1]}, "mesh": {self._meshes.text(mesh)}, "dim_map": {json.dumps(dim_map)}}}'
        self.entries[manifest_path] = text


def _tensor_text(location: str, serializer: str, dtype: str, shape: str, replicated: bool, byte_range: str) -> str:
    """A tensor's record as JSON text, from the JSON texts of its location, shape and byte range
    (``null`` or ``[start, end]``): what ``_text`` makes of the same record as a dict, formatted
    directly (it is the one record written once per tensor)."""
    return (
        f'{{"type": "Tensor", "location": {location}, "serializer": "{serializer}", "dtype": "{dtype}", '
        f'"shape": {shape}, "replicated": {"true" if replicated else "false"}, "byte_range": {byte_range}}}'
    )


def _pointer_record(rel: str, local: torch.Tensor) -> str:
    """The record of a DTensor shard that another rank of its replica group writes to ``rel``."""
    dtype_name = DTYPE_NAMES.get(local.dtype)
    if dtype_name is None:
        raise ConfigError(f"a DTensor of dtype {local.dtype} cannot be saved in torchsnapshot's format.")
    raw = local.dtype in RAW_DTYPES and local.numel() > 0
    shape = json.dumps(list(local.shape))
    return _tensor_text(_json_str(rel), RAW if raw else TORCH_SAVE, dtype_name, shape, False, "null")


#: (the ranks holding this rank's shard of a DTensor, the shard's offsets, its sizes, dim_map)
_Layout = tuple[list[int], list[int], list[int], list[list[int]]]


def _dtensor_layout(path: str, value: Any) -> Optional[_Layout]:
    """Where this rank's shard of DTensor ``value`` lies, or None when this rank is not in its mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    dim_map: list[list[int]] = [[] for _ in range(value.dim())]
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            dim_map[placement.dim].append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ConfigError(
                f"{path!r}: a DTensor with placement {placement} cannot be saved; redistribute it to "
                "Shard/Replicate placements (e.g. dtensor.redistribute(placements=[Replicate()])) first."
            )
    sharding_mesh_dims = {d for dims in dim_map for d in dims}
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    index = tuple(coordinate[d] if d in sharding_mesh_dims else slice(None) for d in range(mesh.ndim))
    group = sorted(mesh.mesh[index].reshape(-1).tolist())
    return group, list(offsets), list(sizes), [dims or [-1] for dims in dim_map]


def _shard_rel(rank: int, path: str, offsets: Sequence[int]) -> str:
    return f"{rank}/{_safe(path)}/shard_{'_'.join(str(o) for o in offsets)}"


def _tensor_bytes(tensor: torch.Tensor) -> tuple[bool, Any]:
    """(whether the bytes are the tensor's raw memory, rather than its ``torch.save`` bytes; the
    bytes to store, a flat byte buffer that keeps its memory alive)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.dtype in RAW_DTYPES and tensor.numel():
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return True, flat_bytes(tensor)
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes a view's whole storage; save only the view
    return False, memoryview(_torch_save(tensor))


def _whole_tensor(value: torch.Tensor) -> torch.Tensor:
    """A Parameter or sparse tensor as ``torch.save`` should store it: on the CPU, and a
    Parameter that is a view of a larger storage copied (torch.save writes the whole storage)."""
    if type(value) is not torch.nn.Parameter:
        return value if value.is_cpu else value.cpu()
    data = value.detach()
    whole = data.untyped_storage().nbytes() == data.numel() * data.element_size()
    if data.is_cpu and whole:
        return value
    data = data.cpu() if whole else data.cpu().clone()
    return torch.nn.Parameter(data, requires_grad=value.requires_grad)


def _torch_save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _primitive_record(type_name: str, value: Any, replicated: bool) -> dict:
    if type_name == "bytes":
        serialized = base64.b64encode(value).decode("ascii")
    elif type_name == "float":
        serialized = base64.b64encode(struct.pack("d", value)).decode("ascii")
    else:
        serialized = str(value)
    return {
        "type": type_name,
        "serialized_value": serialized,
        "replicated": replicated,
        "readable": str(value) if type_name == "float" else None,
    }


def _int_too_long(path: str, value: int) -> UnrestorableStateError:
    digits = int(value.bit_length() * 0.30103) + 1
    return UnrestorableStateError(
        f"{path!r} holds an int of about {digits} decimal digits, which cannot be saved: the format "
        f"stores an int as its decimal text, which Python makes of at most "
        f"{sys.get_int_max_str_digits()} digits (sys.get_int_max_str_digits()), and restore's "
        "torch.load(weights_only=True) cannot read such an int back pickled either. Store it in the "
        "state_dict as bytes (value.to_bytes((value.bit_length() + 8) // 8, 'little', signed=True), "
        "and int.from_bytes(..., 'little', signed=True) in load_state_dict)"
    )


# --- locations --------------------------------------------------------------------------------

#: Components ``encode`` never produces (its ``%`` is always ``%25`` or ``%2F``), standing in
#: for the ones a filesystem would read as navigation.
_RESERVED_COMPONENTS = {"": "%", ".": "%2E", "..": "%2E%2E"}


def _safe(path: str) -> str:
    """``path`` as a relative file path that stays inside the snapshot directory: no empty,
    ``.`` or ``..`` component, no NUL byte, no component too long for a file name; distinct
    logical paths stay distinct."""
    return "/".join(_safe_component(component) for component in path.split("/"))


def _safe_component(component: str) -> str:
    if component in _RESERVED_COMPONENTS:
        return _RESERVED_COMPONENTS[component]
    if "\x00" in component:
        component = component.replace("\x00", "%00")
    if len(component) * 4 > MAX_COMPONENT_BYTES and len(component.encode()) > MAX_COMPONENT_BYTES:
        digest = hashlib.sha256(component.encode()).hexdigest()[:16]
        head = component.encode()[: MAX_COMPONENT_BYTES // 2].decode(errors="ignore")
        component = f"{head}%~{digest}"
    return component
