#!/usr/bin/env python
"""How ``tnt-snapshot ls`` and ``inspect`` scale with a snapshot's entries, against the metadata
parse restore makes, side by side in one process.

    python benchmarks/cli_entries.py                 # 300,000 entries, 3 rounds
    python benchmarks/cli_entries.py --entries 50000

Writes one snapshot of N small tensors with the plugin (synchronous), then times, each round:
``format.manifest.parse_metadata`` (restore's parse of ``.snapshot_metadata``), ``verify.check``
(what restore_from_latest checks before it restores: index, sizes, metadata), ``tnt-snapshot ls``
(which also checks the checksums of the snapshot it marks, as the restore reads them) and
``tnt-snapshot inspect`` (every entry printed), both in-process with output to /dev/null. Prints
the medians and each command's ratio to the parse and to the check.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch


def write_snapshot(root: str, entries: int) -> str:
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter

    class Holder:
        def __init__(self) -> None:
            self.state = {f"t{i}": torch.full((4,), float(i)) for i in range(entries)}

        def state_dict(self) -> dict[str, Any]:
            return self.state

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = state

    holder = Holder()
    saver = Snapshotter(root, SnapshotConfig.build(async_snapshot=False, save_on_train_end=False, preemption_signals=[]))
    saver.train_start(["m"], 0, 0)
    saver.save(0, 1, lambda: {"m": holder})
    saver.wait()
    saver.train_end(0, 1, lambda intra_epoch: {})
    [name] = [n for n in os.listdir(root) if n.startswith("epoch_")]
    return name


def timed(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cli(*args: str) -> None:
    from tnt_snapshot_plugin.cli import main

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        code = main(list(args))
    assert code == 0, (args, code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the snapshot (default: a temporary directory)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from tnt_snapshot_plugin.format import verify
    from tnt_snapshot_plugin.format.torchsnapshot import manifest
    from tnt_snapshot_plugin.stores import LocalStore

    root = tempfile.mkdtemp(prefix="cli_entries.", dir=args.dir)
    try:
        name = write_snapshot(root, args.entries)
        snapshot = os.path.join(root, name)
        with open(os.path.join(snapshot, ".snapshot_metadata"), "rb") as f:
            data = f.read()
        store = LocalStore(root)
        figures = {
            "parse (restore)": timed(lambda: manifest.parse_metadata(data, snapshot), args.rounds),
            "verify.check (restore_from_latest)": timed(lambda: verify.check(store, name), args.rounds),
            "tnt-snapshot ls": timed(lambda: cli("ls", root), args.rounds),
            "tnt-snapshot inspect": timed(lambda: cli("inspect", snapshot), args.rounds),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    parse, check = figures["parse (restore)"], figures["verify.check (restore_from_latest)"]
    print(f"{args.entries} entries, {len(data) / 1e6:.1f} MB of metadata; medians of {args.rounds} rounds")
    print(f"{'':38} {'seconds':>8} {'x parse':>8} {'x check':>8}")
    for what, seconds in figures.items():
        print(f"{what:38} {seconds:8.2f} {seconds / parse:8.2f} {seconds / check:8.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
