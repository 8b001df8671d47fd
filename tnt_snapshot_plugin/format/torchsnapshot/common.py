"""What the writer and the reader of torchsnapshot's format share.

Manifest paths are ``RANK/KEY/...``: the app-state key and every dict key are encoded so that a
``/`` inside one cannot be taken for the path separator (``%`` -> ``%25``, ``/`` -> ``%2F``), as
torchsnapshot encodes them.
"""

from __future__ import annotations

from typing import Any, Optional
from urllib.parse import unquote

import numpy as np
import torch

from tnt_snapshot_plugin.format.registry import BUILTIN_METADATA

#: The manifest file; a snapshot without it is incomplete.
METADATA_FNAME = BUILTIN_METADATA["torchsnapshot"]

#: The ``version`` the plugin writes into the metadata: the torchsnapshot release whose format
#: it writes.
FORMAT_VERSION = "0.1.0"


def encode(key: str) -> str:
    """One manifest path component for ``key``."""
    return key.replace("%", "%25").replace("/", "%2F")


def decode(component: str) -> str:
    """The key a manifest path component stands for."""
    return unquote(component)


# The dtype table's one home is format/torchsnapshot/manifest.py (names and element sizes, read
# without torch); the torch dtypes here are those names looked up.
from tnt_snapshot_plugin.format.torchsnapshot.manifest import (  # noqa: E402
    DTYPE_SIZES,
    PRIMITIVE_TYPES,
    RAW,
    RAW_DTYPE_NAMES,
    TORCH_SAVE,
)

#: name in the manifest -> dtype (every dtype torchsnapshot's format knows).
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: getattr(torch, name[len("torch."):]) for name in DTYPE_SIZES}
#: dtype -> its name in the manifest.
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}
#: dtypes stored as their raw bytes (serializer ``buffer_protocol``); every other tensor is
#: stored with ``torch.save`` (serializer ``torch_save``).
RAW_DTYPES: frozenset[torch.dtype] = frozenset(DTYPES_BY_NAME[name] for name in RAW_DTYPE_NAMES)
__all__ = [
    "DTYPES_BY_NAME", "DTYPE_NAMES", "DTYPE_SIZES", "FORMAT_VERSION", "METADATA_FNAME", "PRIMITIVES",
    "PRIMITIVE_TYPES", "RAW", "RAW_DTYPES", "RAW_DTYPE_NAMES", "TORCH_SAVE", "decode", "encode",
    "flat_bytes", "tensor_nbytes",
]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take."""
    return tensor.numel() * tensor.element_size()


def flat_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor of RAW_DTYPES (not empty) as a flat ``uint8`` numpy
    array over its memory, zero-copy and writable, about 1 us; the array keeps the tensor's
    memory alive.

    The writer holds one such buffer per tensor until the tensor is written, the reader one per
    tensor it reads into. A numpy array is not tracked by Python's garbage collector (the tensor
    object numpy keeps as its base is: one tracked object a tensor), where the ctypes view this
    replaced was three (a ctypes array, a memoryview and its buffer): held by the 10,000, they
    set off a full collection of the training process's heap in most snapshots (about 70 ms
    here, benchmarks/profile_entries.py)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: its bytes as uint8
        tensor = tensor.reshape(-1).view(torch.uint8)
    array = tensor.numpy()
    if array.ndim != 1:
        array = array.reshape(-1)
    return array.view(_UINT8)


_UINT8 = np.dtype(np.uint8)


#: Tensors stored as themselves (a subclass, ShardedTensor or DTensor, is told apart).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
#: The Python types stored inline in the manifest, and their manifest type names.
PRIMITIVES = {int: "int", str: "str", bool: "bool", bytes: "bytes", float: "float"}


def is_distributed(value: torch.Tensor) -> bool:
    sharded_tensor, dtensor, _shard = distributed_types()
    return (sharded_tensor is not None and isinstance(value, sharded_tensor)) or (
        dtensor is not None and isinstance(value, dtensor)
    )


_DISTRIBUTED_TYPES: Optional[tuple[Any, Any, Any]] = None


def distributed_types() -> tuple[Any, Any, Any]:
    """(ShardedTensor, DTensor, Shard placement), or Nones where torch.distributed is missing;
    imported on first use (only states holding tensor subclasses pay for it)."""
    global _DISTRIBUTED_TYPES
    if _DISTRIBUTED_TYPES is None:
        if torch.distributed.is_available():
            from torch.distributed._shard.sharded_tensor import ShardedTensor
            from torch.distributed.tensor import DTensor, Shard

            _DISTRIBUTED_TYPES = (ShardedTensor, DTensor, Shard)
        else:
            _DISTRIBUTED_TYPES = (None, None, None)
    return _DISTRIBUTED_TYPES
