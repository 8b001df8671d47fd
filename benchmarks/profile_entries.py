#!/usr/bin/env python
"""Where the plugin's time goes on a state of many small tensors: cProfile of the asynchronous
snapshot's stall, the synchronous snapshot (the write itself, to durable) and the cold restore.

    python benchmarks/profile_entries.py                       # 10,000 x 4 KiB, 3 rounds
    python benchmarks/profile_entries.py --count 2000 --top 40 --phases restore
    python benchmarks/profile_entries.py --dump /tmp/prof      # also save .prof files (snakeviz, pstats)
    python benchmarks/profile_entries.py --format dcp          # the snapshots in DCP's format
    py-spy record --idle --threads -f raw -o sync.txt -- \\
        python benchmarks/profile_entries.py --top 0 --phases sync --rounds 10

Each phase runs once to warm up, then ``--rounds`` times under one ``cProfile.Profile`` (the
calling thread only: the synchronous snapshot's payload files are written by the saver's I/O
threads, whose time shows here as the wait in ``concurrent.futures``; ``--io-threads 1`` writes
them on the calling thread, so that cProfile sees them). Printed: wall time per round, then the
functions with the most own time and the most cumulative time, as a share of the phase's time.
cProfile's cost per Python call inflates code that runs once per entry several times over (a
0.9 us call measured 9 us): for shares, prefer a sampling profiler (py-spy, above; ``--top 0``
times the phases without cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import evict  # noqa: E402

PHASES = ("stall", "sync", "restore")


def make_model(count: int, numel: int, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for i in range(count):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(numel, generator=gen), requires_grad=False))
    return model


def profiled(
    label: str, fn: Callable[[], Any], rounds: int, top: int, dump: Any, before: Callable[[], Any] = lambda: None
) -> None:
    """Profile ``rounds`` calls of ``fn`` after one warm-up; ``before`` runs ahead of each, unprofiled."""
    before()
    fn()  # warm-up
    prof = cProfile.Profile()
    walls = []
    for _ in range(rounds):
        before()
        t = time.perf_counter()
        if top:
            prof.enable()
        fn()
        if top:
            prof.disable()
        walls.append(time.perf_counter() - t)
    total = sum(walls)
    print(f"\n===== {label}: " + ", ".join(f"{w * 1000:.1f} ms" for w in walls) + f" (rounds: {rounds})")
    if not top or not rounds:
        return
    for sort in ("tottime", "cumulative"):
        stats = pstats.Stats(prof, stream=io.StringIO())
        print(f"--- by {sort} (share of the phase's {total * 1000:.0f} ms over {rounds} rounds in brackets)")
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if sort == "tottime" else 3], reverse=True)
        for (path, line, func), (_cc, nc, tt, ct, _callers) in entries[:top]:
            where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line}"
            print(f"  {tt * 1000:9.1f} ms own [{tt / total:5.1%}]  {ct * 1000:9.1f} ms cum [{ct / total:5.1%}]  "
                  f"{nc:>8} calls  {func}  ({where})")
    if dump:
        prof.dump_stats(os.path.join(dump, f"{label.split()[0]}.prof"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--tensor-kib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="functions listed (0: no cProfile, timing only)")
    parser.add_argument("--phases", nargs="*", default=list(PHASES), choices=PHASES)
    parser.add_argument("--io-threads", type=int, default=None, help="the saver's max_per_rank_io_concurrency")
    parser.add_argument("--format", default="torchsnapshot", choices=("torchsnapshot", "dcp"),
                        help="the snapshots' on-disk format")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--dump", default=None, help="a directory for the .prof files")
    args = parser.parse_args()
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore

    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    numel = args.tensor_kib * 256
    model, target = make_model(args.count, numel, 0), make_model(args.count, numel, 1)
    root = tempfile.mkdtemp(prefix="profile_entries.", dir=args.dir)
    from tnt_snapshot_plugin.config import Knobs

    knobs = {} if args.io_threads is None else {"knobs": Knobs(max_per_rank_io_concurrency=args.io_threads)}
    print(f"{args.count} x {args.tensor_kib} KiB; model.state_dict() takes "
          f"{min(_timed(model.state_dict) for _ in range(3)) * 1000:.1f} ms")
    try:
        step = [0]
        savers: dict[bool, Any] = {}

        def saver(asynchronous: bool) -> Any:
            if asynchronous not in savers:
                config = SnapshotConfig.build(
                    async_snapshot=asynchronous, save_on_train_end=False, preemption_signals=[],
                    format=args.format, **knobs,
                )
                s = savers[asynchronous] = Snapshotter(os.path.join(root, f"async{asynchronous}"), config)
                s.train_start(["model"], 0, 0)
            return savers[asynchronous]

        def snapshot(asynchronous: bool) -> None:
            step[0] += 1
            saver(asynchronous).save(0, step[0], lambda: {"model": model})

        def settle(asynchronous: bool) -> None:
            """Wait for the previous write and delete all but the newest snapshot, unprofiled (as
            benchmarks/run.py does: no retention inside the measured snapshot)."""
            s = saver(asynchronous)
            s.wait()
            for record in s.stats.committed[:-1]:
                shutil.rmtree(record.path, ignore_errors=True)

        if "stall" in args.phases:
            # the previous write is waited for outside the profile: not part of this stall
            profiled("stall (async snapshot: the training thread's part)", lambda: snapshot(True),
                     args.rounds, args.top, args.dump, before=lambda: settle(True))
            saver(True).wait()
        if "sync" in args.phases or "restore" in args.phases:
            profiled("sync (snapshot written and committed on the calling thread)", lambda: snapshot(False),
                     args.rounds if "sync" in args.phases else 0, args.top, args.dump, before=lambda: settle(False))
        if "restore" in args.phases:
            path = saver(False).stats.committed[-1].path

            def cold_restore() -> None:
                evict(path)
                restore(path, {"model": target})

            profiled("restore (cold page cache)", cold_restore, args.rounds, args.top, args.dump)
        for s in savers.values():
            s.train_end(0, step[0], lambda intra_epoch: {})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
