"""Fault injection: SIGKILL a training process at random moments, then check what restore picks.

A trainer (tests/scripts/fault_server.py) runs the real torchtnt ``train()`` with the torchtnt
adapter, snapshotting asynchronously after every step and keeping the last 3 snapshots. After step
``s`` every tensor of its unit (several modules, about 4.5 MB in several files, plus a pickled
object) holds the value ``s``, so a snapshot mixing two steps, or a torn file, is visible.

Each trial forks a trainer that resumes from the latest snapshot in the same ``dirpath`` and
SIGKILLs it after a random number of steps plus a random part of a step (fixed seed), so the kills
land before, during and after writes, commits and retention deletions. A fresh process then
restores the latest snapshot and reports. The test checks that

* every tensor restored holds exactly one step's value, the same step as the snapshot's progress;
* the latest never goes backwards, and is never older than a snapshot the trainer was told was
  committed (the ``tnt_snapshot_plugin_snapshot_committed`` hook);
* every snapshot restore could pick is intact (its size index verifies), restore warns about none;
* staging directories left by a kill are never picked and are removed at the next train start.

The trainers are forked from a server that imported torch and torchtnt once, which keeps the
whole test well under two minutes on two cores.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fault_server.py"
SEED = 20240726
TRIALS = 30
KEEP_LAST = 3  # as in the script


class ForkServer:
    """The fork server subprocess and its event stream."""

    def __init__(self, stderr_path: Path) -> None:
        self._stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self._events: "queue.Queue[Optional[dict[str, Any]]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.trainer: Optional[int] = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._events.put(json.loads(line))
        self._events.put(None)

    def send(self, **request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def next(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event from the fork server in {timeout}s\n{self.stderr()}") from None
        if event is None:
            raise AssertionError(f"the fork server exited\n{self.stderr()}")
        if event["event"] == "error":
            raise AssertionError(f"a forked process failed:\n{event['traceback']}\n{self.stderr()}")
        return event

    def until(self, name: str, timeout: float = 60.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The next event called ``name``, and the events before it."""
        before = []
        while True:
            event = self.next(timeout)
            if event["event"] == name:
                return event, before
            before.append(event)

    def stderr(self) -> str:
        self._stderr.flush()
        return "stderr of the fork server (tail):\n" + self._stderr_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.trainer is not None:
            try:
                os.kill(self.trainer, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.send(op="quit")
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def server(tmp_path):
    srv = ForkServer(tmp_path / "fork_server.stderr")
    try:
        srv.until("ready", timeout=240)
        yield srv
    finally:
        srv.close()


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_or_tears_a_snapshot(server, tmp_path):
    rng = random.Random(SEED)
    dirpath = str(tmp_path / "snapshots")
    latest = 0  # steps of the latest snapshot so far (0: none yet)
    step_interval = 0.05  # running estimate of the time between two steps, in seconds
    left_behind: list[str] = []  # staging directories the previous kill left
    log = []

    for trial in range(TRIALS):
        server.send(op="train", dirpath=dirpath)
        forked, _ = server.until("forked")
        server.trainer = forked["pid"]

        if rng.random() < 0.15:  # kill during start-up: the restore, before any write
            steps_to_wait, delay = -1, rng.random() * 0.2
        else:
            steps_to_wait, delay = rng.randint(0, 4), rng.random() * 1.5
        events: list[dict[str, Any]] = []
        if steps_to_wait >= 0:
            resumed, _ = server.until("resumed")
            events.append(resumed)
            seen, last = 0, time.monotonic()
            while seen < steps_to_wait:
                event = server.next()
                events.append(event)
                if event["event"] == "step":
                    now = time.monotonic()
                    if seen:
                        step_interval = 0.8 * step_interval + 0.2 * (now - last)
                    seen, last = seen + 1, now
            delay *= step_interval
        time.sleep(delay)
        os.kill(server.trainer, signal.SIGKILL)
        server.send(op="reap")
        reaped, more = server.until("reaped")
        server.trainer = None
        events += more
        assert reaped["signal"] == signal.SIGKILL, f"trial {trial}: the trainer was not killed: {reaped}, {events}"
        assert not [e for e in events if e["event"] == "finished"]

        server.send(op="check", dirpath=dirpath)
        report, _ = server.until("checked")
        server.until("check_done")

        resumed_at = [e["step"] for e in events if e["event"] == "resumed"]
        steps = [e["step"] for e in events if e["event"] == "step"]
        committed = [e["step"] for e in events if e["event"] == "committed"]
        where = f"trial {trial} (kill after {steps_to_wait} steps + {delay * 1000:.0f} ms): {report}"

        # Each trial resumed from the latest snapshot that the previous check restored.
        for event in events:
            if event["event"] == "resumed":
                assert event["step"] == latest, where
                assert event["values"] == [float(latest)] and event["counter"] == latest, where

        # The restored state is exactly one step's: every tensor, the pickled object, the progress.
        now_latest = report["step"] if report["restored"] else 0
        expected = [float(now_latest)] if report["restored"] else [-1.0]
        assert report["values"] and all(v == expected for v in report["values"].values()), where
        if report["restored"]:
            assert report["counter"] == now_latest, where
            assert report["complete"][-1] == f"epoch_0_step_{now_latest}", where

        # Never backwards; never older than a snapshot reported committed; never from the future.
        assert now_latest >= latest, where
        assert now_latest >= max(committed, default=0), where
        assert now_latest <= max(steps + resumed_at, default=latest) + 1, where

        # Every snapshot restore could pick is intact; restore had nothing to warn about but,
        # before the first commit, that training starts from the beginning.
        assert report["damaged"] == {}, where
        if report["restored"]:
            assert report["warnings"] == [], where
        else:
            (said,) = report["warnings"]
            assert "nothing was restored and training starts from the beginning" in said, where
        assert report["others"] == [], where
        assert len(report["complete"]) <= KEEP_LAST + 1, where

        # Staging leftovers of the previous kill were removed when this trainer started training.
        if steps:
            assert not set(left_behind) & set(report["staging"]), where
        left_behind = report["staging"]

        log.append((steps_to_wait, round(delay * 1000), resumed_at, steps, committed, now_latest, report["staging"]))
        latest = now_latest

    print("\ntrial: (steps waited, delay ms, resumed at, steps, committed, latest, staging left)")
    for trial, entry in enumerate(log):
        print(trial, entry)
    # The kills did land inside writes (leaving staging directories) and training did advance.
    assert sum(1 for entry in log if entry[-1]) >= 3, log
    assert latest >= TRIALS // 4, log
