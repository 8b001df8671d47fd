"""Training never waits on the storage longer than ``storage_timeout_s``.

An S3 endpoint that accepts connections and never answers is moto's real server stopped with
SIGSTOP (the kernel still completes TCP handshakes; no request gets a byte back). Each request
then gives up within the bound (botocore's timeouts and retries are sized from it); an
asynchronous snapshot still being written after training has waited the bound for it at the
next due snapshot makes that one be skipped, with one warning, counted in the snapshot metrics.
Once the server is continued (SIGCONT), snapshots commit again. The server is this module's own
process, started on 127.0.0.1 and stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
import warnings
from typing import Any

import pytest
import torch
from moto_s3 import create_bucket, moto_options
from torchtnt.framework.state import State
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    ConfigError,
    SnapshotBusyWarning,
    SnapshotFailedWarning,
    SnapshotSkippedWarning,
    SnapshotWriteError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.config import DEFAULT_STORAGE_TIMEOUT_S, SnapshotConfig
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.saving.writer import DEFAULT_IO_THREADS
from tnt_snapshot_plugin.stores import LocalStore
from tnt_snapshot_plugin.stores.s3 import _backoff_s, request_limits
from tnt_snapshot_plugin.testing import FaultyStore, register, unregister
from toy import Holder, StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, weights

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_aws_environment")]

BUCKET = "bound"
#: the bound under test: small, so the test is short
BOUND_S = 3.0
#: what a noisy machine may add to it
SLACK_S = 15.0
STEP_S = 0.2


@pytest.fixture
def moto(moto_server):
    """(its process, storage_options) of a moto server of this test's own, with a bucket."""
    proc, endpoint = moto_server()
    options = moto_options(endpoint)
    create_bucket(options, BUCKET)
    return proc, options


class FreezingUnit(ToyUnit):
    """Stops the server (SIGSTOP) before step ``freeze_at``, once the snapshots before it are
    committed, and continues it (SIGCONT) before step ``thaw_at``; records when each step began.
    A watchdog continues it anyway after ``BOUND_S + SLACK_S + 10`` s stuck in one step, so that a run
    that waits too long still ends (and fails the timing assertion)."""

    def __init__(self, pid: int, freeze_at: int, thaw_at: int) -> None:
        super().__init__()
        self.pid, self.freeze_at, self.thaw_at = pid, freeze_at, thaw_at
        self.started: dict[int, float] = {}
        self.saver: Any = None
        self.committed_before_freeze = 0
        self._watchdog: Any = None

    def train_step(self, state: State, data: Any) -> None:
        step = self.train_progress.num_steps_completed + 1
        self.started[step] = time.monotonic()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if step == self.freeze_at:
            self.saver.snapshotter.wait()
            self.committed_before_freeze = len(self.saver.snapshotter.stats.committed)
            os.kill(self.pid, signal.SIGSTOP)
        elif step == self.thaw_at:
            os.kill(self.pid, signal.SIGCONT)
        if self.freeze_at <= step < self.thaw_at:
            self._watchdog = threading.Timer(BOUND_S + SLACK_S + 10, os.kill, (self.pid, signal.SIGCONT))
            self._watchdog.start()
        time.sleep(STEP_S)
        super().train_step(state, data)


