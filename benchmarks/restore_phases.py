#!/usr/bin/env python
"""Cold restores of this plugin against torch.load and Lightning, the plugin's time split by phase.

    python benchmarks/restore_phases.py                          # 8 MiB (8 x 1 MiB), 20 rounds
    python benchmarks/restore_phases.py --count 16 --shape 1024 1024 --rounds 10    # 64 MiB
    python benchmarks/restore_phases.py --no-read-ahead          # restore's read-ahead hint off

The rows of run.py (``methods.py``): this plugin's torchtnt saver, asynchronous and synchronous
(each written snapshot restored with ``TorchSnapshotSaver.restore``), ``torch.load(mmap=True)``
and Lightning's ``save_checkpoint``/``load_checkpoint``, on one state, in one process (a
single-process gloo group). Each restores its newest snapshot once per round, rounds in
rotated order, the snapshot's pages dropped from the page cache before each (as in run.py).
Printed: each row's median, its ratio to the fastest peer's median of the same run, and the
medians of the plugin's restore phases (``restoring.request._Restore``): ``resolve`` (the
index and metadata read and checked, the payloads' read-ahead started), ``check`` (what to load
against what the snapshot holds), ``read`` (payload reads, each verified against its checksum
as it lands), ``load`` (``load_state_dict``); ``other`` is the rest of the call (the adapter,
the collectives). ``--no-read-ahead`` replaces ``LocalStore.read_ahead`` with nothing, for a
side-by-side of the hint's effect (run it after a plain run: the page cache and the disk drift).
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import methods  # noqa: E402
from measure import evict  # noqa: E402
from run import StateSpec, init_process_group, make_model  # noqa: E402

PHASES = ("resolve", "check", "read", "load")


def timed_phases(times: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap the restore's phases with timers appending to ``times``; the returned call unwraps."""
    from tnt_snapshot_plugin.restoring import request

    originals = {name: getattr(request._Restore, name) for name in (*PHASES, "run")}

    def wrap(name: str, fn: Any) -> Any:
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t)

        return timed

    for name, fn in originals.items():
        setattr(request._Restore, name, wrap(name, fn))

    def unwrap() -> None:
        for name, fn in originals.items():
            setattr(request._Restore, name, fn)

    return unwrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--shape", type=int, nargs="+", default=[512, 512])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-read-ahead", action="store_true")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    init_process_group()
    if args.no_read_ahead:
        from tnt_snapshot_plugin.stores.local import LocalStore

        LocalStore.read_ahead = lambda self, name, files: None  # type: ignore[method-assign]
    spec = StateSpec("state", args.count, tuple(args.shape), reps=1)
    model, target = make_model(spec, 0), make_model(spec, 1)
    peers = ("torch.save", "Lightning ModelCheckpoint")
    rows = [methods.PluginSaver(True), methods.PluginSaver(False)]
    rows += [m for m in methods.all_methods() if any(p in m.name for p in peers)]
    root = tempfile.mkdtemp(prefix="restore_phases.", dir=args.dir)
    samples: dict[str, list[float]] = {m.name: [] for m in rows}
    phases: dict[str, dict[str, list[float]]] = {m.name: {} for m in rows if not m.peer}
    try:
        paths = []
        for i, m in enumerate(rows):
            os.makedirs(os.path.join(root, str(i)))
            m.setup(os.path.join(root, str(i)), model, target)
            m.save(1)
            paths.append(m.save(2)[2])
        for round_ in range(args.rounds + 1):  # round 0 warms up
            turn = round_ % len(rows)
            pairs = list(zip(rows, paths, strict=True))
            for m, path in pairs[turn:] + pairs[:turn]:
                times: dict[str, list[float]] = {}
                unwrap = timed_phases(times) if not m.peer else (lambda: None)
                evict(path)
                t = time.perf_counter()
                try:
                    m.restore(path)
                finally:
                    unwrap()
                if round_:
                    samples[m.name].append(time.perf_counter() - t)
                    for name, ts in times.items():
                        phases[m.name].setdefault(name, []).append(sum(ts))
        for m in rows:
            m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(ts) for name, ts in samples.items()}
    best = min(med[m.name] for m in rows if m.peer)
    print(f"{args.count} x {'x'.join(map(str, args.shape))} fp32 ({spec.nbytes / 2**20:.0f} MiB), {args.rounds} rounds, "
          "cold page cache"
          f"{', read-ahead off' if args.no_read_ahead else ''}\n")
    print("| method | restore (median) | x fastest peer | resolve | check | read | load | other |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        cells = ["", "", "", "", ""]
        if not m.peer:
            ph = {name: statistics.median(ts) for name, ts in phases[m.name].items()}
            other = med[m.name] - sum(ph.get(p, 0.0) for p in PHASES)
            cells = [f"{ph.get(p, 0.0) * 1e3:.2f} ms" for p in PHASES] + [f"{other * 1e3:.2f} ms"]
        print(f"| {m.name} | {med[m.name] * 1e3:.2f} ms | {med[m.name] / best:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
