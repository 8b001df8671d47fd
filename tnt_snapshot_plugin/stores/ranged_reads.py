"""Ranged reads from object stores: filling many destination buffers from a few byte-range requests.

:func:`fetch_ranges` groups the reads of a restore by file, covers each file's buffers with ranged
requests of at most ``FETCH_CHUNK_BYTES`` (the small tensors packed into one file come in one
request), runs them on a few threads and copies the bytes into place. The S3 and fsspec stores
supply the one request (``fetch(file, start, end)``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from tnt_snapshot_plugin.errors import SnapshotCorruptError

#: Reads: at most this many bytes per ranged request, and this many requests at once.
FETCH_CHUNK_BYTES = 32 * 1024 * 1024
FETCH_WORKERS = 4


def fetch_ranges(
    fetch: Callable[[str, int, int], bytes],
    reads: Iterable[tuple[Any, ...]],
    *,
    error: type[Exception],
    chunk_bytes: int = FETCH_CHUNK_BYTES,
    workers: int = FETCH_WORKERS,
) -> int:
    """Fill each buffer from an object store: ``fetch(file, start, end)`` returns those bytes.

    ``reads``: ``(file, offset, buffer)``. Each file's
    buffers are covered by ranged reads of at most ``chunk_bytes`` (the small tensors packed into
    one file come in one read), ``workers`` at a time, and copied into the buffers. A range that
    comes back short raises ``error`` naming the file. Returns the bytes fetched.
    """
    from concurrent.futures import ThreadPoolExecutor

    by_file: dict[str, list[tuple[int, memoryview]]] = {}
    for location, offset, buf in reads:
        if buf.nbytes:
            by_file.setdefault(location, []).append((offset, buf))
    jobs: list[tuple[str, int, int, list[tuple[int, memoryview]]]] = []
    for location, items in sorted(by_file.items()):
        items.sort(key=lambda item: item[0])
        start = items[0][0]
        end = max(offset + buf.nbytes for offset, buf in items)
        for lower in range(start, end, chunk_bytes):
            upper = min(end, lower + chunk_bytes)
            inside = [(o, b) for o, b in items if o < upper and o + b.nbytes > lower]
            if inside:
                jobs.append((location, lower, upper, inside))

    def one(job: tuple[str, int, int, list[tuple[int, memoryview]]]) -> int:
        location, lower, upper, items = job
        data = memoryview(fetch(location, lower, upper))
        if data.nbytes < upper - lower:
            raise error(
                f"{location} ends at byte {lower + data.nbytes}, before the end of the entries it "
                f"holds (byte {upper}): the object is truncated"
            )
        for offset, buf in items:
            a, b = max(offset, lower), min(offset + buf.nbytes, upper)
            buf[a - offset:b - offset] = data[a - lower:b - lower]
        return upper - lower

    if not jobs:
        return 0
    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="tnt-snapshot-fetch") as pool:
        return sum(pool.map(one, jobs))


def read_ranges(
    fetch: Callable[[str, int, int], bytes],
    reads: Sequence[Any],
    done: Optional[Callable[[list[int]], None]] = None,
    concurrency: Optional[int] = None,
) -> None:
    """``Store.read_into`` for a store whose one request is ``fetch(rel, start, end)`` (S3,
    fsspec): the reads filled by :func:`fetch_ranges`, all reported done at the end (the ranged
    reads land in any order, on worker threads)."""
    fetch_ranges(fetch, reads, error=SnapshotCorruptError, workers=concurrency or FETCH_WORKERS)
    if done is not None:
        done(list(range(len(reads))))
