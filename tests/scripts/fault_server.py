"""Fork server for tests/test_fault_injection.py: imports torch and torchtnt once, then forks.

Starting a Python process that imports torch and torchtnt costs seconds on a loaded machine;
twenty-odd trials that each start one would take minutes. This server pays the import once and
then forks a fresh child per request. It starts no threads and runs no torch kernels before it
forks, so each child is an ordinary single-threaded process that has merely skipped the imports.

Protocol: one JSON object per line. The test writes requests on stdin::

    {"op": "train", "dirpath": D}   fork a trainer; it resumes from D's latest snapshot and
                                    trains, snapshotting every step, until it is killed
    {"op": "reap"}                  wait for the last trainer to die
    {"op": "check", "dirpath": D}   fork a fresh process that restores D's latest snapshot
    {"op": "quit"}

and reads events on stdout: ``ready``, ``forked`` (with the trainer's pid), the trainer's
``resumed`` / ``step`` / ``committed`` lines, ``reaped``, ``checked`` (the checker's report) and
``check_done``. Every line is written with one ``os.write`` call, which a pipe keeps whole, so a
SIGKILL never leaves half a line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
import warnings

warnings.filterwarnings("ignore", message="pkg_resources is deprecated")

import torch  # noqa: E402
import torchsnapshot  # noqa: E402, F401  (imported before the fork, not in every child)
from torchtnt.framework.callback import Callback  # noqa: E402
from torchtnt.framework.train import train  # noqa: E402
from torchtnt.framework.unit import TrainUnit  # noqa: E402

from tnt_snapshot_plugin import hookimpl  # noqa: E402
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver  # noqa: E402
from tnt_snapshot_plugin.format import listing, verify  # noqa: E402
from tnt_snapshot_plugin.hooks import new_plugin_manager  # noqa: E402
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name  # noqa: E402
from tnt_snapshot_plugin.stores import LOCK_FNAME, LocalStore  # noqa: E402

KEEP_LAST = 3


def emit(**event: object) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


class Counter:
    """A non-tensor stateful entry (pickled by torchsnapshot into a file of its own)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tag": f"step-{self.step}"}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        assert state["tag"] == f"step-{self.step}"


class StepUnit(TrainUnit[int]):
    """After step ``s`` (``s`` train steps completed) every tensor is filled with ``s``.

    About 4.5 MB in several tensors, modules and files, so a write takes a few to tens of ms.
    """

    def __init__(self, fill: float = 0.0) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(512, 512)  # 1 MB weight + bias
        self.table = torch.nn.Embedding(1024, 256)  # 1 MB
        self.head = torch.nn.Module()
        self.head.register_buffer("stats", torch.zeros(256 * 1024, dtype=torch.float64))  # 2 MB
        self.head.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.counter = Counter()
        self.fill(fill)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for key in ("encoder", "table", "head"):
            for name, t in getattr(self, key).state_dict().items():
                out[f"{key}.{name}"] = t
        return out

    def fill(self, value: float) -> None:
        with torch.no_grad():
            for t in self.tensors().values():
                t.fill_(value)
        self.counter.step = int(value)

    def train_step(self, state: object, data: int) -> None:
        self.fill(self.train_progress.num_steps_completed + 1)


class ReportSteps(Callback):
    """Placed after the saver: says which step's snapshot has just been started."""

    def on_train_step_end(self, state: object, unit: StepUnit) -> None:
        emit(event="step", step=unit.train_progress.num_steps_completed)


class ReportCommits:
    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path: str, epoch: int, step: int) -> None:
        emit(event="committed", step=step)


def run_trainer(dirpath: str) -> None:
    unit = StepUnit(fill=-1.0)
    if not TorchSnapshotSaver.restore_from_latest(dirpath, unit):
        unit.fill(0.0)
    step = unit.train_progress.num_steps_completed
    values = sorted({float(v) for t in unit.tensors().values() for v in t.unique().tolist()})
    emit(event="resumed", step=step, values=values, counter=unit.counter.step)
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(ReportCommits())
    saver = TorchSnapshotSaver(
        dirpath,
        save_every_n_train_steps=1,
        keep_last_n_snapshots=KEEP_LAST,
        save_on_train_end=False,
        plugin_manager=pm,
    )
    # A trainer that is never killed stops by itself after 500 steps; the test then fails.
    train(unit, [0] * 500, max_epochs=1, callbacks=[saver, ReportSteps()])
    emit(event="finished", step=unit.train_progress.num_steps_completed)


def run_checker(dirpath: str) -> None:
    """Restore the latest snapshot into a unit filled with -1 and report what it holds."""
    store = LocalStore(dirpath)
    names = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
    complete = [s.text for s in listing.complete_snapshots(store)]
    problems = {name: verify.check(store, name).problem for name in complete}
    damaged = {name: why for name, why in problems.items() if why is not None}
    staging = [n for n in names if is_staging_name(n)]
    # A SIGKILLed saver's lock file stays behind (the kernel dropped the lock itself).
    others = [
        n for n in names
        if not is_staging_name(n) and SnapshotName.parse(n) is None and n != LOCK_FNAME
    ]
    unit = StepUnit(fill=-1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = TorchSnapshotSaver.restore_from_latest(dirpath, unit)
    emit(
        event="checked",
        restored=restored,
        complete=complete,
        damaged=damaged,
        staging=staging,
        others=others,
        step=unit.train_progress.num_steps_completed,
        values={k: sorted({float(v) for v in t.unique().tolist()}) for k, t in unit.tensors().items()},
        counter=unit.counter.step,
        warnings=[str(w.message) for w in caught],
    )


def child(target, dirpath: str) -> None:
    code = 0
    try:
        target(dirpath)
    except BaseException:
        emit(event="error", traceback=traceback.format_exc())
        code = 1
    finally:
        os._exit(code)


def main() -> None:
    assert threading.active_count() == 1, "the fork server must not start threads"
    torch.set_num_threads(1)
    trainer = None
    emit(event="ready", pid=os.getpid())
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "train":
            trainer = os.fork()
            if trainer == 0:
                child(run_trainer, request["dirpath"])
            emit(event="forked", pid=trainer)
        elif op == "reap":
            assert trainer is not None
            _, status = os.waitpid(trainer, 0)
            trainer = None
            emit(
                event="reaped",
                signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            )
        elif op == "check":
            pid = os.fork()
            if pid == 0:
                child(run_checker, request["dirpath"])
            _, status = os.waitpid(pid, 0)
            emit(event="check_done", status=status)
        elif op == "quit":
            break


if __name__ == "__main__":
    main()
