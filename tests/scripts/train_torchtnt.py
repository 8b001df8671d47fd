"""A torchtnt training run for tests/test_preemption_torchtnt.py, stopped by a signal.

Usage: ``train_torchtnt.py DIRPATH MODE`` with MODE one of

* ``default``: the saver watches SIGTERM; SIGTERM's disposition before it was the default one;
* ``chained``: a Python SIGTERM handler is installed before training; it prints a line and then
  exits by SIGTERM itself;
* ``usr1``: the saver watches SIGUSR1 instead (``preemption_signals=[SIGUSR1]``);
* ``world-of-one``: as ``default``, under torch.distributed initialised with one process (as
  ``torchrun --nproc-per-node=1`` runs it).

The unit snapshots after every step, asynchronously, on a slow disk (see ``slow_disk``), so a
snapshot is always still being written when the next step ends. Each step
prints ``begin K`` when it starts and ``end K DIGEST`` (a hash of the weights after it) when it
ends, before the saver's hook runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for toy
warnings.filterwarnings("ignore", message="pkg_resources is deprecated")

import torch  # noqa: E402
from torchtnt.framework.callback import Callback  # noqa: E402
from torchtnt.framework.train import train  # noqa: E402

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver  # noqa: E402
from tnt_snapshot_plugin.stores import LocalStore  # noqa: E402
from tnt_snapshot_plugin.testing import FaultyStore, register  # noqa: E402
from toy import StatefulLoader, ToyUnit, make_data  # noqa: E402


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        h.update(key.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class SlowUnit(ToyUnit):
    def train_step(self, state, data) -> None:
        say(f"begin {self.train_progress.num_steps_completed + 1}")
        time.sleep(0.1)
        super().train_step(state, data)


# The slow disk: the real directory DIRPATH behind a FaultyStore (registered in this process as
# ``fake://slow``) whose hook holds the files of snapshot K until step K+1 has ended (or until
# the saver announces the preemption snapshot), and makes each take 0.05 s more. So whenever the saver's
# hook runs at the end of a step, the previous step's snapshot is certainly still being written.
_step_ended: dict[int, threading.Event] = {}
_preempting = threading.Event()
_lock = threading.Lock()


def step_ended(step: int) -> threading.Event:
    with _lock:
        return _step_ended.setdefault(step, threading.Event())


class Report(Callback):
    """Runs before the saver's hook."""

    def on_train_step_end(self, state, unit) -> None:
        step = unit.train_progress.num_steps_completed
        say(f"end {step} {digest(unit.model)}")
        step_ended(step).set()


class ReleaseOnPreemption(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "preemption signal received" in record.getMessage():
            _preempting.set()


def slow_disk(dirpath: str) -> str:
    """The dirpath the saver is given: ``dirpath`` on the slow disk."""

    def hold(staging: str, rel: str) -> None:
        step = int(re.search(r"epoch_\d+_step_(\d+)", staging).group(1))
        gate = step_ended(step + 1)
        while not (gate.is_set() or _preempting.is_set()):
            gate.wait(0.01)
        time.sleep(0.05)

    faulty = FaultyStore(LocalStore(dirpath))
    faulty.hook("write_payload", before=hold)
    return register("slow", faulty)


def main() -> None:
    dirpath, mode = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("tnt_snapshot_plugin").addHandler(ReleaseOnPreemption())
    dirpath = slow_disk(dirpath)
    if mode == "chained":

        def previous_handler(signum, frame):
            say(f"previous handler called with {signum}")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, previous_handler)
    if mode == "world-of-one":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    signals = [signal.SIGUSR1] if mode == "usr1" else [signal.SIGTERM]
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, preemption_signals=signals)
    unit = SlowUnit()
    train(unit, StatefulLoader(make_data(4 * 40)), max_epochs=1, callbacks=[Report(), saver])
    say("finished")


if __name__ == "__main__":
    main()
