#!/usr/bin/env python
"""What checksums cost: durable save and cold restore of one state, with and without them, in one
process, interleaved (on, off, on, off, ...), medians. Also the time spent computing checksums
inside each save (summed over every payload and I/O thread), as a ratio to that save's durable
time, and the time to hash the whole state in memory against the restore time.

    python benchmarks/checksum_cost.py                  # 1 GiB (64 x 16 MiB), 3 reps
    python benchmarks/checksum_cost.py --size-mib 64 --reps 5
    python benchmarks/checksum_cost.py --count 10000 --tensor-kib 4   # many small tensors

"off" is the same code with the checksum step replaced by nothing: the files are written in the
same pieces without hashing them and without a record, and restore reads without a verifier. Restores are cold: the snapshot's pages are
dropped from the page cache first (measure.evict), as in benchmarks/run.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import evict, median  # noqa: E402

from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, checksums, fileio, restore, storage  # noqa: E402


def make_model(count: int, numel: int, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for i in range(count):
        model.register_buffer(f"p{i}", torch.randn(numel, generator=gen))
    return model


hash_seconds = [0.0]


@contextlib.contextmanager
def mode(on: bool) -> Iterator[None]:
    real_record, real_from_index = checksums.record, checksums.Verifier.from_index
    real_write, real_new_hasher = storage._write_and_sum, checksums.new_hasher

    def timed_hasher() -> Any:
        hasher = real_new_hasher()
        update = hasher.update

        def timed_update(data: Any) -> None:
            started = time.perf_counter()
            update(data)
            hash_seconds[0] += time.perf_counter() - started

        hasher.update = timed_update
        return hasher

    def timed_record(buf: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_record(buf)
        finally:
            hash_seconds[0] += time.perf_counter() - started

    class NoHash:  # the same 1 MiB pieces as with checksums, nothing computed
        fed = 0

        def update(self, data: Any) -> None:
            pass

    def write_only(path: str, data: Any) -> None:
        fileio.hashing.hasher = None if isinstance(data, storage.Gathered) else NoHash()
        try:
            storage._write_durably(path, data)
        finally:
            fileio.hashing.hasher = None

    if on:
        checksums.record = timed_record
        checksums.new_hasher = timed_hasher
    else:
        storage._write_and_sum = write_only
        checksums.Verifier.from_index = classmethod(lambda cls, where, index: None)  # type: ignore[assignment]
    try:
        yield
    finally:
        checksums.record = real_record
        checksums.new_hasher = real_new_hasher
        checksums.Verifier.from_index = real_from_index  # type: ignore[method-assign]
        storage._write_and_sum = real_write


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--count", type=int, default=None, help="this many tensors of --tensor-kib")
    parser.add_argument("--tensor-kib", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.count is not None and args.tensor_kib is not None:
        count, numel = args.count, args.tensor_kib * 1024 // 4
        args.size_mib = count * args.tensor_kib // 1024
        label = f"{count} x {args.tensor_kib} KiB"
    else:
        count = args.size_mib // args.tensor_mib
        numel = args.tensor_mib * 1024 * 1024 // 4
        label = f"{count} x {args.tensor_mib} MiB"

    model = make_model(count, numel, 0)
    target = make_model(count, numel, 1)
    root = tempfile.mkdtemp(prefix="checksum_cost.", dir=args.dir)
    results: dict[str, dict[str, list[float]]] = {
        "on": {"durable": [], "restore": [], "hash": [], "save_cpu": [], "restore_cpu": []},
        "off": {"durable": [], "restore": [], "hash": [], "save_cpu": [], "restore_cpu": []},
    }
    try:
        for rep in range(args.reps + 1):  # the first round warms up
            for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                dirpath = os.path.join(root, f"{name}{rep}")
                with mode(name == "on"):
                    saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False, save_on_train_end=False))
                    saver.train_start(["model"], 0, 0)
                    hash_seconds[0] = 0.0
                    cpu = cpu_seconds()
                    started = time.perf_counter()
                    saver.save(0, 1, {"model": model})
                    durable = time.perf_counter() - started
                    save_cpu = cpu_seconds() - cpu
                    hashed = hash_seconds[0]
                    saver.train_end(0, 1, lambda intra_epoch: {})
                    path = os.path.join(dirpath, "epoch_0_step_1")
                    evict(path)
                    cpu = cpu_seconds()
                    started = time.perf_counter()
                    restore(path, {"model": target})
                    restored = time.perf_counter() - started
                    restore_cpu = cpu_seconds() - cpu
                for key, value in state_pairs(model, target):
                    assert torch.equal(value, target.get_buffer(key))
                if rep > 0:
                    results[name]["durable"].append(durable)
                    results[name]["restore"].append(restored)
                    results[name]["hash"].append(hashed)
                    results[name]["save_cpu"].append(save_cpu)
                    results[name]["restore_cpu"].append(restore_cpu)
                shutil.rmtree(dirpath)
                print(f"rep {rep} {name}: durable {durable:.3f}s (hashing {hashed:.3f}s), restore {restored:.3f}s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    on, off = results["on"], results["off"]
    gib = args.size_mib / 1024
    print(f"\n{args.size_mib} MiB ({label}), medians of {args.reps}:")
    print(f"  durable: on {median(on['durable']):.3f}s, off {median(off['durable']):.3f}s, "
          f"ratio {median(on['durable']) / median(off['durable']):.3f}")
    extra_save = median(on["save_cpu"]) - median(off["save_cpu"])
    extra_restore = median(on["restore_cpu"]) - median(off["restore_cpu"])
    print(f"  CPU time of the save (process, all threads): on {median(on['save_cpu']):.3f}s, "
          f"off {median(off['save_cpu']):.3f}s: checksums add {extra_save:.3f}s = "
          f"{extra_save / median(off['durable']):.1%} of durable")
    print(f"  CPU time of the restore: on {median(on['restore_cpu']):.3f}s, off "
          f"{median(off['restore_cpu']):.3f}s: verifying adds {extra_restore:.3f}s = "
          f"{extra_restore / median(off['restore']):.1%} of restore")
    print(f"  (wall time inside the hash calls of a save, summed over I/O threads, memory stalls "
          f"included: {median(on['hash']):.3f}s)")
    print(f"  restore (cold): on {median(on['restore']):.3f}s, off {median(off['restore']):.3f}s, "
          f"ratio {median(on['restore']) / median(off['restore']):.3f}")
    buf = torch.ones(args.size_mib * 1024 * 1024, dtype=torch.uint8)  # touched: no page faults timed
    view = memoryview(buf.numpy())
    import xxhash

    started = time.perf_counter()
    for lower in range(0, len(view), 2 * 1024 * 1024):
        xxhash.xxh3_64(view[lower:lower + 2 * 1024 * 1024]).hexdigest()
    hashing = time.perf_counter() - started
    print(f"  xxh3_64 over the state in memory (2 MiB pieces): {hashing:.3f}s ({gib / hashing:.1f} GiB/s) = "
          f"{hashing / median(off['restore']):.1%} of restore without checksums")


def cpu_seconds() -> float:
    usage = os.times()
    return usage.user + usage.system


def state_pairs(model: torch.nn.Module, target: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_buffers()


if __name__ == "__main__":
    main()
