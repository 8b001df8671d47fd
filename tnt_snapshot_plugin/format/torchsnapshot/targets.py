"""What a restore target takes: whether a saved tensor goes straight into the state's own tensor
(same dtype and shape, contiguous CPU memory), is copied into it, or is handed over as read; and
the dtype check that never lets saved bytes be cast."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tnt_snapshot_plugin.errors import StateMismatchError

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
STRIDED = torch.strided
QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32})


def sharded_kind(target: Any) -> Optional[str]:
    """"ShardedTensor" or "DTensor" for such a target, else None."""
    if target is None or type(target) in PLAIN_TENSORS:
        return None
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(target, ShardedTensor):
        return "ShardedTensor"
    if isinstance(target, DTensor):
        return "DTensor"
    return None


def takes_in_place(target: Any, value: Any) -> bool:
    """Whether a tensor read whole (an object entry: a Parameter) goes into ``target`` in place."""
    return (
        isinstance(value, torch.Tensor)
        and type(target) in PLAIN_TENSORS
        and value.layout is STRIDED
        and target.layout is STRIDED
        and target.shape == value.shape
        and sharded_kind(value) is None
    )


def check_dtype(path: str, target: Any, dtype: torch.dtype) -> None:
    """StateMismatchError if ``target`` is a tensor of another dtype than the saved ``dtype``: the
    saved bytes are never cast (a quantized tensor saved may fill a float target: dequantized)."""
    if isinstance(target, torch.Tensor) and target.dtype != dtype and dtype not in QUANTIZED:
        raise StateMismatchError(
            f"entry {path!r}: the snapshot holds a {dtype} tensor, the state to restore into a "
            f"{target.dtype} one; the snapshot's values are not cast. Restore into a state of the "
            "saved dtypes (convert after restoring), or check the snapshot: a dtype that "
            "contradicts the state may mean its metadata is damaged"
        )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a quantized source whose scheme the destination cannot take as is
    (another scheme or dtype, or a view into a larger tensor) is dequantized first."""
    if src.is_quantized and (
        not dst.is_quantized or dst.qscheme() != src.qscheme() or dst.dtype != src.dtype or dst._is_view()
    ):
        src = src.dequantize()
    dst.copy_(src)


def fits(target: Any, dtype: torch.dtype, shape: list) -> bool:
    """Whether a tensor target takes the saved tensor in place (same dtype and shape)."""
    return (
        isinstance(target, torch.Tensor)
        and sharded_kind(target) is None
        and target.dtype == dtype
        and list(target.shape) == shape
    )


def direct(target: Any, dtype: torch.dtype, shape: list) -> bool:
    """Whether the saved raw bytes can be read straight into the target's memory."""
    return (
        target is not None
        and type(target) in PLAIN_TENSORS
        and target.dtype is dtype
        and target.layout is STRIDED
        and target.is_cpu
        and target.is_contiguous()
        and list(target.shape) == shape
    )
