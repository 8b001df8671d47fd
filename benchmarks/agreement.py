#!/usr/bin/env python
"""Hook cost on a step that does not snapshot, under torch.distributed with 2 ranks.

With two or more ranks the saver agrees on preemption (and on the wall-clock cadence) through a
non-blocking gloo all-reduce (``distributed.AgreedFlag``). Starting one costs about 0.4 ms on the
project's machine; the plugin agreed at every step until it spaced the agreements about
``AGREE_EVERY_S`` of training apart. This runs ``loop.py``'s real torchtnt loops (each step
writes 8 MiB and sleeps 20 ms) on 2 gloo ranks on 127.0.0.1, in one rotation of candidates on
both ranks alike, and reports rank 0's per-step dispatch cost of:

* no callback, a no-op callback and torchtnt's saver (synchronous: its async one needs a process
  group of its own kind; its cadence never fires here);
* the plugin with the agreements spaced (the default);
* the plugin agreeing at every step (``AGREE_EVERY_S = 0`` during its runs: how it was before).

    python benchmarks/agreement.py [--steps 100] [--rounds 3] [--out agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any, Optional

EVERY_STEP = "tnt_snapshot_plugin TorchSnapshotSaver, agreeing at every step (as before)"


def _rank_main(rank: int, port: int, steps: int, rounds: int, out: str) -> None:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import loop

    from tnt_snapshot_plugin import distributed
    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    default_every_s = distributed.AGREE_EVERY_S

    class EveryStep(TorchSnapshotSaver):
        """The plugin with its agreements at every step (rank 0 proposes an interval of 1)."""

        def on_train_start(self, state: Any, unit: Any) -> None:
            distributed.AGREE_EVERY_S = 0.0
            super().on_train_start(state, unit)

        def on_train_end(self, state: Any, unit: Any) -> None:
            try:
                super().on_train_end(state, unit)
            finally:
                distributed.AGREE_EVERY_S = default_every_s

    real_candidates = loop._candidates

    def candidates(tmp: str) -> dict[str, Any]:
        made = real_candidates(tmp)
        counter = iter(range(10**6))
        made[EVERY_STEP] = lambda: [
            EveryStep(f"{tmp}/every_{next(counter)}", save_every_n_train_steps=loop.NEVER, save_on_train_end=False)
        ]
        return made

    loop._candidates = candidates
    # every rank writes under its own temporary directory; rank 0's dirpath is the one used
    result = loop.loop_costs(steps=steps, rounds=rounds, work_mib=8, sleep_ms=20.0)
    result["world_size"] = 2
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def agreement_costs(steps: int = 100, rounds: int = 3, timeout_s: float = 900.0) -> dict[str, Any]:
    """Rank 0's loop_costs() result, with the every-step variant among the candidates."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="tnt_bench_agreement_") as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--port", str(port),
                 "--steps", str(steps), "--rounds", str(rounds), "--rank-out", out],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(2)
        ]
        logs = []
        try:
            for proc in procs:
                logs.append(proc.communicate(timeout=timeout_s)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if any(proc.returncode != 0 for proc in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
        with open(out) as f:
            return json.load(f)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args.port, args.steps, args.rounds, args.rank_out)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from loop import show

    show(agreement_costs(args.steps, args.rounds), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
