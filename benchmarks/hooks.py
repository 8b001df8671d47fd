"""Hook cost on a train step that does not snapshot, against a callback that does nothing.

Each callable is called ``n`` times in a tight loop, ``repeats`` times; the figure is the median
per-call time in nanoseconds. ``excess_ns`` subtracts the no-op torchtnt ``Callback``: what the
saver adds to every step of a training loop that calls its hook; ``ratio`` divides by it.

The ``save_every_n_seconds`` row is the wall-clock cadence's cost on a step that does not
snapshot: one monotonic clock read and a few attribute reads in one process. Under
torch.distributed its vote rides on the preemption agreement's all-reduce that every step already
starts (non-blocking, answered one step later), so it adds no collective unless preemption is off.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

import torch
from measure import median
from methods import _tnt_state, _tnt_unit

NEVER = 10**9  # a cadence no benchmark step reaches


def _per_call_ns(fn: Callable[[], Any], n: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t) / n)
    return median(samples)


def hook_costs(n: int, repeats: int) -> dict[str, dict[str, float]]:
    from torchtnt.framework.callback import Callback
    from torchtnt.framework.callbacks import TorchSnapshotSaver as TntSaver

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver as PluginSaver

    model = torch.nn.Linear(4, 4)
    unit = _tnt_unit(model)
    state = _tnt_state()
    unit.train_progress.increment_step()  # step 1: not a multiple of NEVER

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tnt_bench_hooks_") as tmp:
        noop = Callback()
        plugin = PluginSaver(
            tmp + "/plugin", save_every_n_train_steps=NEVER, save_on_train_end=False,
            preemption_signals=[],
        )
        plugin.on_train_start(state, unit)
        core = plugin.snapshotter
        timed = PluginSaver(
            tmp + "/timed", save_every_n_seconds=float(NEVER), save_on_train_end=False,
            preemption_signals=[],
        )
        timed.on_train_start(state, unit)
        tnt = TntSaver(tmp + "/tnt", save_every_n_train_steps=NEVER)

        def collect(intra_epoch: bool) -> dict[str, Any]:  # never called: no step is due
            raise AssertionError("a non-saving step collected the app state")

        candidates: dict[str, Callable[[], Any]] = {
            "no-op torchtnt Callback.on_train_step_end": lambda: noop.on_train_step_end(state, unit),
            "tnt_snapshot_plugin TorchSnapshotSaver.on_train_step_end": (
                lambda: plugin.on_train_step_end(state, unit)
            ),
            "tnt_snapshot_plugin TorchSnapshotSaver.on_train_step_end, save_every_n_seconds": (
                lambda: timed.on_train_step_end(state, unit)
            ),
            "tnt_snapshot_plugin Snapshotter.step_end (core)": lambda: core.step_end(0, 1, collect),
            "torchtnt TorchSnapshotSaver.on_train_step_end": lambda: tnt.on_train_step_end(state, unit),
        }
        # interleave the candidates so drift on a shared machine hits them alike
        samples: dict[str, list[float]] = {k: [] for k in candidates}
        for _ in range(repeats):
            for key, fn in candidates.items():
                samples[key].append(_per_call_ns(fn, n, 1))
        baseline = median(samples["no-op torchtnt Callback.on_train_step_end"])
        for key, values in samples.items():
            ns = median(values)
            results[key] = {"per_call_ns": ns, "excess_ns": ns - baseline, "ratio": ns / baseline}
        plugin.on_train_end(state, unit)
        timed.on_train_end(state, unit)
    return results
