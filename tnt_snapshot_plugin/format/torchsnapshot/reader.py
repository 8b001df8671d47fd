"""The plugin's reader of torchsnapshot's on-disk format.

A snapshot is a directory: ``.snapshot_metadata`` (JSON, or YAML from older torchsnapshot) holds
the manifest, ``{"RANK/KEY/sub/path": ENTRY}``, next to the payload files the entries name.

* :func:`parse_metadata` and :func:`rank_view` come from ``format/manifest.py``, the one reader of
  the metadata: the metadata validated once, and what one rank restores (its own entries, rank 0's
  replicated ones, every sharded entry with the shards of all ranks merged, for resharding).
* :func:`read_state_dict` rebuilds one app-state key's state dict. Tensors are read straight into
  the target's CPU tensors where dtype and shape match (no intermediate buffer); everything else is
  read into new memory and copied or deserialized afterwards. All the bytes of one key are asked
  for in one ``read_into`` call, so an object store can coalesce them into few ranged reads.
* :func:`read_value` reads one entry (or one container) without a target.

What the bytes say is checked before anything is read (locations stay inside the snapshot, byte
ranges match the tensors they hold, dtypes are known): anything wrong with the metadata or the
payloads raises :class:`SnapshotCorruptError` naming the file and the entry. A tensor target whose
dtype differs from the saved one raises :class:`StateMismatchError` naming the entry: the saved
bytes are never reinterpreted or cast. A target whose shape differs gets the saved value, and the
stateful's ``load_state_dict`` reports the mismatch.

Containers are rebuilt as torchsnapshot's ``inflate`` rebuilds them (dicts keep the saved key
order, a dict key that looks like an int also matches the int, lists in index order), so a state
dict read here equals the one torchsnapshot's restore would hand to ``load_state_dict``.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from tnt_snapshot_plugin.errors import SnapshotCorruptError, SnapshotError, UnrestorableStateError
from tnt_snapshot_plugin.format.objects import holds_meta_tensor, load_object, refusal
from tnt_snapshot_plugin.format.torchsnapshot.common import (
    DTYPES_BY_NAME,
    RAW_DTYPES,
    decode,
    encode,
    flat_bytes,
)
from tnt_snapshot_plugin.format.torchsnapshot.inflate import inflate, note_added, subtree
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (
    CONTAINER_TYPES,
    PRIMITIVE_TYPES,
    RAW,
    SHARDED_TYPES,
    TORCH_SAVE,
    Metadata,
    parse_metadata,
    primitive_value,
    rank_view,
    saved_keys,
)
from tnt_snapshot_plugin.format.torchsnapshot.manifest import corrupt as _corrupt
from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import GLOBAL_SHAPE, PartialView, covered
from tnt_snapshot_plugin.format.torchsnapshot.targets import (
    QUANTIZED,
    check_dtype,
    copy_into,
    direct,
    fits,
    sharded_kind,
    takes_in_place,
)

#: (file, offset, destination: a flat writable byte buffer, a numpy array or a memoryview)
Read = tuple[str, int, Any]
#: ``read_into(reads, done=None)``: fills every read (``Store.read_into`` of one snapshot)
ReadInto = Callable[..., None]
FileSize = Callable[[str], Optional[int]]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32})


# ---------------------------------------------------------------------------------------------
# Reading


def _is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's restricted unpickler refusing a type (not damaged bytes)."""
    return (
        isinstance(exc, pickle.UnpicklingError)
        and "weights_only" in str(exc).lower().replace(" ", "_")
        and "Unsupported operand" not in str(exc)
    )


def _flattenable(d: dict) -> bool:
    """Whether torchsnapshot's flatten walks into ``d`` (keys str or int, distinct as strings)."""
    return all(isinstance(k, (str, int)) for k in d) and len({str(k) for k in d}) == len(d)


