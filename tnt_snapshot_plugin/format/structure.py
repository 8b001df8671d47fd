"""Whether a manifest's pieces form its tensors: integer arithmetic on the metadata alone, before
any byte is read or any memory is allocated for a claimed size. No torch.

* :func:`tiling_problem`: the pieces of one tensor (a ChunkedTensor's chunks, the shards of a
  ShardedTensor or DTensor over every rank) lie inside its shape, do not overlap, and cover it
  exactly. Identical pieces (the replicas of a DTensor shard, recorded by each rank of a replica
  group) count once. A sweep along the dimension with the most distinct offsets keeps the check
  O(n log n) for tensors sharded along one dimension.
* :func:`overlap_problem`: the byte ranges read from one file do not overlap, except where
  several records name the same replica's bytes.

Each returns what is wrong in a few words, or None.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

#: Element counts, dimension sizes, offsets and byte positions fit in a signed 64-bit integer
#: (what torch and the file APIs take).
MAX_INT64 = (1 << 63) - 1

#: A piece of a tensor: (offsets, sizes), one of each per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(sizes: Iterable[int]) -> int:
    """The number of elements of a box (or a shape) of ``sizes``."""
    n = 1
    for size in sizes:
        n *= size
    return n


def tiling_problem(shape: Sequence[int], boxes: Iterable[Box], name: str, *, exact: bool = True) -> Optional[str]:
    """What keeps ``boxes`` (``name``: "chunks", "shards") from tiling ``shape``, or None.

    ``exact``: they must cover every element; else (the pieces of some ranks only) they must lie
    inside the shape without overlapping."""
    ndim = len(shape)
    unique = sorted(set(boxes))  # a replica group's identical shards count once
    total = 0
    for offsets, sizes in unique:
        if len(offsets) != ndim or len(sizes) != ndim:
            return f"one of its {name} has {len(sizes)} dimensions, its shape {list(shape)} has {ndim}"
        for o, n, d in zip(offsets, sizes, shape, strict=True):
            if o + n > d:
                return f"one of its {name} (at {list(offsets)}, of sizes {list(sizes)}) lies outside its shape {list(shape)}"
        total += volume(sizes)
    whole = volume(shape)
    if total > whole:
        return f"its {name} hold {total} elements, more than the {whole} of its shape {list(shape)}: some overlap"
    found = _overlap(unique, ndim)
    if found is not None:
        a, b = found
        return (
            f"two of its {name} overlap (at {list(a[0])}, of sizes {list(a[1])}; at {list(b[0])}, "
            f"of sizes {list(b[1])})"
        )
    if exact and total < whole:
        return f"its {name} hold {total} of the {whole} elements of its shape {list(shape)}: some are missing"
    return None


def _overlap(boxes: list[Box], ndim: int) -> Optional[tuple[Box, Box]]:
    """Two of ``boxes`` (distinct) that share an element, or None."""
    live = [box for box in boxes if all(box[1])]  # an empty box holds no element
    if len(live) < 2 or ndim == 0:
        return None
    # sweep along the dimension the pieces are cut along most: one live box at a time there for
    # a tensor sharded along one dimension
    dim = max(range(ndim), key=lambda d: len({box[0][d] for box in live}))
    live.sort(key=lambda box: box[0][dim])
    active: list[Box] = []
    for box in live:
        start = box[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        for other in active:
            if all(
                max(o1, o2) < min(o1 + n1, o2 + n2)
                for o1, n1, o2, n2 in zip(other[0], other[1], box[0], box[1], strict=True)
            ):
                return other, box
        active.append(box)
    return None


#: A byte range read from a file: (start, end, the record that reads it, what the bytes are:
#: None for a record of its own, else the identity of a replica's piece that several records
#: may name).
Span = tuple[int, int, str, Any]


def overlap_problem(rel: str, spans: list[Span]) -> Optional[str]:
    """What is wrong with the byte ranges ``spans`` read from file ``rel`` (two records reading
    overlapping bytes), or None. Sorts ``spans`` in place."""
    spans.sort(key=lambda span: (span[0], span[1]))
    reach, last = -1, None  # the furthest end so far, and the span that reaches it
    for span in spans:
        start, end, _path, what = span
        if start == end:
            continue  # an empty tensor's range holds no byte
        if last is not None and start < reach:
            same = what is not None and what == last[3] and (start, end) == (last[0], last[1])
            if not same:
                return (
                    f"entries {last[2]!r} and {span[2]!r} read overlapping bytes of file {rel} "
                    f"({last[0]}-{_end(last[1])} and {start}-{_end(end)})"
                )
            continue
        if end > reach:
            reach, last = end, span
    return None


#: The end of a span that reads a whole file (of a length the metadata does not say).
WHOLE_FILE = MAX_INT64 + 1


def _end(end: int) -> str:
    return "the end" if end == WHOLE_FILE else str(end)


__all__ = ["MAX_INT64", "WHOLE_FILE", "overlap_problem", "tiling_problem", "volume"]
