#!/usr/bin/env python
"""The first snapshot's stall against the later ones, in a real torchtnt train loop.

    python benchmarks/first_stall.py                 # 128 MiB of weights (+ 128 MiB of momentum)
    python benchmarks/first_stall.py --mib 512 --runs 3

The unit's model is ``--mib`` of fp32 weights trained with SGD and momentum (the optimizer's
state, as large again, appears at its first step); every step does real work on every weight.
An asynchronous TorchSnapshotSaver snapshots every 4 steps. Each run trains 16 steps; the
figure is the training stall of the first snapshot divided by the second's (and the third's),
with the staging buffers prepared at train start (the default) and without (``prepare``
replaced by nothing), runs alternating. Each run is a fresh process: in one process, memory freed
by an earlier run is handed out again already touched (glibc raises its mmap threshold after a
free), which would hide the first-touch cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Optional

import torch
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.saving.saver import Snapshotter


class Unit(TrainUnit[Any]):
    def __init__(self, mib: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        for i in range(mib // 4):
            self.model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(1024 * 1024)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def train_step(self, state: State, data: Any) -> None:
        loss = sum((p * p).sum() for p in self.model.parameters())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def one_run(root: str, mib: int) -> list[float]:
    dirpath = tempfile.mkdtemp(dir=root)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=4, save_on_train_end=False)
    train(Unit(mib), [0] * 16, max_epochs=1, callbacks=[saver])
    stalls = [r.stall_s for r in saver.snapshotter.stats.committed]
    shutil.rmtree(dirpath)
    return stalls


def first_stall(mib: int, runs: int, workdir: Optional[str] = None, log: Any = None) -> dict[str, Any]:
    """``runs`` runs with the staging buffers prepared at train start and ``runs`` without, each
    in a fresh process, alternating; per variant the median first stall, the median ratio of the
    first stall to the median of the later ones, and every run's stalls."""
    root = tempfile.mkdtemp(prefix="first_stall.", dir=workdir)
    variants = ("prepared", "not prepared")
    stalls: dict[str, list[list[float]]] = {name: [] for name in variants}
    try:
        for run in range(runs):
            for name in variants if run % 2 == 0 else variants[::-1]:
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--one", name, "--mib", str(mib), "--dir", root],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                ).stdout
                these = json.loads(out.strip().splitlines()[-1])
                stalls[name].append(these)
                if log is not None:
                    print(f"    run {run} {name}: stalls " + ", ".join(f"{s * 1000:.1f} ms" for s in these),
                          file=log, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, Any] = {"mib": mib, "runs": runs}
    for name in variants:
        results[name] = {
            "first_s": statistics.median(s[0] for s in stalls[name]),
            "later_s": statistics.median(statistics.median(s[1:]) for s in stalls[name]),
            "first_over_later": statistics.median(s[0] / statistics.median(s[1:]) for s in stalls[name]),
            "first_over_second": statistics.median(s[0] / s[1] for s in stalls[name]),
            "stalls": stalls[name],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--one", choices=["prepared", "not prepared"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one is not None:  # one run, in this fresh process
        if args.one == "not prepared":
            Snapshotter.prepare = lambda self, app_state: None  # type: ignore[method-assign]
        print(json.dumps(one_run(args.dir, args.mib)))
        return
    results = first_stall(args.mib, args.runs, args.dir, log=sys.stdout)
    for name in ("prepared", "not prepared"):
        r = results[name]
        print(f"{args.mib} MiB weights, {name}: first stall {r['first_s'] * 1000:.1f} ms, "
              f"first / second = {r['first_over_second']:.2f}, first / later = {r['first_over_later']:.2f} "
              f"(medians of {args.runs} runs)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
