"""Checksums of a snapshot's payload files: computed as they are written, verified as they are read.

The index ``.tnt_snapshot_index.json`` holds, under ``checksums``, one record per payload file
(``{"algo": "xxh3_64", "value": HEX}``, the whole file's digest, as ``tnt-snapshot verify``
checks it), computed by the writer (``writer_job``) from the buffers in hand just before each
file is written. A file of several small tensors packed end to end also gets one digest per
tensor: the reader reads such tensors by byte range, and each range is verified on its own.
They are ``"bounds": [0, end_1, ..., end_n]`` (the tensors lie end to end) and ``"digests"``,
the n hex digests (16 characters each) one after the other: two JSON values a file, where a
list a tensor (``"ranges": [[start, end, HEX], ...]``, an older layout, which is read too)
makes 10,000 small lists to parse, hold and collect.

xxh3_64 (the ``xxhash`` package) hashes faster than google-crc32c at every buffer size that
``benchmarks/checksum_speed.py`` measures, releases the GIL, and takes memoryviews, which
crc32c refuses (a copy per buffer); either is above a disk's bandwidth.

A read whose bytes differ from the record raises :class:`SnapshotCorruptError` naming the file,
the byte range and, where the reader knows it, the entry. Snapshots without checksums (older
ones, torchtnt's) are read unchecked.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import xxhash

from tnt_snapshot_plugin.errors import SnapshotCorruptError
from tnt_snapshot_plugin.stores.fileio import byte_views, is_flat_bytes

ALGO = "xxh3_64"

_digest = xxhash.xxh3_64_hexdigest
#: The hex digest of a buffer, as the records hold it.
digest = _digest


class Streaming:
    """A file's checksum computed piece by piece as it is written: ``update(piece)`` for every
    piece in order, then ``record()``."""

    __slots__ = ("_h", "update")

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.update = self._h.update

    def record(self) -> dict[str, Any]:
        return {"algo": ALGO, "value": self._h.hexdigest()}


def new_hasher() -> Streaming:
    return Streaming()


def record_whole(views: Iterable[Any]) -> dict[str, Any]:
    """The checksum record of one file written as ``views`` one after another (one digest of
    the whole: the views are not packed tensors)."""
    hasher = Streaming()
    for view in views:
        hasher.update(view)
    return hasher.record()


#: The bytes of packed tensors hashed tensor by tensor before they go into the file's digest
#: (well inside a core's L2 cache).
HASH_PIECE = 256 << 10

#: The length of one hex digest in ``"digests"``.
DIGEST_CHARS = 16


def record_views(views: list[Any], bounds: Optional[list[int]] = None) -> dict[str, Any]:
    """The checksum record of a file written as ``views`` (contiguous buffers, each with
    ``nbytes``) end to end: the whole file's digest, and one per tensor when it holds several
    (tensors packed into one file are read, and verified, one by one): one per view, or where
    ``bounds`` is given (the views are runs of tensors end to end), one per tensor, each ending
    where ``bounds`` says (``[0, end_1, ..., end_n]``)."""
    if len(views) == 1 and bounds is None:
        return {"algo": ALGO, "value": _digest(views[0])}
    whole = xxhash.xxh3_64()
    update = whole.update
    digests = []
    if bounds is None:
        bounds = [0]
        offset = 0
        for view in views:
            update(view)
            digests.append(_digest(view))
            offset += view.nbytes
            bounds.append(offset)
    else:
        at = 0  # the tensor that starts the next view
        run_start = 0  # the next view's offset in the file
        for view in views:
            run = memoryview(view)
            run_end = run_start + run.nbytes
            if bounds[at] != run_start:
                raise ValueError(f"a pack's views do not start where its tensors do (byte {run_start})")
            # In pieces of about HASH_PIECE bytes, each hashed on its own (tensor by tensor) and
            # into the whole file's digest while it is still in the CPU's cache: one pass
            # over memory, not two.
            while at < len(bounds) - 1 and bounds[at] < run_end:
                stop = max(at + 1, bisect.bisect_right(bounds, min(bounds[at] + HASH_PIECE, run_end), at) - 1)
                starts = [b - run_start for b in bounds[at:stop]]
                ends = [b - run_start for b in bounds[at + 1:stop + 1]]
                digests.extend(map(_digest, map(run.__getitem__, map(slice, starts, ends))))
                update(run[starts[0]:ends[-1]])
                at = stop
            run_start = run_end
        if at != len(bounds) - 1 or run_start != bounds[-1]:
            raise ValueError(f"a pack's tensors end at byte {bounds[-1]}, its views at {run_start}")
    return {"algo": ALGO, "value": whole.hexdigest(), "bounds": bounds, "digests": "".join(digests)}


def packed_ranges(rec: dict[str, Any]) -> Optional[list[Any]]:
    """A record's per-tensor ranges, ``[(start, end, digest), ...]`` (from either form), or None."""
    bounds, digests = rec.get("bounds"), rec.get("digests")
    if isinstance(bounds, list) and isinstance(digests, str):
        if len(digests) != DIGEST_CHARS * (len(bounds) - 1):
            return None  # a damaged record: the whole file is still checked
        w = DIGEST_CHARS
        return [(bounds[i], bounds[i + 1], digests[i * w:i * w + w]) for i in range(len(bounds) - 1)]
    ranges = rec.get("ranges")
    return ranges if isinstance(ranges, list) else None