def _target_tensors(obj: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """The tensors of a state dict by logical path, walked as torchsnapshot's flatten walks it."""
    kind = type(obj)
    if kind is list:
        for i, value in enumerate(obj):
            _target_tensors(value, f"{path}/{i}", out)
    elif (kind is dict or kind is OrderedDict) and _flattenable(obj):
        for key, value in obj.items():
            if type(value) in _PLAIN_TENSORS:  # most values: no call for them
                out[f"{path}/{encode(str(key))}"] = value
            else:
                _target_tensors(value, f"{path}/{encode(str(key))}", out)
    elif isinstance(obj, torch.Tensor):
        out[path] = obj


class _Plan:
    """The reads of one key and what to do once their bytes are in."""

    def __init__(self, what: str, file_size: Optional[FileSize], weights_only: bool) -> None:
        self.what = what  # the key, as messages name it
        self.file_size = file_size
        self.weights_only = weights_only
        self.reads: list[Read] = []
        self.names: list[str] = []  # the entry of each read
        self.after: list[Callable[[], None]] = []  # deserialize and copy, in order
        self.values: dict[str, Any] = {}
        self.uncovered: list[tuple[str, list[int], list[int]]] = []
        self._inside: set[str] = set()

    # -- checks ---------------------------------------------------------------------------

    def corrupt(self, path: str, what: str, rel: Optional[str] = None) -> SnapshotCorruptError:
        where = f"snapshot file {rel!r} (entry {path!r})" if rel else f"entry {path!r}"
        return _corrupt(where, what)

    def location(self, entry: dict, path: str) -> str:
        rel = entry.get("location")
        if type(rel) is not str:
            raise self.corrupt(path, f"its location is {rel!r}")
        if rel in self._inside:
            return rel
        if (
            not rel
            or rel.startswith("/")
            or "\\" in rel
            or "\x00" in rel
            or any(part in ("", ".", "..") for part in rel.split("/"))
        ):
            raise self.corrupt(path, f"its location {rel!r} is outside the snapshot directory")
        self._inside.add(rel)
        return rel

    def dtype(self, entry: dict, path: str) -> torch.dtype:
        dtype = DTYPES_BY_NAME.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise self.corrupt(path, f"unknown dtype {entry.get('dtype')!r}")
        return dtype

    def shape(self, value: Any, path: str, field: str = "shape") -> list:
        if type(value) is not list or not all(type(n) is int and n >= 0 for n in value):
            raise self.corrupt(path, f"its {field} is {value!r}")
        return value

    def span(self, entry: dict, path: str, rel: str, nbytes: Optional[int]) -> tuple[int, int]:
        """(offset, length) of the entry's bytes in ``rel``; ``nbytes``: the length the entry's
        dtype and shape imply (None: not known, the whole file unless a byte range says)."""
        byte_range = entry.get("byte_range")
        if byte_range is None:
            if nbytes is not None:
                return 0, nbytes
            if self.file_size is None:
                raise ValueError(f"reading {path!r} (a whole file of unknown size) needs file_size")
            size = self.file_size(rel)
            if size is None:
                raise self.corrupt(path, "the file is missing", rel)
            return 0, size
        if type(byte_range) is not list or len(byte_range) != 2:
            raise self.corrupt(path, f"its byte range is {byte_range!r}", rel)
        start, end = byte_range
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise self.corrupt(path, f"its byte range is {byte_range!r}", rel)
        if nbytes is not None and end - start != nbytes:
            raise self.corrupt(path, f"its byte range {byte_range} does not hold {nbytes} bytes", rel)
        return start, end - start

    def read(self, rel: str, offset: int, view: Any, path: str) -> None:
        if view.nbytes:
            self.reads.append((rel, offset, view))
            self.names.append(path)

    # -- payloads -------------------------------------------------------------------------

    def raw_into(self, path: str, entry: dict, dst: torch.Tensor) -> None:
        """Read a raw tensor entry straight into ``dst`` (contiguous, CPU, its dtype and shape)."""
        rel = self.location(entry, path)
        start, _ = self.span(entry, path, rel, dst.numel() * dst.element_size())
        if dst.numel():
            self.read(rel, start, flat_bytes(dst), path)

    def payload(self, path: str, entry: dict) -> Callable[[], torch.Tensor]:
        """Read a tensor entry into new memory; returns what gives the tensor once read."""
        serializer = entry.get("serializer")
        dtype = self.dtype(entry, path)
        shape = self.shape(entry.get("shape"), path)
        if serializer == RAW:
            if dtype not in RAW_DTYPES:
                raise self.corrupt(path, f"a {dtype} tensor cannot be stored as raw bytes")
            out = torch.empty(shape, dtype=dtype)
            self.raw_into(path, entry, out)
            return lambda: out
        if serializer != TORCH_SAVE:
            raise self.corrupt(path, f"unknown serializer {serializer!r}")
        rel = self.location(entry, path)
        start, size = self.span(entry, path, rel, None)
        buf = bytearray(size)
        self.read(rel, start, memoryview(buf), path)
        box: list[torch.Tensor] = []

        def load() -> None:
            value = self.unpickle(path, rel, buf)
            if not isinstance(value, torch.Tensor):
                raise self.corrupt(path, f"the payload holds a {type(value).__name__}, not a tensor", rel)
            if value.dtype != dtype or list(value.shape) != shape:
                raise self.corrupt(
                    path, f"the payload holds a {value.dtype} tensor of shape {list(value.shape)}, its entry says "
                    f"{dtype} of shape {shape}", rel,
                )
            box.append(value)

        self.after.append(load)
        return lambda: box[0]

    def unpickle(self, path: str, rel: str, buf: bytearray) -> Any:
        """The object ``buf`` holds; SnapshotCorruptError where it does not load, or holds a
        tensor without data (on the meta device: nothing can be read from it)."""
        try:
            value = load_object(buf, weights_only=self.weights_only)
        except Exception as exc:
            if _is_refusal(exc):
                raise UnrestorableStateError(
                    f"snapshot entry {path!r} holds an object that torch.load(weights_only=True) "
                    f"refuses: {refusal(exc)}. If the type is safe, allow it with "
                    "torch.serialization.add_safe_globals([...]); if you trust this snapshot (you "
                    "wrote it), load it with weights_only=False"
                ) from exc
            raise self.corrupt(path, f"its payload cannot be loaded ({type(exc).__name__}: {exc})", rel) from exc
        if holds_meta_tensor(value):
            raise self.corrupt(path, "its payload holds a tensor on the meta device, which has no data", rel)
        return value

    # -- entries --------------------------------------------------------------------------

    def tensor(self, path: str, entry: dict, target: Any) -> None:
        if target is not None and entry.get("serializer") == RAW:  # the hot path: no copies
            dtype = DTYPES_BY_NAME.get(entry.get("dtype"))  # type: ignore[arg-type]
            if dtype in RAW_DTYPES and direct(target, dtype, entry.get("shape")):  # type: ignore[arg-type]
                # raw_into, with its checks done inline for the common case (a location already
                # checked, a well-formed byte range of the right length): once per tensor
                rel = entry.get("location")
                byte_range = entry.get("byte_range")
                nbytes = target.nbytes
                if (
                    type(rel) is str
                    and rel in self._inside
                    and type(byte_range) is list
                    and len(byte_range) == 2
                    and type(byte_range[0]) is int
                    and type(byte_range[1]) is int
                    and 0 <= byte_range[0]
                    and byte_range[1] - byte_range[0] == nbytes
                ):
                    if nbytes:
                        self.reads.append((rel, byte_range[0], flat_bytes(target)))
                        self.names.append(path)
                else:
                    self.raw_into(path, entry, target)
                self.values[path] = target
                return
        dtype = self.dtype(entry, path)
        shape = self.shape(entry.get("shape"), path)
        check_dtype(path, target, dtype)
        if sharded_kind(target) is not None:  # a whole tensor saved, a sharded one to fill
            self.spread(path, [([0] * len(shape), shape, entry)], dtype, shape, target)
            return
        get = self.payload(path, entry)
        self.settle(path, target, get, dtype, shape)

    def settle(self, path: str, target: Any, get: Callable[[], torch.Tensor], dtype: torch.dtype, shape: list) -> None:
        """The value at ``path``: the target filled from ``get()`` when it takes it in place
        (a GPU, non-contiguous or quantized tensor), else the tensor read."""
        if fits(target, dtype, shape):
            self.after.append(lambda: copy_into(target.detach(), get()))
            self.values[path] = target
        else:
            self.after.append(lambda: self.values.__setitem__(path, get()))

    def object(self, path: str, entry: dict, target: Any = None) -> None:
        rel = self.location(entry, path)
        start, size = self.span(entry, path, rel, None)
        buf = bytearray(size)
        self.read(rel, start, memoryview(buf), path)

        def load() -> None:
            value = self.unpickle(path, rel, buf)
            if takes_in_place(target, value):
                # a Parameter kept in a state dict: filled in place (whatever holds it, an
                # optimizer, keeps the same object), with the saved requires_grad
                check_dtype(path, target, value.dtype)
                target.detach().copy_(value.detach())
                if target.is_leaf and target.requires_grad != value.requires_grad:
                    target.requires_grad_(value.requires_grad)
                value = target
            self.values[path] = value

        self.after.append(load)

    def primitive(self, path: str, entry: dict) -> None:
        self.values[path] = primitive_value(entry, path, self.what)

    def entry(self, path: str, entry: dict, target: Any) -> None:
        kind = entry["type"]
        if kind == "Tensor":
            self.tensor(path, entry, target)
        elif kind in SHARDED_TYPES:
            self.sharded(path, entry, target)
        elif kind == "ChunkedTensor":
            self.chunked(path, entry, target)
        elif kind == "object":
            self.object(path, entry, target)
        elif kind in PRIMITIVE_TYPES:
            self.primitive(path, entry)
        else:
            raise self.corrupt(path, f"unknown entry type {kind!r}")

    # -- running --------------------------------------------------------------------------

    def run(self, read_into: ReadInto, verifier: Any) -> None:
        if self.reads:
            verify = None if verifier is None else _Verify(verifier, self.reads, self.names)
            try:
                if verify is None:
                    read_into(self.reads)
                else:
                    read_into(self.reads, done=verify)
                    verify(range(len(self.reads)))  # what the store did not report done
            except _Mismatch as mismatch:
                raise mismatch.error from None
            except SnapshotCorruptError as exc:
                raise SnapshotCorruptError(f"{exc} (reading {self.entries_of(exc)})") from exc
            except (SnapshotError, ConnectionError):
                raise
            except OSError as exc:
                raise _corrupt(f"snapshot file {exc.filename!r}", f"{exc.strerror or exc} (reading {self.entries_of(exc)})") from exc
        with torch.no_grad():
            for step in self.after:
                step()

    def entries_of(self, exc: BaseException) -> str:
        """The entries whose files ``exc`` names (or all the key's, when it names none)."""
        text = f"{exc} {getattr(exc, 'filename', '')}"
        named = [self.names[i] for i, read in enumerate(self.reads) if read[0] in text]
        if not named:
            return f"the entries of {self.what!r}"
        more = f" and {len(named) - 3} more" if len(named) > 3 else ""
        return "entry " + ", ".join(repr(n) for n in named[:3]) + more

    # -- tensors saved in pieces ---------------------------------------------------------
    # A ChunkedTensor's chunks, a ShardedTensor's or DTensor's shards, read into whatever the
    # state holds: each local shard of a sharded target gets the parts of the saved pieces that
    # overlap it (any resharding); a tensor of the saved dtype and shape is filled whole;
    # anything else gets a new tensor, the whole saved one.

    def chunked(self, path: str, entry: dict, target: Any) -> None:
        dtype = self.dtype(entry, path)
        shape = self.shape(entry.get("shape"), path)
        self.spread(path, self.pieces(path, entry, "chunks"), dtype, shape, target)

    def sharded(self, path: str, entry: dict, target: Any) -> None:
        pieces = self.pieces(path, entry, "shards")
        if not pieces:
            raise self.corrupt(path, "it has no shards")
        saved = entry.get(GLOBAL_SHAPE)  # a view read by rank: the shards of some ranks only
        if saved is not None:
            shape = self.shape(saved, path, GLOBAL_SHAPE)
        else:
            shape = [max(p[0][d] + p[1][d] for p in pieces) for d in range(len(pieces[0][0]))]
        self.spread(path, pieces, self.dtype(pieces[0][2], path), shape, target, partial=saved is not None)

    def spread(
        self, path: str, pieces: list[tuple[list, list, dict]], dtype: torch.dtype, shape: list, target: Any,
        partial: bool = False,
    ) -> None:
        """The tensor of ``shape`` saved in ``pieces`` (chunks or shards) into ``target``: each
        local shard of a ShardedTensor or DTensor of that global shape gets the parts of the
        pieces that overlap it (any resharding); a tensor of the saved dtype and shape is
        filled whole; anything else gets a new tensor (the whole saved one). ``partial``: the
        pieces are some ranks' only (a view read by rank); a region they do not cover goes to
        ``uncovered``."""
        check_dtype(path, target, dtype)
        kind = sharded_kind(target)
        if kind == "ShardedTensor" and list(target.size()) == shape:
            for shard in target.local_shards():
                self.fill(path, shard.tensor.detach(), list(shard.metadata.shard_offsets), pieces, partial)
            self.values[path] = target
            return
        if kind == "DTensor" and list(target.shape) == shape:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offsets = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
            self.fill(path, target.to_local().detach(), list(offsets), pieces, partial)
            self.values[path] = target
            return
        in_place = kind is None and fits(target, dtype, shape)
        if in_place:
            dst = target.detach()
        elif dtype in QUANTIZED:
            raise self.corrupt(path, "a quantized tensor saved in pieces cannot be assembled without a target of its dtype and shape")
        else:
            dst = torch.empty(shape, dtype=dtype)
        self.values[path] = target if in_place else dst
        if dst.dim() == 0 and pieces and len(pieces[0][0]) == 1:
            dst = dst.view(-1)  # torchsnapshot chunks a 0-d tensor as a 1-d one
        self.fill(path, dst, [0] * dst.dim(), pieces, partial)

    def pieces(self, path: str, entry: dict, field: str) -> list[tuple[list, list, dict]]:
        """(offsets, sizes, tensor entry) of each saved piece of a chunked or sharded entry."""
        found = entry.get(field)
        if not isinstance(found, list):
            raise self.corrupt(path, f"its {field} are {found!r}")
        pieces: list[tuple[list, list, dict]] = []
        for piece in found:
            if not isinstance(piece, dict) or not isinstance(piece.get("tensor"), dict):
                raise self.corrupt(path, f"a piece of it is {piece!r}")
            offsets = self.shape(piece.get("offsets"), path, "offsets")
            sizes = self.shape(piece.get("sizes"), path, "sizes")
            if len(offsets) != len(sizes) or (pieces and len(offsets) != len(pieces[0][0])):
                raise self.corrupt(path, "its pieces have different ranks")
            if piece["tensor"].get("shape") != sizes:
                raise self.corrupt(path, f"a piece of sizes {sizes} holds a tensor of shape {piece['tensor'].get('shape')}")
            pieces.append((offsets, sizes, piece["tensor"]))
        return pieces

    def fill(
        self, path: str, dst: torch.Tensor, at: list, pieces: list[tuple[list, list, dict]], partial: bool = False
    ) -> None:
        """Fill ``dst`` (the box of the whole tensor starting at ``at``) from every saved piece
        that overlaps it: straight into ``dst`` where a piece lies whole inside it and the
        region is contiguous CPU memory of the saved dtype; else through the piece read whole.
        ``partial``: unless the pieces cover the box, it goes to ``uncovered`` instead."""
        if pieces and len(pieces[0][0]) != dst.dim():
            raise self.corrupt(path, f"its pieces have {len(pieces[0][0])} dims, the target {dst.dim()}")
        if partial and not covered(((p[0], p[1]) for p in pieces), at, list(dst.shape)):
            self.uncovered.append((path, list(at), list(dst.shape)))
            return
        for offsets, sizes, entry in pieces:
            region = dst
            src_box = []
            whole = True
            for d, (s_at, s_len, d_at, d_len) in enumerate(zip(offsets, sizes, at, dst.shape, strict=True)):
                lo, hi = max(s_at, d_at), min(s_at + s_len, d_at + d_len)
                if hi <= lo:
                    break
                region = region.narrow(d, lo - d_at, hi - lo)
                src_box.append((d, lo - s_at, hi - lo))
                whole = whole and hi - lo == s_len
            else:
                self.fill_region(path, entry, region, src_box, whole)

    def fill_region(self, path: str, entry: dict, region: torch.Tensor, src_box: list, whole: bool) -> None:
        if (
            whole
            and entry.get("serializer") == RAW
            and region.dtype is self.dtype(entry, path)
            and region.device.type == "cpu"
            and region.is_contiguous()
        ):
            self.raw_into(path, entry, region)
            return
        get = self.payload(path, entry)

        def copy() -> None:
            src = get()
            for d, start, length in src_box:
                src = src.narrow(d, start, length)
            copy_into(region, src)

        self.after.append(copy)


class _Mismatch(Exception):
    """A checksum mismatch found while the store was still reading (see _Verify)."""

    def __init__(self, error: SnapshotCorruptError) -> None:
        super().__init__(str(error))
        self.error = error


class _Verify:
    """``read_into``'s ``done``: verifies each read as the store reports it filled, while its
    bytes are still in the CPU caches and the kernel reads ahead; each read once."""

    __slots__ = ("_check_reads", "_verified", "_reads", "_names", "_left")

    def __init__(self, verifier: Any, reads: list[Read], names: list[str]) -> None:
        self._check_reads = verifier.check_reads
        self._verified = verifier.count
        self._reads, self._names = reads, names
        self._left = bytearray(b"\x01") * len(reads)

    def __call__(self, indices: Any) -> None:
        left = self._left
        todo = [i for i in indices if left[i]]
        for i in todo:
            left[i] = 0
        try:  # counted once a batch: the reading threads verify at once
            self._verified(self._check_reads(self._reads, todo, self._names))
        except SnapshotCorruptError as exc:
            raise _Mismatch(exc) from exc


def _read_tree(
    view: dict[str, dict],
    root: str,
    target: Any,
    read_into: ReadInto,
    *,
    verifier: Any,
    weights_only: bool,
    file_size: Optional[FileSize],
    every_sharded: bool,
) -> Any:
    tree = subtree(view, root)
    if root not in tree:
        raise KeyError(f"the snapshot holds no entry {root!r}")
    targets: dict[str, torch.Tensor] = {}
    if target is not None:
        _target_tensors(target, root, targets)
    plan = _Plan(decode(root), file_size, weights_only)
    added: dict[str, list] = {}
    tensor_entry = plan.tensor
    get = targets.get
    for path, entry in tree.items():
        kind = entry["type"]
        if kind == "Tensor":
            tensor_entry(path, entry, get(path))
        elif kind in CONTAINER_TYPES:
            continue
        elif kind in SHARDED_TYPES and not every_sharded:
            if path in targets:  # as torchsnapshot: read only the sharded entries asked for
                plan.entry(path, entry, targets[path])
                note_added(tree, path, added)
        else:
            plan.entry(path, entry, get(path))
    if plan.uncovered:  # a view read by rank lacks shards: nothing was read or filled yet
        raise PartialView(plan.uncovered)
    plan.run(read_into, verifier)
    return inflate(root, tree, plan.values, added)


def read_state_dict(
    view: dict[str, dict],
    key: str,
    target: Any,
    read_into: ReadInto,
    *,
    verifier: Any = None,
    weights_only: bool = True,
    file_size: Optional[FileSize] = None,
) -> Any:
    """The state dict saved under app-state ``key``, read into ``target`` where it can be.

    ``target``: the stateful's current ``state_dict()``; its tensors are filled in place where
    the saved dtype and shape match (CPU ones read straight into, others through a CPU copy);
    ShardedTensor and DTensor targets get the parts of the saved shards that overlap their local
    shards. The returned state dict holds those targets, new tensors for the rest, objects
    (``loading.load_object``), primitives and containers as torchsnapshot rebuilds them.
    ``read_into(reads)``: fills each ``(file, offset, writable bytes)``; called once.
    ``verifier``: a ``checksums.Verifier`` or None. ``file_size(file)``: a file's size or None when
    it is missing; needed for entries stored as a whole file of unknown length (objects,
    ``torch.save``'d tensors).
    """
    return _read_tree(
        view, encode(key), target, read_into,
        verifier=verifier, weights_only=weights_only, file_size=file_size, every_sharded=False,
    )


def read_value(
    view: dict[str, dict],
    path: str,
    read_into: ReadInto,
    *,
    weights_only: bool = True,
    verifier: Any = None,
    file_size: Optional[FileSize] = None,
) -> Any:
    """The value of the entry (or container) at logical ``path``, read without a target; a
    sharded entry gives its whole tensor."""
    return _read_tree(
        view, path, None, read_into,
        verifier=verifier, weights_only=weights_only, file_size=file_size, every_sharded=True,
    )


__all__ = ["Metadata", "parse_metadata", "rank_view", "read_state_dict", "read_value", "saved_keys"]
