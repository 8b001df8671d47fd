"""Tensors saved in pieces (a ChunkedTensor's chunks, a ShardedTensor's or DTensor's shards) read
into whatever the state holds now: each local shard of a sharded target gets the parts of the
saved pieces that overlap it (any resharding); a tensor of the saved dtype and shape is filled
whole; anything else gets a new tensor, the whole saved one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.format.torchsnapshot.manifest import RAW
from tnt_snapshot_plugin.format.torchsnapshot.rank_regions import GLOBAL_SHAPE, covered
from tnt_snapshot_plugin.format.torchsnapshot.targets import (
    QUANTIZED,
    check_dtype,
    copy_into,
    fits,
    sharded_kind,
)


class PiecesMixin:
    """The part of a key's read plan (``reader._Plan``) that reads chunked and sharded entries."""

    values: dict[str, Any]
    after: list[Any]
    #: (path, offsets, sizes) of each region of a partial view's target no shard read covers
    uncovered: list[tuple[str, list[int], list[int]]]

    if TYPE_CHECKING:  # provided by reader._Plan
        def corrupt(self, path: str, what: str, rel: Optional[str] = None) -> SnapshotCorruptError: ...
        def dtype(self, entry: dict, path: str) -> torch.dtype: ...
        def shape(self, value: Any, path: str, field: str = "shape") -> list: ...
        def raw_into(self, path: str, entry: dict, dst: torch.Tensor) -> None: ...
        def payload(self, path: str, entry: dict) -> Callable[[], torch.Tensor]: ...

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
