"""Restore a snapshot's tensors by reading their bytes straight into the tensors.

torchsnapshot's restore handles every entry with an asyncio task, a thread-pool job, an
intermediate buffer and a tensor built over it, then copies into the module's tensor: about
0.25 ms per entry on the project's machine (2.5 s for 10,000 small tensors) plus a fixed 30-60 ms
per restore. For the entries that make up nearly every training state (a CPU tensor stored as its
raw bytes, ``serializer == "buffer_protocol"``, restored into a contiguous tensor of the same
dtype and shape), the bytes in the file *are* the tensor's memory, so this module reads them with
``preadv`` directly into that memory: no intermediate buffer, one copy from the page cache.

On an object store the same entries are fetched with a few large ranged reads and copied into
the tensors (:func:`fetch_into`).

Everything else (objects, tensors saved with ``torch.save``, chunked or sharded tensors, targets on
a GPU or with another layout) still goes through torchsnapshot's own reader, so the two paths
together read exactly what torchsnapshot alone would. A file shorter than an entry it holds raises
:class:`BadSnapshotFile` (a truncated object too), as does a manifest naming a file outside the
snapshot's directory (the S3 storage plugin refuses those itself).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from . import fileio
from .fileio import READ_AHEAD_BYTES, VERIFY_PIECE_BYTES
from .storage import current_io_concurrency
from .stores.s3 import FETCH_CHUNK_BYTES, FETCH_WORKERS, fetch_ranges

_DIRECT_DTYPES: Optional[dict[torch.dtype, str]] = None


class BadSnapshotFile(RuntimeError):
    """A snapshot file ends before the bytes of an entry it holds, or the manifest names a file
    outside the snapshot's directory."""


def _direct_dtypes() -> dict[torch.dtype, str]:
    """The dtypes torchsnapshot stores as raw bytes, with the name its manifest gives each."""
    global _DIRECT_DTYPES
    if _DIRECT_DTYPES is None:
        from torchsnapshot.serialization import BUFFER_PROTOCOL_SUPPORTED_DTYPES, dtype_to_string

        _DIRECT_DTYPES = {d: dtype_to_string(d) for d in BUFFER_PROTOCOL_SUPPORTED_DTYPES}
    return _DIRECT_DTYPES


def direct_target(entry: Any, target: Any) -> Optional[tuple[str, int, memoryview]]:
    """``(file, offset, writable bytes of target)`` when ``entry`` can be read straight into
    ``target``, else None."""
    from torchsnapshot.manifest import TensorEntry

    if type(entry) is not TensorEntry or entry.serializer != "buffer_protocol":
        return None
    if not isinstance(target, torch.Tensor) or type(target) not in (torch.Tensor, torch.nn.Parameter):
        return None  # ShardedTensor, DTensor and other subclasses keep torchsnapshot's handling
    if (
        target.device.type != "cpu"
        or target.is_quantized
        or not target.is_contiguous()
        or _direct_dtypes().get(target.dtype) != entry.dtype
        or list(target.shape) != list(entry.shape)
    ):
        return None
    nbytes = target.numel() * target.element_size()
    start = 0
    if entry.byte_range is not None:
        start, end = entry.byte_range
        if end - start != nbytes:
            return None  # not what this reader expects: torchsnapshot decides
    if nbytes == 0:
        return entry.location, start, memoryview(b"")
    flat = (target.detach() if target.requires_grad else target).reshape(-1).view(torch.uint8)
    array: Any = flat.numpy()  # shares the tensor's memory
    return entry.location, start, memoryview(array).cast("B")


def read_into(root: str, reads: Iterable[tuple[Any, ...]], verifier: Any = None) -> int:
    """Fill each buffer from ``root/file`` at its offset; return the bytes read.

    ``reads``: ``(file, offset, buffer)`` or ``(file, offset, buffer, entry name)``.
    Reads go file by file in offset order (sequential on disk); the kernel is told ahead of time
    which ranges follow (``POSIX_FADV_WILLNEED``, up to :data:`READ_AHEAD_BYTES` ahead).
    ``verifier`` (a ``checksums.Verifier``): each buffer's bytes are checked as they are read;
    a mismatch raises SnapshotCorruptError naming the file and the entry.
    (``fileio.preadv_into`` does the reading.)
    """
    return fileio.preadv_into(root, reads, error=BadSnapshotFile, verifier=verifier)


def fetch_into(
    fetch: Callable[[str, int, int], bytes], reads: Iterable[tuple[Any, ...]], verifier: Any = None
) -> int:
    """Fill each buffer from an object store: ``fetch(file, start, end)`` returns those bytes.

    Each file's entries are covered by ranged reads of at most :data:`FETCH_CHUNK_BYTES` (the
    small tensors packed into one file come in one read), :data:`FETCH_WORKERS` at a time (or the
    restore's io_concurrency limit, knob_options), and copied into the buffers. Returns the bytes
    fetched. ``reads`` and ``verifier``: as :func:`read_into` (each buffer is checked once its
    bytes are in). (``stores.s3.fetch_ranges`` does the reading.)
    """
    return fetch_ranges(
        fetch,
        reads,
        error=BadSnapshotFile,
        chunk_bytes=FETCH_CHUNK_BYTES,
        workers=current_io_concurrency() or FETCH_WORKERS,
        verifier=verifier,
    )


__all__ = [
    "BadSnapshotFile",
    "FETCH_CHUNK_BYTES",
    "FETCH_WORKERS",
    "READ_AHEAD_BYTES",
    "VERIFY_PIECE_BYTES",
    "direct_target",
    "fetch_into",
    "read_into",
]
