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

import os
from typing import Any, Callable, Iterable, Optional

import torch

from .storage import current_io_concurrency, is_inside

#: Keep about this many bytes of upcoming reads announced to the kernel (``WILLNEED``), so the
#: disk reads ahead while earlier entries are being copied, without flooding the page cache.
READ_AHEAD_BYTES = 256 * 1024 * 1024

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


#: With checksums, a payload is read and hashed in pieces of this size, each hashed while it is
#: still in the CPU's cache.
VERIFY_PIECE_BYTES = 2 * 1024 * 1024


def read_into(root: str, reads: Iterable[tuple[Any, ...]], verifier: Any = None) -> int:
    """Fill each buffer from ``root/file`` at its offset; return the bytes read.

    ``reads``: ``(file, offset, buffer)`` or ``(file, offset, buffer, entry name)``.
    Reads go file by file in offset order (sequential on disk); the kernel is told ahead of time
    which ranges follow (``POSIX_FADV_WILLNEED``, up to :data:`READ_AHEAD_BYTES` ahead).
    ``verifier`` (a ``checksums.Verifier``): each buffer's bytes are checked as they are read;
    a mismatch raises SnapshotCorruptError naming the file and the entry.
    """
    by_file: dict[str, list[tuple[int, memoryview, Optional[str]]]] = {}
    for location, offset, buf, *name in reads:
        by_file.setdefault(location, []).append((offset, buf, name[0] if name else None))
    for location in by_file:
        if not is_inside(root, location):
            raise BadSnapshotFile(
                f"the manifest of {root} names the file {location!r}, outside the snapshot: "
                "the snapshot is damaged or was not written by torchsnapshot"
            )
    plan = [(loc, sorted(items, key=lambda item: item[0])) for loc, items in sorted(by_file.items())]

    fds: dict[str, int] = {}
    advise = getattr(os, "posix_fadvise", None)
    ahead = 0  # index in plan of the next file not announced yet
    announced = 0  # bytes announced and not read yet
    total = 0
    try:
        for i, (location, items) in enumerate(plan):
            while advise is not None and ahead < len(plan) and (ahead <= i or announced < READ_AHEAD_BYTES):
                loc, its = plan[ahead]
                fd = fds[loc] = os.open(os.path.join(root, loc), os.O_RDONLY | os.O_CLOEXEC)
                first, last = its[0][0], its[-1][0] + its[-1][1].nbytes
                advise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
                announced += last - first
                ahead += 1
            if location not in fds:
                fds[location] = os.open(os.path.join(root, location), os.O_RDONLY | os.O_CLOEXEC)
            fd = fds[location]
            for offset, buf, entry in items:
                got = 0
                size = buf.nbytes
                stream = (
                    verifier.streaming(location, offset, size)
                    if verifier is not None and size > VERIFY_PIECE_BYTES
                    else None
                )
                piece = VERIFY_PIECE_BYTES if stream is not None else size
                while got < size:
                    n = os.preadv(fd, [buf[got:got + piece]], offset + got)
                    if n == 0:
                        raise BadSnapshotFile(
                            f"{os.path.join(root, location)} ends at byte {offset + got}, before the "
                            f"end of an entry it holds (bytes {offset}-{offset + size}): the file "
                            "is truncated"
                        )
                    if stream is not None:
                        stream[0].update(buf[got:got + n])
                    got += n
                if stream is not None:
                    verifier.finish(location, offset, size, *stream, entry=entry)
                elif verifier is not None:
                    verifier.check(location, offset, buf, entry=entry)
                total += size
                announced -= size
            os.close(fds.pop(location))
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


#: Object-store reads: at most this many bytes per ranged GET, and this many GETs at once.
FETCH_CHUNK_BYTES = 32 * 1024 * 1024
FETCH_WORKERS = 4


def fetch_into(
    fetch: Callable[[str, int, int], bytes], reads: Iterable[tuple[Any, ...]], verifier: Any = None
) -> int:
    """Fill each buffer from an object store: ``fetch(file, start, end)`` returns those bytes.

    Each file's entries are covered by ranged reads of at most :data:`FETCH_CHUNK_BYTES` (the
    small tensors packed into one file come in one read), :data:`FETCH_WORKERS` at a time, and
    copied into the buffers. Returns the bytes fetched. ``reads`` and ``verifier``: as
    :func:`read_into` (each buffer is checked once its bytes are in).
    """
    from concurrent.futures import ThreadPoolExecutor

    by_file: dict[str, list[tuple[int, memoryview]]] = {}
    names: dict[tuple[str, int], Optional[str]] = {}
    for location, offset, buf, *name in reads:
        if buf.nbytes:
            by_file.setdefault(location, []).append((offset, buf))
            names[location, offset] = name[0] if name else None
    jobs: list[tuple[str, int, int, list[tuple[int, memoryview]]]] = []
    for location, items in sorted(by_file.items()):
        items.sort(key=lambda item: item[0])
        start = items[0][0]
        end = max(offset + buf.nbytes for offset, buf in items)
        for lower in range(start, end, FETCH_CHUNK_BYTES):
            upper = min(end, lower + FETCH_CHUNK_BYTES)
            inside = [(o, b) for o, b in items if o < upper and o + b.nbytes > lower]
            if inside:
                jobs.append((location, lower, upper, inside))

    def one(job: tuple[str, int, int, list[tuple[int, memoryview]]]) -> int:
        location, lower, upper, items = job
        data = memoryview(fetch(location, lower, upper))
        if data.nbytes < upper - lower:
            raise BadSnapshotFile(
                f"{location} ends at byte {lower + data.nbytes}, before the end of the entries it "
                f"holds (byte {upper}): the object is truncated"
            )
        for offset, buf in items:
            a, b = max(offset, lower), min(offset + buf.nbytes, upper)
            buf[a - offset:b - offset] = data[a - lower:b - lower]
        return upper - lower

    if not jobs:
        return 0
    # At most FETCH_WORKERS GETs in flight, or the restore's io_concurrency limit (knob_options).
    workers = min(current_io_concurrency() or FETCH_WORKERS, len(jobs))
    with ThreadPoolExecutor(workers, thread_name_prefix="tnt-snapshot-fetch") as pool:
        fetched = sum(pool.map(one, jobs))
    if verifier is not None:
        for location, items in by_file.items():
            for offset, buf in items:
                verifier.check(location, offset, buf, entry=names[location, offset])
    return fetched


__all__ = [
    "BadSnapshotFile",
    "FETCH_CHUNK_BYTES",
    "FETCH_WORKERS",
    "READ_AHEAD_BYTES",
    "direct_target",
    "fetch_into",
    "read_into",
]
