"""Measuring instruments: peak RSS, page-cache eviction, fsync of a tree, and the physical floors.

Peak extra memory
    Linux keeps a per-process high-water mark of the resident set (``VmHWM`` in
    ``/proc/self/status``). Writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
    RSS. After a method is set up (its imports and framework objects are not the snapshot's)
    and before its first snapshot, the benchmark collects garbage, returns freed heap to the OS
    (``malloc_trim``), records ``VmRSS`` and resets the mark; after its last snapshot (warm-up
    included) is durable it reads ``VmHWM``. Peak extra memory = ``VmHWM - VmRSS(before)``: every byte the
    method had resident at its worst moment beyond the state itself, including buffers it keeps
    from one snapshot to the next (a staging copy allocated by the first snapshot counts). The
    page cache is not part of RSS, so buffered writes are not charged. Where ``clear_refs`` is
    not writable, a thread samples ``VmRSS`` every millisecond instead (``method`` in the JSON says
    which was used).

Garbage
    Before every timed call (a snapshot or a restore, of every method) the benchmark collects
    garbage, untimed (``settle_garbage``), as ``timeit`` switches the collector off while it
    times. Without it, a full collection of the benchmark's heap (about 140 ms at 10,000
    entries, where each restore leaves ~55,000 objects in the oldest generation, the plugin's and
    ``torch.load``'s alike) falls on whichever call tips the collector's threshold: in some
    rounds and not others, for a debt the earlier calls ran up. A timed call still pays for
    the full collections its own allocations set off; ``FullCollections`` counts those, and the
    JSON reports the count per method (``full_gc_in_saves``, ``full_gc_in_restores``).

Cold restore
    Before every restore the benchmark evicts the snapshot's files from the page cache with
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` (files are clean: they were fsynced), so each restore
    reads from the disk, as after a crash or on a new host.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import re
import threading
import time
from typing import Callable, Optional

import torch

MiB = 1024 * 1024


# ------------------------------------------------------------------------------------------------
# garbage


def settle_garbage() -> None:
    """Collect garbage before a timed call, untimed: it starts with no debt of earlier calls."""
    gc.collect()


class FullCollections:
    """Counts the collections of the oldest generation (full ones) inside ``with`` blocks."""

    def __init__(self) -> None:
        self.count = 0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation") == 2:
            self.count += 1

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


# ------------------------------------------------------------------------------------------------
# memory


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def rss() -> int:
    return _status("VmRSS")


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS means live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmHWM") > 0
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory above the RSS at ``start()``, until ``stop()``."""

    def __init__(self) -> None:
        self.method = "VmHWM reset via /proc/self/clear_refs" if _can_reset_hwm() else "1 ms sampler"
        self._base = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        release_free_memory()
        self._base = rss()
        self._peak = self._base
        if self.method.startswith("VmHWM"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, rss())

    def stop(self) -> int:
        """Peak extra bytes since start()."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            peak = max(self._peak, rss())
        else:
            peak = _status("VmHWM")
        return max(0, peak - self._base)


# ------------------------------------------------------------------------------------------------
# files


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for parent, _dirs, files in os.walk(path):
        out.extend(os.path.join(parent, f) for f in files)
    return out


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories, as a careful caller of a non-durable
    writer would have to (torch.save, torchsnapshot and Lightning do not fsync)."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [path] if os.path.isdir(path) else [os.path.dirname(path)]
    for parent, subdirs, _files in os.walk(dirs[0]):
        dirs.extend(os.path.join(parent, d) for d in subdirs)
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: str) -> None:
    """Drop the (clean) pages of every file under ``path`` from the page cache."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


# ------------------------------------------------------------------------------------------------
# floors


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def copy_floor(tensors: list[torch.Tensor], reps: int) -> dict[str, float]:
    """The stall floor: copying the state into preallocated buffers already touched once.

    ``tensors_s``: one ``torch._foreach_copy_`` of every tensor into a same-shaped buffer (what
    any staging copy must at least do); ``flat_s``: one memcpy of the same number of bytes.
    """
    buffers = [torch.empty_like(t) for t in tensors]
    torch._foreach_copy_(buffers, tensors)  # first touch
    tensors_s = median(timed(lambda: torch._foreach_copy_(buffers, tensors), reps))
    buffers.clear()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.copy_(a)
    flat_s = median(timed(lambda: b.copy_(a), reps))
    return {"tensors_s": tensors_s, "flat_s": flat_s}


def disk_floor(directory: str, nbytes: int, reps: int, chunk: int = 16 * MiB) -> dict[str, float]:
    """Sequential write-then-fsync and cold sequential read bandwidth of ``directory``'s disk.

    Writes ``nbytes`` (rounded up to whole ``chunk``s) in ``chunk``-sized ``write`` calls from one
    buffer, two ways: buffered then ``fsync`` (what checkpointers do) and ``O_DIRECT`` (the device
    without the page cache); the faster one is the write floor. The read evicts the file from the
    page cache, then ``readinto`` a preallocated buffer. Bytes per second, medians.
    """
    chunks = max(1, -(-nbytes // chunk))
    total = chunks * chunk
    # an anonymous mapping is page aligned, as O_DIRECT requires
    mapping = mmap.mmap(-1, chunk)
    view = memoryview(mapping)
    view[:] = b"\x01" * chunk
    path = os.path.join(directory, "disk_floor.bin")
    results: dict[str, list[float]] = {"buffered": [], "direct": [], "read": []}

    def write(direct: bool) -> float:
        if os.path.exists(path):
            os.remove(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        t = time.perf_counter()
        fd = os.open(path, flags, 0o644)
        try:
            for _ in range(chunks):
                os.write(fd, view)
            os.fsync(fd)
        finally:
            os.close(fd)
        return total / (time.perf_counter() - t)

    for _ in range(reps):
        results["buffered"].append(write(False))
        if hasattr(os, "O_DIRECT"):
            try:
                results["direct"].append(write(True))
            except OSError:
                pass
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        t = time.perf_counter()
        with os.fdopen(fd, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
        results["read"].append(total / (time.perf_counter() - t))
    os.remove(path)
    view.release()
    mapping.close()
    out = {
        "write_buffered_fsync_Bps": median(results["buffered"]),
        "write_direct_Bps": median(results["direct"]) if results["direct"] else 0.0,
        "read_cold_Bps": median(results["read"]),
        "bytes": float(total),
    }
    out["write_Bps"] = max(out["write_buffered_fsync_Bps"], out["write_direct_Bps"])
    return out
