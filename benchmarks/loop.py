"""Hook cost on a step that does not snapshot, as a real training loop meets it.

A warm loop that calls a hook back to back (hooks.py) keeps the saver's code and data in the CPU
caches and measures a few hundred ns. In training, every step does real work between two hook
calls that pushes them out, so each call runs cold: its cost is mostly cache and TLB misses on
every object and bytecode it touches. To measure that, this runs real
``torchtnt.framework.train`` loops whose ``train_step`` writes ``work_mib`` MiB of memory (8 MiB
by default: 8x the L2 cache of this machine's cores and a quarter of their shared L3, the
footprint of a small model's step), and optionally sleeps ``sleep_ms`` so that other processes
run on the core meanwhile (with the sleep, the caches are as cold as after a real step on a
busy machine).

Each candidate gets its own ``train`` call of ``steps`` steps, in rounds: every candidate once per
round, the order rotated each round, so drift on a shared machine hits them alike. The time of
every per-step callback dispatch (``on_train_get_next_batch_end``, ``on_train_step_start``,
``on_train_step_end``, wrapped around torchtnt's ``CallbackHandler``) is summed per step; the
figure is the median over all measured steps of a candidate. No checkpointing saver's cadence
fires during the measured steps (torchtnt's saver takes its final checkpoint at train end, outside
the timed hooks).

    python benchmarks/loop.py [--steps 300] [--rounds 7] [--work-mib 8] [--sleep-ms 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
from measure import median

NEVER = 10**9  # a cadence no benchmark step reaches
PER_STEP_HOOKS = ("on_train_get_next_batch_end", "on_train_step_start", "on_train_step_end")

NONE = "no callback"
NOOP = "no-op torchtnt Callback"
TNT = "torchtnt TorchSnapshotSaver"
PLUGIN = "tnt_snapshot_plugin TorchSnapshotSaver"


def _unit(model: torch.nn.Module, work_mib: int, sleep_ms: float) -> Any:
    from torchtnt.framework.unit import TrainUnit

    class WorkUnit(TrainUnit[Any]):
        """A step that evicts the caches: writes ``work_mib`` MiB, then optionally sleeps."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            self._buf = torch.zeros(work_mib * 2**18, dtype=torch.float32)  # MiB / 4 bytes

        def train_step(self, state: Any, data: Any) -> None:
            self._buf.add_(1.0)
            if sleep_ms:
                time.sleep(sleep_ms / 1000)

    return WorkUnit()


def _candidates(tmp: str) -> dict[str, Callable[[], list[Any]]]:
    from torchtnt.framework.callback import Callback
    from torchtnt.framework.callbacks import TorchSnapshotSaver as TntSaver

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver as PluginSaver

    class NoOp(Callback):
        def on_train_step_end(self, state: Any, unit: Any) -> None:
            pass

    counter = iter(range(10**6))

    def fresh(kind: str) -> str:
        return f"{tmp}/{kind}_{next(counter)}"

    return {
        NONE: lambda: [],
        NOOP: lambda: [NoOp()],
        # synchronous: torchsnapshot's async_take needs a process group on IPv4-only hosts
        TNT: lambda: [TntSaver(fresh("tnt"), save_every_n_train_steps=NEVER, async_checkpoint=False)],
        # the plugin's defaults (preemption on SIGTERM watched) apart from the cadence
        PLUGIN: lambda: [
            PluginSaver(fresh("plugin"), save_every_n_train_steps=NEVER, save_on_train_end=False)
        ],
    }


class _DispatchTimer:
    """Wraps torchtnt's per-step CallbackHandler methods; sums their time per step (ns)."""

    def __init__(self) -> None:
        from torchtnt.framework._callback_handler import CallbackHandler

        self._cls = CallbackHandler
        self._originals = {name: getattr(CallbackHandler, name) for name in PER_STEP_HOOKS}
        self.steps: list[int] = []
        self._acc = 0

    def __enter__(self) -> "_DispatchTimer":
        clock = time.perf_counter_ns

        def wrap(original: Callable[..., None], ends_step: bool) -> Callable[..., None]:
            def timed(handler: Any, state: Any, unit: Any) -> None:
                t = clock()
                original(handler, state, unit)
                self._acc += clock() - t
                if ends_step:
                    self.steps.append(self._acc)
                    self._acc = 0

            return timed

        for name, original in self._originals.items():
            setattr(self._cls, name, wrap(original, name == "on_train_step_end"))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(self._cls, name, original)


def loop_costs(
    steps: int = 300, rounds: int = 7, work_mib: int = 8, sleep_ms: float = 0.0, warmup: int = 20,
    candidates: Optional[list[str]] = None,
) -> dict[str, Any]:
    """Median dispatch ns per step of each candidate in real torchtnt train loops (see module doc)."""
    from torchtnt.framework.train import train

    results: dict[str, Any] = {
        "steps": steps, "rounds": rounds, "work_mib": work_mib, "sleep_ms": sleep_ms,
        "hooks": list(PER_STEP_HOOKS), "candidates": {},
    }
    with tempfile.TemporaryDirectory(prefix="tnt_bench_loop_") as tmp:
        makers = _candidates(tmp)
        names = [n for n in makers if candidates is None or n in candidates]
        samples: dict[str, list[int]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                unit = _unit(torch.nn.Linear(16, 16), work_mib, sleep_ms)
                with _DispatchTimer() as timer:
                    train(unit, range(warmup + steps), max_epochs=1, callbacks=makers[name]())
                samples[name].extend(timer.steps[warmup:])  # the first steps warm up imports
        base = median(samples[NONE]) if NONE in samples else 0.0
        base_mean = sum(samples[NONE]) / len(samples[NONE]) if NONE in samples else 0.0
        noop = median(samples[NOOP]) - base if NOOP in samples else None
        tnt = median(samples[TNT]) - base if TNT in samples else None
        for name, values in samples.items():
            ns = median(values)
            excess = ns - base
            results["candidates"][name] = {
                "per_step_ns": ns,
                "excess_ns": excess,  # over no callback at all
                # the mean counts the rare costly steps the median leaves out (an agreement
                # among ranks every few steps, a collection of the garbage collector)
                "mean_excess_ns": sum(values) / len(values) - base_mean,
                "x_noop": excess / noop if noop else None,
                "x_torchtnt": excess / tnt if tnt else None,
                "samples": len(values),
            }
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="measured steps per train() call")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (every candidate once per round)")
    parser.add_argument("--work-mib", type=int, default=8, help="MiB each train_step writes")
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="ms each train_step sleeps after it")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    show(loop_costs(args.steps, args.rounds, args.work_mib, args.sleep_ms), args.out)
    return 0


def show(res: dict[str, Any], out: Optional[str]) -> None:
    """Print ``res`` as a table; also write it as JSON to ``out``, if given."""
    from report import loop_table

    print(loop_table(res))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
