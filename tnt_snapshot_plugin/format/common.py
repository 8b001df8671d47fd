"""What the writer and the reader of torchsnapshot's format share.

Manifest paths are ``RANK/KEY/...``: the app-state key and every dict key are encoded so that a
``/`` inside one cannot be taken for the path separator (``%`` -> ``%25``, ``/`` -> ``%2F``), as
torchsnapshot encodes them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any
from urllib.parse import unquote

import torch

#: The manifest file; a snapshot without it is incomplete.
METADATA_FNAME = ".snapshot_metadata"

#: The ``version`` the plugin writes into the metadata: the torchsnapshot release whose format
#: it writes.
FORMAT_VERSION = "0.1.0"


def encode(key: str) -> str:
    """One manifest path component for ``key``."""
    return key.replace("%", "%25").replace("/", "%2F")


def decode(component: str) -> str:
    """The key a manifest path component stands for."""
    return unquote(component)


#: dtype -> its name in the manifest (every dtype torchsnapshot's format knows).
DTYPE_NAMES: dict[torch.dtype, str] = {
    dtype: str(dtype)
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.qint32, torch.qint8, torch.quint8,
    )
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}

#: dtypes stored as their raw bytes (serializer ``buffer_protocol``); every other tensor is
#: stored with ``torch.save`` (serializer ``torch_save``).
RAW_DTYPES: frozenset[torch.dtype] = frozenset(
    (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
)
RAW = "buffer_protocol"
TORCH_SAVE = "torch_save"

#: The primitive types stored inline in the manifest (exact types: a subclass is an object).
PRIMITIVE_TYPES: frozenset[str] = frozenset({"int", "str", "bool", "bytes", "float"})


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat unsigned-byte memoryview over its memory (over a
    contiguous copy if it is not contiguous). Any dtype of RAW_DTYPES, any shape (bfloat16 of an
    odd length, and empty tensors of any rank, included)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    array: Any
    if tensor.dtype is not torch.bfloat16 and tensor.dim() and tensor.numel():
        array = tensor.numpy()  # the faster way, where numpy has the dtype and the shape casts
        return memoryview(array).cast("B")
    array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def memory_of(tensor: torch.Tensor) -> memoryview:
    """A flat, writable unsigned-byte view of a contiguous CPU tensor's memory, zero-copy, about
    1.5 us (``byte_view`` takes 3). It does not keep the tensor alive: the caller must."""
    array = _byte_array_type(tensor.numel() * tensor.element_size()).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")  # ctypes says "<B", which memoryview slices cannot take


@functools.lru_cache(maxsize=4096)
def _byte_array_type(nbytes: int) -> Any:
    return ctypes.c_ubyte * nbytes
