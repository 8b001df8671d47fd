#!/usr/bin/env python
"""What checksums cost: durable save and cold restore of one state, with and without them, in one
process, interleaved (on, off, off, on, ...), medians.

    python benchmarks/checksum_cost.py                     # 1 GiB (64 x 16 MiB) and 10,000 x 4 KiB
    python benchmarks/checksum_cost.py --states 1GiB --reps 5
    python benchmarks/checksum_cost.py --count 2000 --tensor-kib 64    # any other state
    python benchmarks/checksum_cost.py --states 1GiB --format dcp      # the snapshots in DCP's format

Where the checksums are computed: on the write side in ``saving.payloads.write_one``,
a file of one payload through a ``new_hasher()`` fed each piece just before it is written, a file
of packed tensors by ``record_views`` just before (and the metadata at commit); on the read side
``checksums.Verifier.check_reads`` (``check`` for each read but the common one), called as each
batch of reads lands (``format.reader`` through the store's
``read_into(..., done=)``): on local disk on the reading threads, several at once, overlapping
the other files' reads.

"off" is the same saver and the same restore with those two steps replaced, in this benchmark
only: ``payloads.record_views`` returns a record of no algorithm and ``payloads.new_hasher`` a
hasher that hashes nothing (the files are written in the same pieces), and restore then finds no record of its algorithm to check (nothing checked).
"on" is the plugin as shipped, with those calls timed (wall time inside them, summed over the I/O
and reading threads: CPU spent, not time added, when they overlap other threads' I/O).

``--format dcp`` takes the same snapshots in DCP's format (``SnapshotConfig(format="dcp")``): its
writer hands the writer job the same payloads (one view a record), so the same two steps are
timed or replaced, and its reader verifies through the same ``Verifier.check_reads``.

Reported per state: durable and restore medians on and off; what checksums add to each (the
difference of the medians, and the time inside the checksum calls) as a share of the time without
them; the CPU time each adds. Snapshots are synchronous (the durable time is the write itself);
restores are cold (the snapshot's pages dropped from the page cache first, as in run.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import evict, median, settle_garbage  # noqa: E402

MiB = 1024 * 1024

#: label -> (tensor count, fp32 elements per tensor)
STATES = {
    "1GiB": (64, 4 * MiB),  # 64 x 16 MiB
    "10k": (10_000, 1024),  # 10,000 x 4 KiB
}


def make_model(count: int, numel: int, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for i in range(count):
        model.register_buffer(f"p{i}", torch.randn(numel, generator=gen))
    return model


class _Timer:
    """Wall seconds spent inside the checksum calls (summed over threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.write_s = 0.0
        self.read_s = 0.0

    def reset(self) -> None:
        self.write_s = self.read_s = 0.0


@contextlib.contextmanager
def checksums_mode(on: bool, timer: _Timer) -> Iterator[None]:
    """The plugin with its checksum steps timed (on) or replaced by nothing (off)."""
    from tnt_snapshot_plugin.format import checksums
    from tnt_snapshot_plugin.saving import payloads  # where the writers hash

    # Fail loudly if the engine moves its checksum calls: this benchmark would measure nothing.
    assert callable(getattr(payloads, "record_views", None)), "payloads.record_views is gone"
    assert callable(getattr(payloads, "new_hasher", None)), "payloads.new_hasher is gone"
    real_record = payloads.record_views
    real_new_hasher = payloads.new_hasher
    real_check_reads = checksums.Verifier.check_reads
    if on:
        perf = time.perf_counter

        def timed_record(views: Any, bounds: Any = None) -> Any:
            t = perf()
            try:
                return real_record(views, bounds)
            finally:
                elapsed = perf() - t
                with timer.lock:
                    timer.write_s += elapsed

        def timed_check_reads(self: Any, reads: Any, indices: Any, names: Any) -> int:
            t = perf()
            try:
                return real_check_reads(self, reads, indices, names)
            finally:
                elapsed = perf() - t
                with timer.lock:  # the reading threads verify several files at once
                    timer.read_s += elapsed

        class TimedHasher:
            """The hasher a one-payload file is fed to as it is written, timed."""

            def __init__(self) -> None:
                self._h = real_new_hasher()

            def update(self, piece: Any) -> None:
                t = perf()
                self._h.update(piece)
                elapsed = perf() - t
                with timer.lock:
                    timer.write_s += elapsed

            def record(self) -> Any:
                return self._h.record()

        payloads.record_views = timed_record
        payloads.new_hasher = TimedHasher
        checksums.Verifier.check_reads = timed_check_reads  # type: ignore[method-assign]
    else:

        class NoHash:
            def update(self, piece: Any) -> None:
                pass

            def record(self) -> Any:
                return {"algo": "none", "value": ""}

        payloads.record_views = lambda views, bounds=None: {"algo": "none", "value": ""}
        payloads.new_hasher = NoHash
    try:
        yield
    finally:
        payloads.record_views = real_record
        payloads.new_hasher = real_new_hasher
        checksums.Verifier.check_reads = real_check_reads  # type: ignore[method-assign]


def cpu_seconds() -> float:
    usage = os.times()
    return usage.user + usage.system


def checksum_cost(
    model: torch.nn.Module, target: torch.nn.Module, reps: int, workdir: Optional[str] = None, log: Any = None,
    format: str = "torchsnapshot",
) -> dict[str, Any]:
    """Durable save of ``model`` and cold restore into ``target`` (same shapes), with and without
    checksums, ``reps`` rounds after one warm-up round, snapshots in ``format``; medians and
    shares (see module doc)."""
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore

    sources = list(model.state_dict().values())
    targets = list(target.state_dict().values())
    timer = _Timer()
    root = tempfile.mkdtemp(prefix="checksum_cost.", dir=workdir)
    keys = ("durable", "restore", "hash_write", "hash_read", "save_cpu", "restore_cpu")
    samples: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in ("on", "off")}
    try:
        for rep in range(reps + 1):  # the first round warms up
            for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                dirpath = os.path.join(root, f"{name}{rep}")
                with checksums_mode(name == "on", timer):
                    saver = Snapshotter(
                        dirpath,
                        SnapshotConfig.build(
                            async_snapshot=False, save_on_train_end=False, preemption_signals=[], format=format,
                        ),
                    )
                    saver.train_start(["model"], 0, 0)
                    timer.reset()
                    settle_garbage()
                    cpu = cpu_seconds()
                    started = time.perf_counter()
                    saver.save(0, 1, {"model": model})
                    durable = time.perf_counter() - started
                    save_cpu = cpu_seconds() - cpu
                    saver.train_end(0, 1, lambda intra_epoch: {})
                    path = saver.stats.committed[-1].path
                    with torch.no_grad():
                        for t in targets:
                            t.zero_()
                    evict(path)
                    settle_garbage()
                    cpu = cpu_seconds()
                    started = time.perf_counter()
                    restore(path, {"model": target})
                    restored = time.perf_counter() - started
                    restore_cpu = cpu_seconds() - cpu
                if not all(torch.equal(a, b) for a, b in zip(sources, targets, strict=True)):
                    raise AssertionError(f"checksums {name}: the restore gave back other values")
                if rep > 0:
                    s = samples[name]
                    s["durable"].append(durable)
                    s["restore"].append(restored)
                    s["hash_write"].append(timer.write_s)
                    s["hash_read"].append(timer.read_s)
                    s["save_cpu"].append(save_cpu)
                    s["restore_cpu"].append(restore_cpu)
                shutil.rmtree(dirpath)
                if log is not None:
                    print(
                        f"    checksums {name} ({format}): durable {durable:.3f}s (hashing {timer.write_s:.3f}s), "
                        f"restore {restored:.3f}s (verifying {timer.read_s:.3f}s)",
                        file=log, flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    on = {k: median(v) for k, v in samples["on"].items()}
    off = {k: median(v) for k, v in samples["off"].items()}
    return {
        "format": format,
        "tensors": len(sources),
        "state_bytes": sum(t.numel() * t.element_size() for t in sources),
        "reps": reps,
        "on": on,
        "off": off,
        # what checksums add, as a share of the time without them
        "durable_added": (on["durable"] - off["durable"]) / off["durable"],
        "restore_added": (on["restore"] - off["restore"]) / off["restore"],
        # the time inside the checksum calls, as a share of the time with them (the write side's
        # is summed over the I/O threads: an upper bound of what it adds to the wall time)
        "durable_hashing": on["hash_write"] / on["durable"],
        "restore_verifying": on["hash_read"] / on["restore"],
        "save_cpu_added": (on["save_cpu"] - off["save_cpu"]) / off["durable"],
        "restore_cpu_added": (on["restore_cpu"] - off["restore_cpu"]) / off["restore"],
        "samples": samples,
    }


def describe(label: str, r: dict[str, Any]) -> str:
    on, off = r["on"], r["off"]
    return (
        f"{label}, medians of {r['reps']}:\n"
        f"  durable: on {on['durable']:.3f}s, off {off['durable']:.3f}s: checksums add "
        f"{r['durable_added']:+.1%}; time inside record_views {on['hash_write']:.3f}s = "
        f"{r['durable_hashing']:.1%} of durable; CPU time added {r['save_cpu_added']:+.1%} of durable\n"
        f"  restore (cold): on {on['restore']:.3f}s, off {off['restore']:.3f}s: checksums add "
        f"{r['restore_added']:+.1%}; time inside Verifier.check_reads {on['hash_read']:.3f}s = "
        f"{r['restore_verifying']:.1%} of restore; CPU time added {r['restore_cpu_added']:+.1%} of restore"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--states", nargs="*", default=list(STATES), choices=list(STATES))
    parser.add_argument("--count", type=int, default=None, help="instead: this many tensors of --tensor-kib")
    parser.add_argument("--tensor-kib", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--format", default="torchsnapshot", choices=("torchsnapshot", "dcp"),
                        help="the snapshots' on-disk format")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    if args.count is not None and args.tensor_kib is not None:
        states = {f"{args.count} x {args.tensor_kib} KiB": (args.count, args.tensor_kib * 256)}
    else:
        states = {k: STATES[k] for k in args.states}
    results = {}
    for label, (count, numel) in states.items():
        print(f"{label}: {count} x {numel * 4 // 1024} KiB", flush=True)
        model, target = make_model(count, numel, 0), make_model(count, numel, 1)
        results[label] = checksum_cost(model, target, args.reps, args.dir, log=sys.stdout, format=args.format)
        del model, target
        print(describe(f"{label} ({args.format})", results[label]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
