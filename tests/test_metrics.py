"""Snapshot figures where users watch their runs: Python logging, torchtnt's MetricLogger and
Lightning's logger, from real ``train`` / ``Trainer.fit`` runs; and what restores log."""

from __future__ import annotations

import csv
import json
import logging
import time

import pytest
import torch
from click.testing import CliRunner
from lightning_toy import ToyModule, make_trainer, plain_loader
from lightning_toy import weights as module_weights
from pytorch_lightning.loggers import CSVLogger
from torchtnt.framework.train import train
from torchtnt.utils.loggers import InMemoryLogger

from tnt_snapshot_plugin import SnapshotFallbackWarning
from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.errors import SnapshotBusyWarning
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from toy import StatefulLoader, ToyUnit, assert_bitwise_equal, make_data

pytestmark = pytest.mark.slow

METRICS = {
    "snapshot/stall_s",
    "snapshot/durable_s",
    "snapshot/bytes_written",
    "snapshot/write_MBps",
    "snapshot/waited_s",
    "snapshot/busy_waits",
    "snapshot/skipped",
}


def index_bytes(path) -> int:
    with open(f"{path}/{INDEX_FNAME}") as f:
        return sum(json.load(f)["files"].values())


@pytest.fixture
def slow_disk(faulty_local):
    """``slow_disk(path) -> dirpath``: the real disk at ``path``, where each snapshot's packed file
    takes 0.6 s longer to write (a FaultyStore hook): longer than a toy training step, so every
    snapshot due at a step end finds the previous one still being written, and the waits add up
    to more than SnapshotBusyWarning's threshold (job.BUSY_WARNING_S)."""

    def make(path) -> str:
        faulty, dirpath = faulty_local(path)
        faulty.hook("write_payload", before=lambda name, rel: time.sleep(0.6), match=lambda name, rel: rel.startswith("batched/"))
        return dirpath

    return make


def test_torchtnt_metrics_go_to_the_metric_logger_and_logging(tmp_path, slow_disk, caplog):
    caplog.set_level(logging.DEBUG, logger="tnt_snapshot_plugin")
    metric_logger = InMemoryLogger()
    saver = TorchSnapshotSaver(
        slow_disk(tmp_path / "run"), save_every_n_train_steps=1, save_on_train_end=False, metric_logger=metric_logger
    )
    with pytest.warns(SnapshotBusyWarning, match="still being written") as busy:
        train(ToyUnit(), StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])

    committed = saver.snapshotter.stats.committed
    assert [r.step for r in committed] == [1, 2, 3, 4]
    assert sorted(metric_logger.log_buffer) == [1, 2, 3, 4]
    for record in committed:
        logged = metric_logger.log_buffer[record.step]
        assert set(logged) - {"step", "time"} == METRICS  # InMemoryLogger adds those two
        assert record.bytes_written == index_bytes(record.path) > 0
        assert logged["snapshot/bytes_written"] == record.bytes_written
        assert logged["snapshot/stall_s"] == record.stall_s
        assert logged["snapshot/durable_s"] == record.durable_s
        assert logged["snapshot/write_MBps"] == pytest.approx(record.bytes_written / record.durable_s / 1e6)

    # Python logging: one INFO line per committed snapshot.
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "committed:" in r.getMessage()]
    assert len(info) == 4
    assert all("training blocked" in m and "durable after" in m and "MB/s" in m for m in info)

    # Training waited for snapshots still being written, more than the threshold in all: one
    # warning per run; every wait counted and logged at DEBUG.
    stats = saver.snapshotter.stats
    assert stats.busy_waits >= 2
    # A warning of a category users can filter (warnings.filterwarnings), not a log line.
    warned = [w for w in busy if issubclass(w.category, SnapshotBusyWarning)]
    assert len(warned) == 1
    assert "training has waited" in str(warned[0].message)
    logged = [r for r in caplog.records if "was still being written; training waited" in r.getMessage()]
    assert [r.levelno for r in logged] == [logging.DEBUG] * stats.busy_waits
    assert committed[-1].busy_waits == stats.busy_waits
    assert metric_logger.log_buffer[4]["snapshot/busy_waits"] == stats.busy_waits


def test_the_units_own_logger_is_used_and_restores_say_what_they_did(tmp_path, caplog):
    unit = ToyUnit()
    unit.logger = InMemoryLogger()
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(8)), max_epochs=2, callbacks=[saver])
    assert sorted(unit.logger.log_buffer) == [2, 4]

    # Damage the newest: restore_from_latest logs what it used, how long, and what it skipped.
    newest = tmp_path / "epoch_2_step_4"
    with open(f"{newest}/{INDEX_FNAME}") as f:
        files = json.load(f)["files"]
    victim = newest / max(files, key=files.get)
    victim.write_bytes(victim.read_bytes()[:10])
    caplog.set_level(logging.INFO, logger="tnt_snapshot_plugin")
    with pytest.warns(SnapshotFallbackWarning, match="skipping damaged snapshot"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), ToyUnit(seed=3))
    messages = [r.getMessage() for r in caplog.records]
    restored = [m for m in messages if m.startswith("restored snapshot ")]
    assert len(restored) == 1 and str(tmp_path / "epoch_1_step_2") in restored[0] and " in " in restored[0]
    used = [m for m in messages if "restore_from_latest" in m and " used " in m]
    assert len(used) == 1 and "epoch_2_step_4" in used[0] and "has 10 bytes" in used[0]


def test_lightning_metrics_go_to_trainer_logger_and_export_reads_its_snapshot(tmp_path):
    dirpath = tmp_path / "snaps"
    saver = LightningSaver(str(dirpath), save_every_n_train_steps=2, async_snapshot=False)
    csv_logger = CSVLogger(str(tmp_path / "logs"), name="toy")
    model = ToyModule()
    trainer = make_trainer(tmp_path, [saver], logger=csv_logger, max_epochs=1)
    trainer.fit(model, plain_loader(20, batch_size=4))

    committed = saver.snapshotter.stats.committed
    steps = [r.step for r in committed]
    assert steps == [2, 4, 5]  # every 2 steps, then the final snapshot at train end
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("snapshot/bytes_written")]
    assert [int(row["step"]) for row in rows] == steps
    for row, record in zip(rows, committed, strict=True):
        assert METRICS <= set(row)
        assert int(float(row["snapshot/bytes_written"])) == record.bytes_written == index_bytes(record.path)

    # export finds the Lightning checkpoint's weights (its one tensors-only entry: state_dict).
    out = tmp_path / "weights.pt"
    result = CliRunner().invoke(cli, ["export", committed[-1].path, str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["key"] == "state_dict"
    fresh = ToyModule(seed=7)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    assert_bitwise_equal(module_weights(fresh), module_weights(model))
