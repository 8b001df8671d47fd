"""Preemption with the torchtnt adapter: a real training subprocess receives SIGTERM (or SIGUSR1).

The process (tests/scripts/train_torchtnt.py) snapshots after every step on a slow disk, so a
snapshot is still being written whenever a step ends. On the signal it must finish the step that
is running, let the pending snapshot finish, take a final snapshot of that step, and then exit as
the signal asks: killed by it (returncode -SIGNUM), through the Python handler installed before
the saver's when there was one.
"""

from __future__ import annotations

import hashlib
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from dir_listing import complete_in_commit_order, staging_by_name

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import ToyUnit

SCRIPT = Path(__file__).parent / "scripts" / "train_torchtnt.py"


def digest(module: torch.nn.Module) -> str:  # as in the script
    h = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        h.update(key.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_and_signal(dirpath: Path, mode: str, sig: int, after_begin: int = 3) -> tuple[int, list[str], str]:
    """Start the script, send ``sig`` once step ``after_begin`` has begun; (returncode, stdout lines, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(dirpath), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: "queue.Queue[str | None]" = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def read_stderr() -> None:
        assert proc.stderr is not None
        err.append(proc.stderr.read())

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for reader in readers:
        reader.start()
    try:
        while True:
            line = lines.get(timeout=180)
            if line is None:
                break
            out.append(line)
            if line == f"begin {after_begin}":
                proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    return proc.returncode, out, "".join(err)


CASES = {
    # mode -> signal sent
    "default": signal.SIGTERM,
    "chained": signal.SIGTERM,
    "usr1": signal.SIGUSR1,
    "world-of-one": signal.SIGTERM,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All cases run at once (each process spends most of its life importing torch and torchtnt)."""
    root = tmp_path_factory.mktemp("preemption")
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = {
            mode: pool.submit(run_and_signal, root / mode, mode, sig) for mode, sig in CASES.items()
        }
        return {mode: (root / mode, *future.result()) for mode, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(CASES))
def test_signal_finishes_the_step_drains_snapshots_saves_and_exits_by_the_signal(runs, mode):
    sig = CASES[mode]
    dirpath, returncode, out, err = runs[mode]

    # The process ended as the signal asks: killed by it, not by an exception or a normal exit.
    assert returncode == -sig, f"returncode {returncode}\nstdout: {out}\nstderr: {err[-3000:]}"
    assert "finished" not in out

    # The step running when the signal came finished, and no other step began.
    begins = [int(line.split()[1]) for line in out if line.startswith("begin ")]
    ends = {int(line.split()[1]): line.split()[2] for line in out if line.startswith("end ")}
    last = begins[-1]
    assert last >= 3 and begins == list(range(1, last + 1)), out
    if mode == "world-of-one":
        # one process under torch.distributed has no other rank to agree with: the snapshot is
        # of the step the signal came in (sent during step 3's 0.1 s), not one step later
        assert last == 3, out
    assert sorted(ends) == begins, out

    # The final snapshot was taken of the step the signal came in. (Training waited for the
    # snapshots still being written: counted, and warned only past SnapshotBusyWarning's
    # threshold, which tests/test_quiet_warnings.py covers.)
    assert f"preemption signal received; snapshotting step {last}" in err, err
    assert complete_in_commit_order(dirpath) == [f"epoch_0_step_{k}" for k in range(1, last + 1)]
    assert staging_by_name(dirpath) == []

    # The final snapshot holds exactly the state after that step.
    fresh = ToyUnit(seed=123)
    TorchSnapshotSaver.restore(str(dirpath / f"epoch_0_step_{last}"), fresh)
    assert fresh.train_progress.num_steps_completed == last
    assert digest(fresh.model) == ends[last]

    # A Python handler installed before the saver's was called, once, after the final snapshot.
    handler_lines = [line for line in out if line.startswith("previous handler")]
    if mode == "chained":
        assert handler_lines == [f"previous handler called with {int(sig)}"]
        assert out.index(handler_lines[0]) > out.index(f"end {last} {ends[last]}")
    else:
        assert handler_lines == []


def test_two_savers_stopping_in_any_order_leave_the_original_handler():
    """Each saver's handler hands the signal on to the one installed before it; when the first
    saver stops while a later one still watches, the later one hands on to the original."""
    import signal

    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.saving.preemption import PreemptionHandler

    def original(signum, frame):  # pragma: no cover - never delivered here
        pass

    before = signal.signal(signal.SIGUSR1, original)
    try:
        for order in ((0, 1), (1, 0)):
            handlers = [PreemptionHandler((signal.SIGUSR1,), Collectives(None)) for _ in range(2)]
            for h in handlers:
                h.install()
            assert signal.getsignal(signal.SIGUSR1) == handlers[1]._handle
            handlers[order[0]].uninstall()
            handlers[order[1]].uninstall()
            assert signal.getsignal(signal.SIGUSR1) is original, order
    finally:
        signal.signal(signal.SIGUSR1, before)