class Verifier:
    """Checks bytes read from one snapshot against its index's checksum records (from any
    number of threads at once)."""

    def __init__(self, where: str, records: dict[str, Any], sizes: dict[str, Any]) -> None:
        self.where = where
        self._records: dict[str, tuple[Optional[int], str, list[int], list[tuple[int, int, str]]]] = {}
        #: (file, start, end) -> digest of every whole file and packed tensor: one lookup per read
        self._exact: dict[tuple[str, int, int], str] = {}
        self._raw: dict[str, Any] = {}  # ranges not indexed for sub-range reads yet
        self._raw_lock = threading.Lock()  # the I/O threads index them on first use
        self.add(records, sizes)
        #: bytes verified by this verifier (tests and benchmarks read it)
        self.verified_bytes = 0
        self._count_lock = threading.Lock()  # the stores' reading threads verify at once

    def add(self, records: dict[str, Any], sizes: dict[str, Any]) -> None:
        """Check reads of the files of ``records`` too (a part of the index read later)."""
        exact = self._exact
        with self._raw_lock:  # the I/O threads may be checking reads of files added before
            for rel, rec in records.items():
                if not isinstance(rec, dict) or rec.get("algo") != ALGO or not isinstance(rec.get("value"), str):
                    continue  # another algorithm (or a damaged record): not checked here
                size = sizes.get(rel)
                size = size if isinstance(size, int) else None
                self._records[rel] = (size, rec["value"], [], [])
                if size is not None:
                    exact[rel, 0, size] = rec["value"]
                ranges = packed_ranges(rec)
                if ranges:
                    self._raw[rel] = ranges
                    for r in ranges:
                        exact[rel, r[0], r[1]] = r[2]

    def count(self, nbytes: int) -> None:
        """Add ``nbytes`` to ``verified_bytes`` (for bytes checked with ``count=False``)."""
        if nbytes:
            with self._count_lock:
                self.verified_bytes += nbytes

    def check(self, rel: str, start: int, data: Any, entry: Optional[str] = None, *, count: bool = True) -> int:
        """Verify ``data``, the bytes of file ``rel`` from offset ``start``; the bytes verified.

        The whole file is checked against its record; a byte range against the records of the
        packed tensors it covers entirely. Raises SnapshotCorruptError on a mismatch.
        ``count``: add them to ``verified_bytes`` (a caller checking many reads at once may
        add them up itself, then :meth:`count` them once).
        """
        found = self._records.get(rel)
        if found is None:
            return 0
        view = byte_views((data,))[0]  # a flat uint8 numpy array (the reader's) is kept as it is
        end = start + view.nbytes
        expected = self._exact.get((rel, start, end))
        if expected is not None:  # a whole file or one packed tensor
            if _digest(view) != expected:
                self._fail(rel, start, end, entry)
            verified = view.nbytes
        else:
            size, value, starts, ranges = self._indexed(rel)
            if start == 0 and (size is None or end == size):
                if _digest(view) != value:
                    self._fail(rel, 0, end, entry)
                verified = view.nbytes
            else:
                verified = 0
                i = bisect.bisect_left(starts, start)
                while i < len(ranges) and ranges[i][1] <= end:
                    lower, upper, expected = ranges[i]
                    if _digest(view[lower - start:upper - start]) != expected:
                        self._fail(rel, lower, upper, entry)
                    verified += upper - lower
                    i += 1
        if count:
            self.count(verified)
        return verified

    def check_reads(self, reads: Sequence[tuple[str, int, Any]], indices: Iterable[int], names: Sequence[str]) -> int:
        """:meth:`check` each of ``reads[i]`` (``(file, offset, bytes)``, read for entry
        ``names[i]``) for ``i`` in ``indices``, without counting; the bytes verified.

        The reader's common read, a flat ``uint8`` numpy array that is exactly one packed tensor
        or whole file, takes a path of one lookup and one digest (half the time of ``check``'s,
        about 0.5 us a read: 10,000 small tensors are 10,000 reads); anything else goes through
        :meth:`check`."""
        exact, digest, check = self._exact, _digest, self.check
        verified = 0
        for i in indices:
            rel, start, data = reads[i]
            if is_flat_bytes(data):
                end = start + data.nbytes
                expected = exact.get((rel, start, end))
                if expected is not None:
                    if digest(data) != expected:
                        self._fail(rel, start, end, names[i])
                    verified += end - start
                    continue
            verified += check(rel, start, data, entry=names[i], count=False)
        return verified

    def _indexed(self, rel: str) -> tuple[Optional[int], str, list[int], list[tuple[int, int, str]]]:
        """The record of ``rel`` with its packed ranges sorted (built at the first read of a
        range that is not exactly one payload: reads of several packed tensors at once)."""
        with self._raw_lock:  # another thread reading meanwhile waits for the whole index
            raw = self._raw.pop(rel, None)
            if raw is not None:
                size, value, _, _ = self._records[rel]
                ranges = sorted((int(r[0]), int(r[1]), str(r[2])) for r in raw if len(r) == 3)
                self._records[rel] = (size, value, [r[0] for r in ranges], ranges)
            return self._records[rel]

    def _fail(self, rel: str, start: int, end: int, entry: Optional[str]) -> None:
        what = f" (entry {entry})" if entry else ""
        raise SnapshotCorruptError(
            f"{self.where}/{rel}{what}: bytes {start}-{end} do not match the {ALGO} checksum "
            "recorded when the snapshot was written: the file is damaged. Restore an older "
            "snapshot (restore_from_latest falls back to one by itself)"
        )


def mismatch(where: str, rel: str) -> SnapshotCorruptError:
    """The error of file ``rel`` of snapshot ``where`` whose bytes differ from their record."""
    return SnapshotCorruptError(
        f"{where}/{rel}: its bytes do not match the {ALGO} checksum recorded when the snapshot was "
        "written: the file is damaged. Restore an older snapshot (restore_from_latest falls back to "
        "one by itself)"
    )


def check_file(where: str, rel: str, index: Any, data: Any) -> None:
    """Check ``data``, the whole of file ``rel`` of snapshot ``where``, against the checksum
    record ``index`` (the snapshot's parsed index) holds for it; a file without one (or an
    index that is not a JSON object) is not checked. Raises SnapshotCorruptError on a mismatch."""
    records = index.get("checksums") if isinstance(index, dict) else None
    record = records.get(rel) if isinstance(records, dict) else None
    if isinstance(record, dict):
        Verifier(where, {rel: record}, {}).check(rel, 0, data)


__all__ = [
    "ALGO", "Verifier", "check_file", "digest", "mismatch", "new_hasher", "packed_ranges", "record_views", "record_whole",
]