class Metrics:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_dict(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.mark.parametrize(
    "async_snapshot, thaw_after", [(True, 20), (False, 3)], ids=["async", "sync"]
)
def test_frozen_endpoint_keeps_training_within_the_bound(moto, async_snapshot, thaw_after):
    proc, options = moto
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    freeze_at = 4
    thaw_at = freeze_at + thaw_after
    steps = thaw_at + 4
    unit = FreezingUnit(proc.pid, freeze_at, thaw_at)
    metrics = Metrics()
    saver = TorchSnapshotSaver(
        url,
        save_every_n_train_steps=1,
        storage_options=options,
        async_snapshot=async_snapshot,
        storage_timeout_s=BOUND_S,
        metric_logger=metrics,
    )
    unit.saver = saver
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, StatefulLoader(make_data(4 * steps)), max_epochs=1, callbacks=[saver])
    took = time.monotonic() - began

    assert unit.train_progress.num_steps_completed == steps
    assert unit.committed_before_freeze >= 1  # the storage worked before it froze
    # No step began more than the bound (and slack) after the one before: training went on.
    gaps = [unit.started[s + 1] - unit.started[s] for s in range(freeze_at, thaw_at)]
    assert max(gaps) <= BOUND_S + STEP_S + SLACK_S, gaps
    if async_snapshot:
        # ... and, asynchronous, waited for the storage no more than the bound in all: no
        # snapshot commits while the endpoint is frozen, and the budget is per commit
        assert sum(gaps) - len(gaps) * STEP_S <= BOUND_S + SLACK_S, gaps
    assert took < steps * STEP_S + 4 * BOUND_S + 2 * SLACK_S, took

    stats = saver.snapshotter.stats
    failed = [w for w in caught if issubclass(w.category, SnapshotFailedWarning)]
    skipped = [w for w in caught if issubclass(w.category, SnapshotSkippedWarning)]
    assert failed, "the snapshots due while the endpoint was frozen did not say they failed"
    # the storage is one cause: one warning (a skip or a failure) until a snapshot commits again
    assert len(failed) == 1, [f"{w.category.__name__}: {str(w.message)[:200]}" for w in failed]
    (warning,) = failed
    if issubclass(warning.category, SnapshotSkippedWarning):  # the skip came before a failure
        assert "storage_timeout_s=3 " in str(warning.message)
    else:  # a stuck write's request gave up first
        assert "StorageUnavailableError" in str(warning.message)
    assert not [w for w in caught if issubclass(w.category, SnapshotBusyWarning)]  # the failure's
    if async_snapshot:
        # every due snapshot while a write is stuck is skipped, counted, logged at INFO
        assert stats.skipped >= 1
        # the count is in the metrics of the snapshots committed after the thaw
        after = [m for step, m in metrics.logged if step >= thaw_at]
        assert after and after[-1]["snapshot/skipped"] == stats.skipped, metrics.logged[-3:]
    else:
        assert not skipped  # a synchronous snapshot fails within the bound instead

    # Snapshots commit again once the server answers; the last is the final state.
    committed_steps = [r.step for r in stats.committed]
    assert committed_steps[-1] == steps
    assert any(s > thaw_at for s in committed_steps)
    fresh = ToyUnit(seed=42)
    assert TorchSnapshotSaver.restore_from_latest(url, fresh, storage_options=options)
    assert fresh.train_progress.num_steps_completed == steps
    assert_bitwise_equal(weights(fresh), weights(unit))


def test_request_limits_fit_the_bound(monkeypatch):
    """Every request's attempts, timeouts and backoff fit inside the bound."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    for bound in (0.5, 2.0, 3.0, 10.0, 30.0, DEFAULT_STORAGE_TIMEOUT_S, 600.0):
        attempts, connect, read = request_limits(bound)
        assert attempts >= 1 and connect > 0 and read > 0
        assert attempts * (connect + read) + _backoff_s(attempts) <= bound + 1e-9, bound
    assert request_limits(DEFAULT_STORAGE_TIMEOUT_S)[0] == 4  # retries at the default
    assert DEFAULT_STORAGE_TIMEOUT_S <= 60
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    assert request_limits(DEFAULT_STORAGE_TIMEOUT_S)[0] == 2


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "60", True, None])
def test_storage_timeout_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError, match="storage_timeout_s"):
        SnapshotConfig.build(storage_timeout_s=bad)
    assert SnapshotConfig.build().storage_timeout_s == DEFAULT_STORAGE_TIMEOUT_S


def test_a_write_stops_starting_files_once_one_has_failed(tmp_path, request):
    """A storage that hangs then fails every request (as a frozen endpoint's timeouts do): the
    files in flight fail, and the snapshot's other files are never started, so the failed write
    ends after one request's time instead of one per file."""
    faulty = FaultyStore(LocalStore(str(tmp_path)))
    name = f"stuck-{uuid.uuid4().hex[:8]}"
    url = register(name, faulty)
    request.addfinalizer(lambda: unregister(name))

    def hang_then_fail(*args: Any) -> None:
        time.sleep(0.5)
        raise OSError("the storage did not answer in time (injected)")

    saver = Snapshotter(url, SnapshotConfig.build(async_snapshot=False, on_save_error="raise"))
    saver.train_start(["h"], 0, 0)
    faulty.hook("write_payload", before=hang_then_fail)
    # ten tensors of 4 MiB: each a file of its own, written DEFAULT_IO_THREADS at a time
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(10)}
    with pytest.raises(SnapshotWriteError, match="did not answer"):
        saver.save(0, 1, {"h": Holder(state)})
    started = [args for op, args in faulty.calls if op == "write_payload"]
    assert 1 <= len(started) <= DEFAULT_IO_THREADS, started
    saver.train_end(0, 1, lambda intra_epoch: {})
